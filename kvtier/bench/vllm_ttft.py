"""`kvtier bench ttft`, the part that runs under the vLLM environment's Python (and, with
`--gpu`, the GPU script's: vLLM's own GPU worker, no CPU harness).

`run` builds the model, starts one node agent and runs four engines one after another, each
in a process of its own (so each starts with nothing but what the tiers hold, and a GPU's
memory is free for the next):

1. no connector: every prompt recomputed (the baseline);
2. vLLM's native tiers (`cpu_bytes_to_use` and an `fs` secondary tier): the prompts
   computed once (and offloaded), then served after a prefix-cache reset (loads from its CPU
   tier), then after a connector reset too (loads from the fs tier);
3. kvtier's injected config: computed once, then served after both resets (loads from the
   agent);
4. the same config in a fresh engine: the prompts engine 3 computed, loaded from the agent.

Each timed request is a single prompt with max_tokens=1, preceded by the reset and a short
request of its own (so a reset's aftermath is not timed) and followed by another short one,
and the engine's counters are read around it: what `ttft.check_sample` verifies.
`--engine SPEC.json` is one engine's run (what `run` starts).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.ttft import (
    EXTERNAL_HITS,
    KVTIER,
    KVTIER_LOAD,
    KVTIER_SECOND,
    LOCAL_HITS,
    RECOMPUTE,
    SECONDARY_READ,
    VLLM_CPU,
    VLLM_FS,
    Profile,
    percentile,
    profile,
    profile_json,
    summarize,
)

WORDS = 8000  # the model's vocabulary: prompts are random ids among them
WARM_UP = 1024  # tokens of each engine's first (untimed) request
CPU_SPEC = ("kvtier.local.engines.cpu_spec", "CPUTestTieringSpec")
COLD_NATIVE, COLD_KVTIER = "cold_vllm_native", "cold_kvtier"


def log(message: str) -> None:
    print(f"[ttft] {message}", file=sys.stderr, flush=True)


def prompt(length: int, rep: int, salt: str = "") -> list[int]:
    rng = random.Random(f"{salt}{length}/{rep}")
    return [rng.randrange(3, WORDS + 3) for _ in range(length)]


def _counters(llm: Any) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, int | float):
            totals[metric.name] = totals.get(metric.name, 0) + value
    return totals


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> int | None:
    """How much a counter grew; None when this vLLM has no such counter."""
    return int(after[name] - before.get(name, 0)) if name in after else None


def _stored_chunks(wait: dict[str, Any]) -> int:
    if "fs_root" in wait:
        return sum(1 for p in Path(wait["fs_root"]).rglob("*") if p.is_file())
    from kvtier.client.connection import AgentClient

    with AgentClient(wait["agent"]) as client:
        return client.stats().host.chunks


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: its phases in order, each the same prompts after the phase's reset."""
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "block_size": spec["block_size"],
        "max_model_len": spec["max_model_len"],
        "dtype": spec["dtype"],
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if spec["kv"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    if spec["gpu"]:
        kwargs["gpu_memory_utilization"] = 0.3
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0)
    shorts = itertools.count()

    def generate(ids: list[int]) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)

    def short() -> None:  # under one block: nothing to hit, nothing stored
        generate(prompt(8, next(shorts), salt=f"short-{spec['name']}-"))

    def reset(how: str) -> None:
        if not llm.reset_prefix_cache(reset_connector=how == "connector"):
            raise RuntimeError(f"{spec['name']}: vLLM refused to reset its caches")

    phases: dict[str, dict[int, list[dict[str, Any]]]] = {}
    try:
        generate(prompt(WARM_UP, 0, salt=f"warm-{spec['name']}-"))
        short()
        for phase in spec["phases"]:
            taken = phases.setdefault(phase["way"], {})
            for length in spec["lengths"]:
                for rep in range(spec["reps"]):
                    ids = prompt(length, rep)
                    reset(phase["reset"])
                    short()
                    before = _counters(llm)
                    t0 = time.perf_counter()
                    generate(ids)
                    ttft = time.perf_counter() - t0
                    short()
                    after = _counters(llm)
                    taken.setdefault(length, []).append(
                        {
                            "ttft_s": ttft,
                            "local_hit_tokens": _delta(after, before, LOCAL_HITS) or 0,
                            "external_hit_tokens": _delta(after, before, EXTERNAL_HITS) or 0,
                            "secondary_read_bytes": _delta(after, before, SECONDARY_READ),
                            "kvtier_load_bytes": _delta(after, before, KVTIER_LOAD),
                        }
                    )
            if "wait" in phase:
                _wait_stored(phase["wait"], short)
    finally:
        llm.llm_engine.engine_core.shutdown()
    device = "cpu"
    if spec["gpu"]:
        import torch

        device = torch.cuda.get_device_name(0)
    import vllm

    return {
        "phases": phases,
        "start_s": start_s,
        "device": device,
        "vllm_version": vllm.__version__,
    }


