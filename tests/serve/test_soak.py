"""A scaled-down soak (`benchmarks/soak.py`): 100 mixed requests at concurrency 32 against a
real server, a quarter dropped mid-stream; every finished answer whole and consistent with
its usage, one text per prompt, no KV page leaked."""

from __future__ import annotations

import asyncio

from serving import live_server
from soak import soak

from dynalm.models.loader import LoadedModel
from workload import assert_no_leak


def test_soak_100_requests(smollm2: LoadedModel) -> None:
    with live_server(smollm2, ctx=1024, max_num_seqs=16) as server:
        result = asyncio.run(soak(server.url, requests=100, concurrency=32, max_tokens=16))
        print(f"\n{result.summary()}")
        assert result.problems == []
        assert (result.requests, result.cancelled) == (100, 25)
        assert result.kv_usage_after == 0
        assert_no_leak(server.engine)
