"""Admission at shutdown: `close` refuses new requests only; `turn_away` also answers the queued ones and retries."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.core.config import AdmissionConfig
from router.core.errors import ServiceUnavailable
from router.dataplane.admission import Admission

from .helpers import wait_for

REASON = "the router is shutting down (SIGTERM)"


async def test_close_refuses_new_requests_while_admitted_ones_and_their_retries_go_on():
    admission = Admission(AdmissionConfig())
    async with admission.slot():
        admission.close(REASON)
        await admission.wait_open(time.monotonic() + 1)  # a retry of an admitted request
        with pytest.raises(ServiceUnavailable, match="shutting down") as refused:
            async with admission.slot():
                pass
        assert refused.value.headers == {"Retry-After": "1"}
    assert admission.active == 0 and admission.state()["closed"] == REASON


async def test_turn_away_answers_queued_requests_and_retries_waiting_for_a_hold():
    admission = Admission(AdmissionConfig())
    admission.close_gate("release_memory_occupation")

    async def queued() -> None:
        async with admission.slot():
            pass

    waiting = [asyncio.ensure_future(queued()) for _ in range(3)]
    retry = asyncio.ensure_future(admission.wait_open(time.monotonic() + 60))
    await wait_for(lambda: admission.waiting == 3)
    admission.turn_away(REASON)
    for task in waiting + [retry]:
        with pytest.raises(ServiceUnavailable, match="shutting down"):
            await asyncio.wait_for(task, 1)
    assert admission.active == 0 and admission.waiting == 0
    with pytest.raises(ServiceUnavailable):  # and every later retry
        await admission.wait_open(time.monotonic() + 60)
