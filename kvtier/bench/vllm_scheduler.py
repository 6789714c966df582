"""The scheduler side of a vLLM engine, built from vLLM's own classes (vLLM environment only).

`Engine` wraps the `TieringOffloadingManager` that vLLM's `TieringOffloadingSpec` builds from
a real `OffloadingConfig` and a connector config (kvtier's, or vLLM's native tiers), and
drives it the way vLLM's OffloadingConnector scheduler does: lookups once per step until
they settle, stores into the primary host buffer (standing in for the GPU-to-host copy)
followed by `complete_store`, loads through `prepare_load`. The plug-in tests and
`kvtier bench vllm` use it.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.api.config import AgentConfig
from kvtier.api.transfer_config import build_kv_transfer_config
from kvtier.shm.pool import Bytes

ROW = 64 * 1024
_ids = itertools.count()


def chunk_key(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(b"block-%d" % i).digest(), 0)


def chunk_row(i: int, nbytes: int = ROW) -> Bytes:
    return (np.arange(nbytes, dtype=np.uint32) * 40503 + i * 7).astype(np.uint8)


def kvtier_extra_config(
    agent: AgentConfig, chunks: int, row: int = ROW, timeout_seconds: float = 2.0
) -> dict[str, Any]:
    config = build_kv_transfer_config(
        agent, cpu_bytes_to_use=chunks * row, timeout_seconds=timeout_seconds
    )
    return dict(config["kv_connector_extra_config"])


def offloading_config(
    extra: dict[str, Any], model: str, dtype: str, row: int = ROW
) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=0,
        is_parallelism_agnostic=True,
    )
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=row,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id=f"engine-{next(_ids)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=parallel,
    )


class Engine:
    def __init__(
        self,
        extra_config: dict[str, Any],
        model: str = "tiny-llama",
        dtype: str = "float16",
        row: int = ROW,
        step_sleep: float = 0.01,
    ) -> None:
        self.extra_config = extra_config
        self.spec = TieringOffloadingSpec(offloading_config(extra_config, model, dtype, row))
        self.manager = self.spec.get_manager()
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.row = row
        self.step_sleep = step_sleep

    @property
    def tier(self) -> Any:
        return self.manager.secondary_tiers[0]

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError("offloading jobs did not finish")
            self.step()
            time.sleep(self.step_sleep / 2)
        self.step()

    def begin_store(self, ids: list[int]) -> tuple[ReqContext, list[OffloadKey]]:
        """vLLM's prepare_store, then the rows written into the primary buffer (what the
        GPU-to-host copy does in an engine)."""
        ctx = ReqContext(req_id=f"store-{next(_ids)}")
        self.manager.on_new_request(ctx)
        keys = [chunk_key(i) for i in ids]
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[int(chunk)] = chunk_row(ids[keys.index(key)], self.row)
        return ctx, list(out.keys_to_store)

    def finish_store(self, ctx: ReqContext, keys: list[OffloadKey]) -> None:
        """complete_store, after which the manager cascades to the secondary tiers; returns
        once every cascade job has finished."""
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def store(self, ids: list[int]) -> list[OffloadKey]:
        ctx, keys = self.begin_store(ids)
        self.finish_store(ctx, keys)
        return keys

    def lookup(
        self, ids: list[int], timeout: float = 20.0, params: dict[str, Any] | None = None
    ) -> tuple[list[LookupResult], list[list[LookupResult]]]:
        """Look up once per scheduler step until no answer is RETRY or HIT_PENDING; returns
        the final answers and the per-step trace. `params`: the request's kv_transfer_params."""
        ctx = ReqContext(req_id=f"lookup-{next(_ids)}", kv_transfer_params=params)
        self.manager.on_new_request(ctx)
        trace: list[list[LookupResult]] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                answers = [self.manager.lookup(chunk_key(i), ctx) for i in ids]
                trace.append(answers)
                if not {LookupResult.RETRY, LookupResult.HIT_PENDING} & set(answers):
                    return answers, trace
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lookups did not settle: {answers}")
                self.step()
                time.sleep(self.step_sleep)
        finally:
            self.manager.on_request_finished(ctx)
            self.settle()

    def read(self, ids: list[int]) -> list[Bytes]:
        """Rows of chunks that lookup() reported HIT, read from vLLM's primary tier."""
        ctx = ReqContext(req_id=f"load-{next(_ids)}")
        self.manager.on_new_request(ctx)
        keys = [chunk_key(i) for i in ids]
        spec = self.manager.prepare_load(keys, ctx)
        rows = [self.rows[int(c)].copy() for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        self.manager.on_request_finished(ctx)
        return rows

    def reset_primary(self) -> None:
        """vLLM's reset_cache: drain the tiers, then empty the per-engine host buffer."""
        self.manager.reset_cache()

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()
