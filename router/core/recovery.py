"""How an operation whose router replica died is finished: by the flow it belongs to.

A replica that takes an orphaned operation over (`cluster/takeover.py`) knows only its record; the flow that
runs such operations knows what each of its steps may have left behind on the servers, so the flow decides
(the conversion flow for a conversion, the weight-update flow for an update) and the takeover only finds the
orphan, takes it and closes its record with what `recover` returned. One rule, whoever ran the operation.
"""

from __future__ import annotations

from typing import Protocol

from router.core.coordination import Ticket


class Recovery(Protocol):
    async def recover(self, ticket: Ticket, record: dict) -> tuple[str, str]:
        """Bring what the operation (`ticket`: its kind and details) left to a state the fleet can serve in,
        from its `record` as its owner last wrote it (`step`, `owner`, `started_at`); return its outcome
        and a message saying what was found and done."""
        ...
