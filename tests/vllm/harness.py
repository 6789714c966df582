"""The scheduler side of a vLLM engine, built from vLLM's own classes.

`Engine` wraps the `TieringOffloadingManager` that vLLM's `TieringOffloadingSpec` builds from
a real `OffloadingConfig` and the kvtier `--kv-transfer-config`, and drives it the way
vLLM's OffloadingConnector scheduler does: lookups once per step until they settle,
stores into the primary host buffer (standing in for the GPU-to-host copy, which on CPU
has no kernel) followed by `complete_store`, loads through `prepare_load`.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.base import ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.agent.config import AgentConfig
from kvtier.agent.transfer_config import build_kv_transfer_config

ROW = 64 * 1024
_ids = itertools.count()


def chunk_key(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(b"block-%d" % i).digest(), 0)


def chunk_row(i: int) -> np.ndarray:
    return (np.arange(ROW, dtype=np.uint32) * 40503 + i * 7).astype(np.uint8)


def offloading_config(extra: dict[str, Any], model: str, dtype: str) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=0,
        is_parallelism_agnostic=True,
    )
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id=f"engine-{next(_ids)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=parallel,
    )


class Engine:
    def __init__(
        self, agent: AgentConfig, model: str = "tiny-llama", dtype: str = "float16",
        chunks: int = 16, timeout_seconds: float = 2.0,
    ) -> None:
        config = build_kv_transfer_config(
            agent, cpu_bytes_to_use=chunks * ROW, timeout_seconds=timeout_seconds
        )
        self.transfer_config = config
        self.spec = TieringOffloadingSpec(
            offloading_config(dict(config["kv_connector_extra_config"]), model, dtype)
        )
        self.manager = self.spec.get_manager()
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

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
            time.sleep(0.005)
        self.step()

    def store(self, ids: list[int]) -> list[OffloadKey]:
        """Store chunks into vLLM's primary tier; the manager cascades them to kvtier."""
        ctx = ReqContext(req_id=f"store-{next(_ids)}")
        self.manager.on_new_request(ctx)
        keys = [chunk_key(i) for i in ids]
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[int(chunk)] = chunk_row(ids[keys.index(key)])
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return out.keys_to_store

    def lookup(self, ids: list[int], timeout: float = 20.0) -> tuple[list[LookupResult], list[list[LookupResult]]]:
        """Look up once per scheduler step until no answer is RETRY or HIT_PENDING; returns
        the final answers and the per-step trace."""
        ctx = ReqContext(req_id=f"lookup-{next(_ids)}")
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
                time.sleep(0.01)
        finally:
            self.manager.on_request_finished(ctx)
            self.settle()

    def read(self, ids: list[int]) -> list[np.ndarray]:
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
