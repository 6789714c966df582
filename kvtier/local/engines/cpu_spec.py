"""vLLM's TieringOffloadingSpec, runnable on a CPU-only machine (test harness only).

vLLM's own offloading worker refuses to start without CUDA/XPU and its copy kernels
(swap_blocks) have no CPU build. This spec keeps everything of TieringOffloadingSpec (the
scheduler-side manager, the shared host region, the secondary tiers, kvtier among them) and
only replaces the worker: pages are copied between the engine's KV tensors and the shared
host region with torch indexing, in the layout vLLM's worker would write: the direct layout
(whole pages, per worker) or, with `canonical_layout` (what kvtier's webhook injects), each
layer's page scattered into its canonical page through the mapping vLLM certified for it.
Loaded through the connector's `spec_module_path`.

`kvtier_test_zero_loads` in the connector's extra config makes the worker zero every page
it loads: a test's proof that an engine computes with the KV it reloads, whatever tier
served it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


@dataclass(frozen=True)
class _LayerCopy:
    """One layer reference: which bytes of an engine page go where in a host sub-block."""

    engine: torch.Tensor  # (engine blocks, page bytes), int8
    host: torch.Tensor  # (host chunks, blocks per chunk, host page bytes), int8, strided
    local: torch.Tensor  # byte offsets in the engine page...
    canonical: torch.Tensor  # ...and where each lands in the host page


def _byte_map(ref: CanonicalKVCacheRef, canonical: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not canonical:
        whole = torch.arange(ref.page_size_bytes)
        return whole, whole
    assert ref.mapping is not None and ref.mapping.num_writers == 1  # one worker here
    local, target = [], []
    for run in ref.mapping.runs:
        fragment = np.arange(run.fragment_size)
        for i in range(run.num_fragments):
            local.append(run.local_offset + i * run.local_stride + fragment)
            target.append(run.canonical_offset + i * run.canonical_stride + fragment)
    return torch.from_numpy(np.concatenate(local)), torch.from_numpy(np.concatenate(target))


class TorchCopyWorker(OffloadingWorker):
    """Synchronous copies; engine blocks map to host sub-blocks as in vLLM's worker (a
    group's first block may start in the middle of a host chunk)."""

    def __init__(
        self,
        kv_caches: Any,
        region: SharedOffloadRegion,
        blocks_per_chunk: int,
        canonical: bool,
        zero_loads: bool = False,
    ) -> None:
        self.region = region
        self.zero_loads = zero_loads
        self.blocks_per_chunk = blocks_per_chunk
        host_pages = [t.page_size_bytes for t in kv_caches.tensors]
        if canonical:
            host_pages = [0] * len(kv_caches.tensors)
            for ref in (r for group in kv_caches.group_data_refs for r in group):
                assert ref.mapping is not None
                host_pages[ref.tensor_idx] = max(
                    host_pages[ref.tensor_idx], ref.mapping.canonical_page_size_bytes
                )
        engines, hosts = [], []
        for t, page in zip(kv_caches.tensors, host_pages, strict=True):
            engines.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes))
            size = page * blocks_per_chunk
            view = (
                region.create_next_canonical_view(size)
                if canonical
                else region.create_next_worker_view(size)
            )
            hosts.append(view.unflatten(1, (blocks_per_chunk, page)))
        self.groups = [
            [
                _LayerCopy(engines[r.tensor_idx], hosts[r.tensor_idx], *_byte_map(r, canonical))
                for r in refs
            ]
            for refs in kv_caches.group_data_refs
        ]
        self.finished: list[TransferResult] = []

    def _copy(self, job_id: int, src: Any, dst: Any, to_host: bool) -> bool:
        engine_spec, host_spec = (src, dst) if to_host else (dst, src)
        engine_ids = np.asarray(engine_spec.block_ids, dtype=np.int64)
        chunk_ids = np.asarray(host_spec.block_ids, dtype=np.int64)
        bpc = self.blocks_per_chunk
        engine_at = chunk_at = size = 0
        for layers, count, first in zip(
            self.groups, engine_spec.group_sizes, engine_spec.block_indices, strict=True
        ):
            if count == 0:
                continue
            skip = first % bpc
            chunks = -(-(count + skip) // bpc)
            sub_blocks = chunk_ids[chunk_at : chunk_at + chunks, None] * bpc + np.arange(bpc)
            flat = torch.from_numpy(sub_blocks.ravel()[skip : skip + count])
            blocks = torch.from_numpy(engine_ids[engine_at : engine_at + count])
            chunk, sub = flat // bpc, flat % bpc
            for layer in layers:
                if to_host:
                    rows = layer.host[chunk, sub]
                    rows[:, layer.canonical] = layer.engine[blocks][:, layer.local]
                    layer.host[chunk, sub] = rows
                else:
                    pages = layer.engine[blocks]
                    pages[:, layer.local] = layer.host[chunk, sub][:, layer.canonical]
                    layer.engine[blocks] = 0 if self.zero_loads else pages
                size += count * len(layer.local)
            engine_at, chunk_at = engine_at + count, chunk_at + chunks
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
        self.groups.clear()
        self.region.cleanup()


class CPUTestTieringSpec(TieringOffloadingSpec):
    _worker: OffloadingWorker | None

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            canonical = bool(self.config.canonical_layout)
            if canonical:
                self._validate_canonical_refs(kv_caches)  # vLLM's own check: fail closed
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            zero_loads = bool(self.extra_config.get("kvtier_test_zero_loads", False))
            self._worker = TorchCopyWorker(
                kv_caches, region, self.blocks_per_chunk, canonical, zero_loads
            )
        return self._worker
