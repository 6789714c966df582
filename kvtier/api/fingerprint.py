"""The run fingerprint: everything that determines the bytes of a KV chunk.

Two engines may exchange chunks only when every component matches; a model name alone is
never enough (the same path can hold other weights, an `hf_overrides` can change the rope
base). The fingerprint becomes the chunk namespace, which carries a strong digest of all
components (what keeps engines apart) followed by a short tag per component (what lets
`kubectl kvtier` say *which* component differs between two engines of one model):

    <model>-<digest of everything, 128 bits>.<tag><4 hex>...   e.g.  llama-3-8b-3f…a1.m1a2bw77c0…

The plug-in computes it inside vLLM's scheduler process: at module level this imports only
the standard library (the operator parses namespaces with it); vLLM is imported by the
functions that read its state, and vLLM's objects are read by attribute.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Bump when the fingerprint's content or the namespace's form changes: chunks stored under
# an older fingerprint are then never found again (they age out through eviction).
FINGERPRINT_VERSION = 2
# kvtier.agent.chunk.CHUNK_VERSION; chunk.py needs xxhash, which vLLM's environment lacks,
# so the value is repeated here and a test keeps the two equal.
CHUNK_FORMAT_VERSION = 1

# Component -> the one-letter tag it has in a namespace.
TAGS = {
    "model": "m",  # the model config as vLLM resolved it (after overrides), quantisation
    "weights": "w",  # the checkpoint's revision and a digest of its weight files
    "dtype": "d",  # compute dtype and KV-cache dtype
    "geometry": "g",  # block/chunk/hash sizes, KV groups, row bytes
    "layout": "l",  # canonical format id, or the parallel layout the rows depend on
    "hash": "h",  # the block-hash algorithm and its NONE_HASH seed
    "format": "f",  # fingerprint and chunk format versions
    "scope": "s",  # the Kubernetes namespace, with isolation "namespace"
}
NAMES = {tag: name for name, tag in TAGS.items()}
TAG_HEX = 4
DIGEST_HEX = 32
_NAMESPACE = re.compile(
    rf"^(?P<model>.*)-(?P<digest>[0-9a-f]{{{DIGEST_HEX}}})\.(?P<tags>(?:[a-z][0-9a-f]{{{TAG_HEX}}})+)$"
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".msgpack")
SAMPLES_PER_FILE = 8
SAMPLE_BYTES = 4096
MAX_SAFETENSORS_HEADER = 100 << 20


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    model: str  # the model's name (a local path's last part), for people reading namespaces
    components: dict[str, Any] = field(default_factory=dict)

    def tags(self) -> dict[str, str]:
        """A short digest per component: enough to tell components apart in a report."""
        return {name: _digest(value)[:TAG_HEX] for name, value in self.components.items()}

    @property
    def namespace(self) -> str:
        label = "".join(c if c.isalnum() or c in "._-" else "_" for c in self.model)[-40:]
        tags = "".join(f"{TAGS[name]}{tag}" for name, tag in sorted(self.tags().items()))
        return f"{label}-{_digest(self.components)[:DIGEST_HEX]}.{tags}"

    def with_component(self, name: str, value: Any) -> Fingerprint:
        return Fingerprint(self.model, {**self.components, name: value})


@dataclass(frozen=True)
class ParsedNamespace:
    model: str
    digest: str
    tags: dict[str, str]  # component name -> tag


def parse_namespace(namespace: str) -> ParsedNamespace | None:
    """The parts of a namespace this module made; None for any other string (older
    fingerprints, a client's own namespaces)."""
    match = _NAMESPACE.match(namespace)
    if match is None:
        return None
    raw = match["tags"]
    step = 1 + TAG_HEX
    tags = {NAMES.get(raw[i], raw[i]): raw[i + 1 : i + step] for i in range(0, len(raw), step)}
    return ParsedNamespace(match["model"], match["digest"], tags)


def differing_components(namespaces: list[str]) -> list[str]:
    """Components whose tags differ between namespaces of one model, in TAGS order."""
    parsed = [p for p in map(parse_namespace, namespaces) if p is not None]
    return [name for name in TAGS if len({p.tags.get(name) for p in parsed if name in p.tags}) > 1]


# --- the model as vLLM resolved it -------------------------------------------------------


def model_config_digest(model_config: Any) -> dict[str, Any]:
    """The resolved Hugging Face config (hf_overrides applied) and vLLM's own knobs that
    change the computed KV. Private keys and the path the config was read from are left
    out: the weights component identifies the checkpoint."""
    to_dict = getattr(getattr(model_config, "hf_config", None), "to_dict", None)
    resolved: dict[str, Any] = to_dict() if callable(to_dict) else {}
    kept = {
        k: v
        for k, v in resolved.items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")
    }
    return {
        "config": _digest(kept)[:DIGEST_HEX],
        "architecture": list(resolved.get("architectures") or []),
        "quantization": str(getattr(model_config, "quantization", None)),
    }


# --- the weights -------------------------------------------------------------------------


def _hf_snapshot(repo: str, revision: str | None, cache_dirs: list[Path]) -> Path | None:
    """The local snapshot of a Hugging Face repository, as huggingface_hub lays out its
    cache (`models--org--name/refs/<revision>` holds the commit; `snapshots/<commit>/`)."""
    folder = "models--" + repo.replace("/", "--")
    for cache in cache_dirs:
        repo_dir = cache / folder
        ref = repo_dir / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else (revision or "")
        snapshot = repo_dir / "snapshots" / commit
        if commit and snapshot.is_dir():
            return snapshot
    return None


def _cache_dirs(download_dir: str | None) -> list[Path]:
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    dirs = [Path(download_dir)] if download_dir else []
    dirs.append(Path(os.environ.get("HF_HUB_CACHE") or home / "hub"))
    return dirs


def _weight_files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        hidden = any(part.startswith(".") for part in relative.parts)
        if not hidden and path.suffix in WEIGHT_SUFFIXES and path.is_file():
            yield path


def _file_identity(path: Path, hasher: Any) -> None:
    """Size, the safetensors header (names, dtypes, shapes, offsets, metadata) and a few
    pages sampled across the file. Headers alone cannot tell a fine-tune from its base
    (same tensors, same shapes); sampled pages can, at the cost of a few reads."""
    size = path.stat().st_size
    hasher.update(struct.pack("<Q", size))
    with path.open("rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (length,) = struct.unpack("<Q", f.read(8))
            if length <= min(size - 8, MAX_SAFETENSORS_HEADER):
                hasher.update(f.read(length))
                start = 8 + length
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + span * i // max(SAMPLES_PER_FILE - 1, 1))
            hasher.update(f.read(SAMPLE_BYTES))


def weights_identity(model: str, revision: str | None, download_dir: str | None) -> Any:
    """The checkpoint's identity: its commit where Hugging Face's cache names one, and a
    digest of its weight files' names, sizes, safetensors headers and sampled pages.
    None when no local copy can be found (weights streamed from elsewhere): such an engine
    cannot prove what it runs and shares nothing."""
    root = Path(model)
    commit = None
    hasher = hashlib.sha256()
    files = 0
    try:
        if not root.exists():
            snapshot = _hf_snapshot(model, revision, _cache_dirs(download_dir))
            if snapshot is None:
                return None
            root, commit = snapshot, snapshot.name
        for path in _weight_files(root):
            hasher.update(str(path.relative_to(root) if root.is_dir() else path.name).encode())
            _file_identity(path, hasher)
            files += 1
    except OSError:
        return None  # unreadable: unknown, as if absent
    if not files:
        return None
    return {"commit": commit, "revision": revision, "files": hasher.hexdigest()[:DIGEST_HEX]}


# --- the whole fingerprint ---------------------------------------------------------------


def _parallel_layout(config: Any) -> dict[str, Any]:
    """What a row's bytes depend on beyond the model: the canonical format (rows
    independent of parallelism), else the sharding of the direct layout."""
    layout: dict[str, Any] = {"replicated": bool(getattr(config, "replicated_layout", False))}
    parallel = config.parallel
    if getattr(config, "canonical_layout", False):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        layout["canonical"] = canonical_format_id(config.kv_cache_layout)
    else:
        layout["kv_cache_layout"] = getattr(config, "kv_cache_layout", None)
    if not getattr(config, "canonical_layout", False) or not parallel.is_parallelism_agnostic:
        layout["parallel"] = {
            name: getattr(parallel, name, None)
            for name in ("tp_size", "pp_size", "pcp_size", "dcp_size", "world_size", "rank")
        }
    return layout


def _groups(config: Any) -> list[dict[str, Any]]:
    return [
        {
            "group": g.group_id,
            "tokens_per_block": g.tokens_per_block,
            "layers": len(g.layer_names),
            "names": _digest(list(g.layer_names))[:TAG_HEX],
            "window_chunks": getattr(g, "sliding_window_size_in_chunks", None),
        }
        for g in config.groups
    ]


def engine_fingerprint(
    offloading_config: Any, vllm_config: Any | None, row_bytes: int, scope: str | None
) -> Fingerprint:
    """Every component but the hash seed, which vLLM sets only once the engine core runs
    (see `with_hash_seed`). Without vLLM's config (an engine built some other way) the
    model and weights are unknown: the fingerprint then carries a random value, so the
    engine shares with nobody rather than with the wrong model."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        load_config = getattr(vllm_config, "load_config", None)
        model = model_config_digest(model_config)
        weights = weights_identity(
            str(model_config.model),
            getattr(model_config, "revision", None),
            getattr(load_config, "download_dir", None),
        )
        compute_dtype = str(getattr(model_config, "dtype", "")).removeprefix("torch.")
    else:
        model, weights, compute_dtype = None, None, ""
    components: dict[str, Any] = {
        "model": model if model is not None else {"unknown": os.urandom(16).hex()},
        "weights": weights if weights is not None else {"unknown": os.urandom(16).hex()},
        "dtype": {"compute": compute_dtype, "kv": str(offloading_config.model.dtype)},
        "geometry": {
            "tokens_per_hash": offloading_config.cache.tokens_per_hash,
            "blocks_per_chunk": offloading_config.cache.blocks_per_chunk,
            "groups": _groups(offloading_config),
            "row_bytes": row_bytes,
        },
        "layout": _parallel_layout(offloading_config),
        "format": {"fingerprint": FINGERPRINT_VERSION, "chunk": CHUNK_FORMAT_VERSION},
    }
    if scope:
        components["scope"] = scope
    name = str(offloading_config.model.name)
    return Fingerprint(Path(name).name if Path(name).exists() else name, components)


def with_hash_seed(fingerprint: Fingerprint, vllm_config: Any | None) -> Fingerprint:
    """Add the block-hash algorithm and a digest of vLLM's NONE_HASH, which covers the
    PYTHONHASHSEED-derived seed; NONE_HASH exists once the engine core has started."""
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    return fingerprint.with_component(
        "hash",
        {
            "algorithm": str(getattr(cache_config, "prefix_caching_hash_algo", None)),
            # Unset only outside an engine core (harnesses driving the scheduler classes);
            # the keys themselves are chained from NONE_HASH, so this is a second guard.
            "none_hash": hashlib.sha256(bytes(none_hash)).hexdigest()[:DIGEST_HEX]
            if none_hash is not None
            else "unset",
        },
    )


def describe(fingerprint: Fingerprint) -> str:
    """Each component's tag and value, for a log line."""
    return ", ".join(
        f"{name}={tag} {json.dumps(fingerprint.components[name], sort_keys=True, default=str)}"
        for name, tag in fingerprint.tags().items()
    )