def _wait_stored(wait: dict[str, Any], step: Any, timeout: float = 300.0) -> None:
    """Until the tier holds the chunks the phase stored (so no copy runs behind the next
    phase's timings): short requests keep the engine stepping, which hands stores on."""
    deadline = time.monotonic() + timeout
    while (held := _stored_chunks(wait)) < wait["chunks"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{held} of {wait['chunks']} chunks reached {wait}")
        step()
        time.sleep(0.1)
    for _ in range(3):
        step()


def _engine(python: str, spec: dict[str, Any], scratch: Path, gpu: bool) -> dict[str, Any]:
    spec_path = scratch / f"{spec['name']}.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",  # vLLM's block hashes: the same in every engine
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    if not gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    log_path = scratch / f"{spec['name']}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.run(
            [python, "-m", "kvtier.bench.vllm_ttft", "--engine", str(spec_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=1800,
            check=False,
        )
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"engine {spec['name']} failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return result


def _scratch_dir(need: int) -> Path:
    """tmpfs when it has room (the agent's pool and the fs tier's files both live there),
    the temporary directory otherwise."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else None
    return Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-", dir=root))


def run(quick: bool, gpu: bool, agent_python: str | None = None) -> dict[str, Any]:
    from kvtier.api.pool_layout import PAGE
    from kvtier.api.transfer_config import build_kv_transfer_config
    from kvtier.local.agent import AgentProcess, scratch_config
    from kvtier.local.engines.tiny_model import build

    began = time.perf_counter()
    prof: Profile = profile(quick, gpu)
    shape, block = prof.shape, prof.block_size
    row = block * shape.kv_bytes_per_token
    chunks = sum(n // block for n in prof.lengths) * prof.reps + 4 * (WARM_UP // block) + 64
    host_bytes = chunks * row
    if shutil.disk_usage("/dev/shm").free < host_bytes:
        raise RuntimeError(f"/dev/shm has less than the {host_bytes} bytes vLLM's CPU tier needs")
    scratch = _scratch_dir(3 * host_bytes)
    max_len = max(prof.lengths) + 2 * block
    try:
        log(f"building {shape.name} ({shape.layers} layers, hidden {shape.hidden}) in {scratch}")
        model = build(
            scratch / "model",
            words=WORDS,
            hidden=shape.hidden,
            layers=shape.layers,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            intermediate=shape.intermediate,
            dtype=shape.dtype,
            max_positions=max_len,
        )
        agent = scratch_config(
            scratch / "agent", "bench-ttft", PAGE + (chunks + 8) * (row + PAGE), row
        )
        spec = None if gpu else CPU_SPEC
        native: dict[str, Any] = {
            "spec_name": spec[1] if spec else "TieringOffloadingSpec",
            "cpu_bytes_to_use": host_bytes,
            "secondary_tiers": [{"type": "fs", "root_dir": str(scratch / "native-fs")}],
        }
        if spec:
            native["spec_module_path"] = spec[0]
        native_kv = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": native,
        }
        kvtier_kv = build_kv_transfer_config(agent, cpu_bytes_to_use=host_bytes, spec=spec)
        stored = sum(n // block for n in prof.lengths) * prof.reps
        engines: list[tuple[str, dict[str, Any] | None, list[dict[str, Any]]]] = [
            ("recompute", None, [{"way": RECOMPUTE, "reset": "prefix"}]),
            (
                "vllm-native",
                native_kv,
                [
                    {
                        "way": COLD_NATIVE,
                        "reset": "prefix",
                        "wait": {
                            "fs_root": native["secondary_tiers"][0]["root_dir"],
                            "chunks": stored,
                        },
                    },
                    {"way": VLLM_CPU, "reset": "prefix"},
                    {"way": VLLM_FS, "reset": "connector"},
                ],
            ),
            (
                "kvtier",
                kvtier_kv,
                [
                    {
                        "way": COLD_KVTIER,
                        "reset": "prefix",
                        "wait": {"agent": agent.endpoint, "chunks": stored},
                    },
                    {"way": KVTIER, "reset": "connector"},
                ],
            ),
            ("kvtier-second", kvtier_kv, [{"way": KVTIER_SECOND, "reset": "connector"}]),
        ]
        samples: dict[str, dict[int, list[dict[str, Any]]]] = {}
        starts: dict[str, float] = {}
        device = version = ""
        with AgentProcess(agent, python=agent_python):
            for name, kv, phases in engines:
                log(f"engine {name}: {', '.join(p['way'] for p in phases)}")
                t0 = time.perf_counter()
                result = _engine(
                    sys.executable,
                    {
                        "name": name,
                        "model": str(model),
                        "dtype": shape.dtype,
                        "block_size": block,
                        "max_model_len": max_len,
                        "kv": kv,
                        "gpu": gpu,
                        "lengths": list(prof.lengths),
                        "reps": prof.reps,
                        "phases": phases,
                        "out": str(scratch / f"{name}.result.json"),
                    },
                    scratch,
                    gpu,
                )
                log(f"engine {name}: done in {time.perf_counter() - t0:.0f} s")
                starts[name] = result["start_s"]
                device, version = result["device"], result["vllm_version"]
                for way, by_length in result["phases"].items():
                    samples[way] = {int(n): s for n, s in by_length.items()}
            from kvtier.client.connection import AgentClient

            with AgentClient(agent.endpoint) as client:
                agent_chunks = client.stats().host.chunks
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(samples, block)
    cold = {
        way: {str(n): percentile([s["ttft_s"] for s in samples[way][n]], 0.5) for n in prof.lengths}
        for way in (COLD_NATIVE, COLD_KVTIER)
    }
    return {
        "profile": profile_json(prof),
        "device": device if gpu else f"cpu ({os.cpu_count()} cores)",
        "vllm_version": version,
        **summary,
        "samples": {w: {str(n): s for n, s in by.items()} for w, by in samples.items()},
        "first_sight_ttft_p50_s": cold,
        "engine_start_s": starts,
        "agent_chunks": agent_chunks,
        "wall_s": time.perf_counter() - began,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="vLLM's own GPU worker")
    parser.add_argument("--agent-python", default=None, help="the agent's interpreter")
    parser.add_argument("--engine", type=Path, default=None, help="run one engine's spec")
    args = parser.parse_args()
    if args.engine is not None:
        spec = json.loads(args.engine.read_text())
        Path(spec["out"]).write_text(json.dumps(serve(spec)))
        return
    print(json.dumps(run(args.quick, args.gpu, args.agent_python)))


if __name__ == "__main__":
    main()
