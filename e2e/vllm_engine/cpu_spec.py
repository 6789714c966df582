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

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        blocks, chunks = self._index(src_spec.block_ids), self._index(dst_spec.block_ids)
        size = 0
        for engine, host in self.pairs:
            host.index_copy_(0, chunks, engine.index_select(0, blocks))
            size += engine.shape[1] * len(blocks)
        self.finished.append(TransferResult(job_id, True, transfer_size=size))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        chunks, blocks = self._index(src_spec.block_ids), self._index(dst_spec.block_ids)
        size = 0
        for engine, host in self.pairs:
            engine.index_copy_(0, blocks, host.index_select(0, chunks))
            size += engine.shape[1] * len(blocks)
        self.finished.append(TransferResult(job_id, True, transfer_size=size))
        return True

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
