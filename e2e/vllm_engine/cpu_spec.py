"""vLLM's TieringOffloadingSpec, runnable on a CPU-only machine (test harness only).

vLLM's own offloading worker refuses to start without CUDA/XPU and its copy kernels
(swap_blocks) have no CPU build. This spec keeps everything of TieringOffloadingSpec (the
scheduler-side manager, the shared host region, the secondary tiers, kvtier among them) and
only replaces the worker: pages are copied between the engine's KV tensors and the shared
host region with torch's index_select/index_copy_. Loaded through the connector's
`spec_module_path`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class TorchCopyWorker(OffloadingWorker):
    """Synchronous page copies; blocks_per_chunk must be 1 (one engine block per row)."""

    def __init__(self, kv_caches: Any, region: SharedOffloadRegion) -> None:
        self.region = region
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in kv_caches.tensors:
            engine = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            host = region.create_next_worker_view(t.page_size_bytes)
            self.pairs.append((engine, host))
        self.finished: list[TransferResult] = []

    @staticmethod
    def _index(ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(ids, dtype=np.int64))

    def _copy(self, job_id: int, src: Any, dst: Any, to_host: bool) -> bool:
        src_ids, dst_ids = self._index(src.block_ids), self._index(dst.block_ids)
        size = 0
        for engine, host in self.pairs:
            source, target = (engine, host) if to_host else (host, engine)
            target.index_copy_(0, dst_ids, source.index_select(0, src_ids))
            size += engine.shape[1] * len(src_ids)
        self.finished.append(TransferResult(job_id, True, transfer_size=size))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self.finished = self.finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        self.pairs.clear()
        self.region.cleanup()


class CPUTestTieringSpec(TieringOffloadingSpec):
    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            if self.blocks_per_chunk != 1:
                raise ValueError("the CPU test worker copies one engine block per row")
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = TorchCopyWorker(kv_caches, region)
        return self._worker
