"""--prometheus-duration-buckets (the peers'): the bounds of the request-duration histogram."""

from __future__ import annotations

import pytest

from router.core.config import ConfigError
from router.server.cli import config_from_args


async def test_the_request_duration_histogram_has_the_given_bounds(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], prometheus_duration_buckets=(0.5, 5.0))
    assert (await router.post("/generate", json={"text": "hi"})).status == 200
    text = await (await router.get("/metrics")).text()
    bounds = {line.split('le="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("pd_router_request_duration_seconds_bucket")}
    assert bounds == {"0.5", "5.0", "+Inf"}


@pytest.mark.parametrize("values", [["1", "0.5"], ["0", "1"], ["1", "inf"]])
def test_bounds_must_be_positive_finite_and_increasing(values):
    with pytest.raises(ConfigError, match="--prometheus-duration-buckets"):
        config_from_args(["--prometheus-duration-buckets", *values], env={})
