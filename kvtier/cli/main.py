"""The `kvtier` command. Each subcommand parses its flags and hands over to the module that
does the work, so importing the CLI stays cheap and `--help` never starts anything."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def _agent(args: argparse.Namespace) -> int:
    from kvtier.agent.main import start

    return start(args.config, args.check)


def _positive(text: str) -> int:
    """An argument that counts something: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _seconds(text: str) -> float:
    """A timeout: a number of seconds above 0, an hour at most."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:  # nan compares false
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 3600]")
    return value


def _peer_keys(args: argparse.Namespace) -> int:
    from kvtier.agent.tiers.peer.wire import write_keys

    secret = args.directory / "secret.key"
    try:
        write_keys(args.directory)
    except OSError as exc:
        if isinstance(exc, FileExistsError) and exc.filename == str(secret):
            print(f"{secret} exists; not overwriting it (pick another directory)", file=sys.stderr)
        else:
            print(f"cannot write the keys into {args.directory}: {exc.strerror}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.directory}/public.key and secret.key; store them as the Secret the "
        "tier's peer.curveKeySecret names:\n"
        f"  kubectl create secret generic kvtier-curve --from-file={args.directory}/public.key "
        f"--from-file={args.directory}/secret.key"
    )
    return 0


def _vllm_config(args: argparse.Namespace) -> int:
    from kvtier.api.config import ConfigError, load_config
    from kvtier.api.transfer_config import build_kv_transfer_config, kv_transfer_config_arg
    from kvtier.api.units import parse_bytes

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        cpu_bytes = parse_bytes(args.cpu_bytes)
        built = build_kv_transfer_config(config, cpu_bytes_to_use=cpu_bytes)
    except ValueError as exc:
        print(f"--cpu-bytes: {exc}", file=sys.stderr)
        return 2
    print(kv_transfer_config_arg(built) if args.compact else json.dumps(built, indent=2))
    return 0


def _operator(args: argparse.Namespace) -> int:
    import kopf

    if _without_credentials("kvtier operator"):
        return 2

    import kvtier.operator.main  # registers the handlers

    kvtier.operator.main.STATE.namespaces = tuple(args.namespace)  # what it serves, and releases
    kopf.configure(log_format=kopf.LogFormat.JSON, verbose=args.verbose)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
    )
    return 0


def _without_credentials(command: str) -> bool:
    """Says so, in one line, where no client of the API server can be made here."""
    from kvtier.kube import credentials_problem

    problem = credentials_problem()
    if problem is not None:
        print(
            f"{command}: no Kubernetes credentials ({problem}); run it in a pod with a "
            "service account, or set KUBECONFIG",
            file=sys.stderr,
        )
    return problem is not None


def _release_finalizers(args: argparse.Namespace) -> int:
    import asyncio

    from kvtier.operator.uninstall import FINALIZER, release_all

    err = sys.stderr
    if _without_credentials("kvtier operator release-finalizers"):
        return 2
    stop = None
    if args.stop:
        namespace, _, name = args.stop.rpartition("/")
        if not namespace or not name:
            print("--stop: give the operator's Deployment as NAMESPACE/NAME", file=err)
            return 2
        stop = (namespace, name)
    report = asyncio.run(release_all(args.namespace, stop, args.timeout))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if report["stopped"]:
            print(f"stopped Deployment {report['stopped']}")
        for tier in report["released"]:
            print(f"removed {FINALIZER} from KVCacheTier {tier}")
        for volume in report["deletedVolumes"]:
            print(f"deleted PersistentVolume {volume} (its KVCacheTier is gone)")
        if not report["released"] and not report["deletedVolumes"]:
            print(f"no KVCacheTier holds {FINALIZER}; no PersistentVolume of a deleted tier left")
    return 0


def _csi(args: argparse.Namespace) -> int:
    import threading

    from kvtier.csi.server import KubernetesTiers, NodePlugin, run
    from kvtier.csi.volumes import Volumes, remove_legacy_pools

    if _without_credentials("kvtier csi"):  # it reads each volume's KVCacheTier
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.legacy_dir is not None and (removed := remove_legacy_pools(args.legacy_dir)):
        logging.getLogger("kvtier.csi").info("removed legacy pools: %s", ", ".join(removed))
    volumes = Volumes(args.state_dir, args.target_root, args.agent_uid)
    plugin = NodePlugin(args.node_id, volumes, KubernetesTiers())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    run(plugin, args.endpoint, args.sweep_seconds, stop)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvtier.api.config import ConfigError
    from kvtier.demo.main import DemoOptions, foreign_files, run_demo

    err = sys.stderr
    if not args.no_fs and (why := foreign_files(args.fs_dir)) is not None:
        print(
            f"kvtier demo: --fs-dir: {why}; the demo empties it: give a new or empty one", file=err
        )
        return 2
    if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        print(
            f"kvtier demo: --vllm-python: {args.vllm_python} is not an executable "
            "(make vllm-env makes .venv-vllm/bin/python)",
            file=err,
        )
        return 2
    options = DemoOptions(
        clients=args.clients,
        conversations=args.conversations,
        turns=args.turns,
        policy=args.policy,
        capacity=args.capacity,
        fs_dir=None if args.no_fs else args.fs_dir,
        vllm_python=args.vllm_python,
        plot=args.plot,
        as_json=args.json,
    )
    try:
        return run_demo(options)
    except ConfigError as exc:  # the pool's capacity
        print(f"kvtier demo: --capacity: {exc}", file=err)
        return 2


def _bench(args: argparse.Namespace) -> int:
    from kvtier.bench.runner import run_benchmark

    return run_benchmark(args.target, quick=args.quick, as_json=args.json, out=args.out)


# What each way of `kvtier replay` reads, beside the trace, --limit, --block-size, --json.
_REPLAY_MODES = {
    "with --nodes": {"nodes", "route"},
    "with --agent": {"agent", "chunk_bytes", "namespace"},
    "without --nodes or --agent": {
        "capacity",
        "block_bytes",
        "bytes_per_token",
        "blocks",
        "policy",
        "plot",
    },
}


def _replay_flags_unused(args: argparse.Namespace) -> str | None:
    """Why the flags given do not make one replay, or None: a flag the chosen way would
    ignore (the replay over nodes sizes its own pools; a live agent has its own pool and
    policy), or two that give the block's size twice."""
    if args.nodes is not None and args.agent:
        return "--nodes replays nodes offline and --agent replays against a live agent: give one"
    mode = "with --nodes" if args.nodes is not None else "with --agent" if args.agent else ""
    mode = mode or "without --nodes or --agent"
    flags = set().union(*_REPLAY_MODES.values())
    unused = sorted(
        f"--{n.replace('_', '-')}"
        for n in flags - _REPLAY_MODES[mode]
        if getattr(args, n) is not None
    )
    if unused:
        return f"{', '.join(unused)}: not used {mode}; leave it out"
    if args.block_bytes is not None and args.bytes_per_token is not None:
        return "--block-bytes and --bytes-per-token both give the block's size: give one"
    return None


def _replay(args: argparse.Namespace) -> int:
    if (why := _replay_flags_unused(args)) is not None:
        print(f"kvtier replay: {why}", file=sys.stderr)
        return 2
    if args.route is None:
        args.route = "prefix"
    if args.nodes is not None:
        from kvtier.traces.route_replay import main as route_main

        return route_main(args)
    from kvtier.traces.replay import main as replay_main

    return replay_main(args)


def _trace(args: argparse.Namespace) -> int:
    from kvtier.cli.trace import main as trace_main

    return trace_main(args)


def _plan(args: argparse.Namespace) -> int:
    from kvtier.traces.plan import main as plan_main

    return plan_main(args)


def _agent_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="agent config YAML")
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the config (and its directories), print it with defaults, and exit",
    )


def _csi_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="unix:///csi/csi.sock", help="gRPC endpoint")
    parser.add_argument("--node-id", required=True, help="this node's name")
    parser.add_argument(
        "--state-dir", type=Path, default=Path("/var/lib/kvtier/csi"), help="tier tmpfs mounts"
    )
    parser.add_argument(
        "--target-root",
        type=Path,
        default=Path("/var/lib/kubelet/pods"),
        help="the only directory volumes are published under",
    )
    parser.add_argument(
        "--legacy-dir",
        type=Path,
        default=None,
        help="where earlier versions kept pools (a hostPath); emptied and removed at start",
    )
    parser.add_argument("--sweep-seconds", type=float, default=30.0, help="freeing deleted tiers")
    parser.add_argument(
        "--agent-uid",
        type=int,
        default=65532,
        help="the agents' uid (the operator's agentUid): owner of each tier's pool/ and run/",
    )


def _operator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    parser.add_argument("--health-port", type=int, default=8080, help="liveness probe port")
    parser.add_argument("--verbose", action="store_true", help="log every watch event")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    release = actions.add_parser(
        "release-finalizers",
        help="after the operator is gone: let its tiers be deleted",
        description="Remove the finalizer kvtier.io/operator from every KVCacheTier (of the "
        "--namespace given, else of all namespaces), so tiers, and namespaces holding them, "
        "can be deleted without an operator; and delete the NFS PersistentVolumes of tiers "
        "that no longer exist. Run it when no operator runs (one would add the finalizer "
        "again), or pass --stop to stop the operator's Deployment first, as the chart's "
        "pre-delete hook does. Another controller's finalizers are left alone.",
    )
    release.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="only this namespace's tiers (repeatable; default: all namespaces)",
    )
    release.add_argument(
        "--stop",
        default=None,
        metavar="NAMESPACE/NAME",
        help="first scale this Deployment (the operator's) to 0 and wait for its pods to go",
    )
    release.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for --stop (default 120)"
    )
    release.add_argument("--json", action="store_true", help="print what was done as JSON")
    release.set_defaults(func=_release_finalizers)


def _vllm_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="agent config YAML")
    parser.add_argument(
        "--cpu-bytes", default="4Gi", help="vLLM's own per-engine host buffer (default 4Gi)"
    )
    parser.add_argument(
        "--compact", action="store_true", help="one line, ready for --kv-transfer-config"
    )


def _peer_keys_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="where to write the two key files")


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=_positive, default=4, help="client processes (default 4)")
    parser.add_argument(
        "--conversations", type=_positive, default=3, help="conversations per client (default 3)"
    )
    parser.add_argument(
        "--turns", type=_positive, default=6, help="turns per conversation (default 6)"
    )
    parser.add_argument(
        "--policy", choices=["lru", "arc", "prefix"], default="lru", help="eviction policy"
    )
    parser.add_argument("--capacity", default="12Mi", help="host pool capacity (default 12Mi)")
    parser.add_argument(
        "--fs-dir",
        type=Path,
        default=Path(".scratch/demo-fs"),
        help="directory of the demo's filesystem tier, emptied before and after the run; "
        "one that holds anything and was not made by a demo is refused (default "
        ".scratch/demo-fs)",
    )
    parser.add_argument("--no-fs", action="store_true", help="run with the host tier alone")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="also run two vLLM engines sharing one agent, with this vLLM environment's "
        "Python (make demo passes .venv-vllm/bin/python)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw hit rate by tier and occupancy over the run into a PNG",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        choices=["host", "tiers", "peers", "vllm", "csi", "eviction", "ttft"],
        help="host: the client<->agent pool path; tiers: filesystem and S3 tiers; "
        "peers: another node's agent vs raw TCP; "
        "vllm: kvtier vs vLLM's native fs tier inside vLLM's tiering manager; "
        "csi: the CSI plugin's publish latency and the pool through its volume (root); "
        "eviction: the policies on the trace suite (docs/replay.md's tables); "
        "ttft: time to first token of a real vLLM engine, KV recomputed or loaded from "
        "vLLM's CPU and fs tiers and from kvtier",
    )
    parser.add_argument("--quick", action="store_true", help="short run (under a minute)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--out", type=Path, default=None, help="write JSON here (default .scratch/bench/)"
    )


def _replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="trace file (.jsonl or .jsonl.gz)")
    parser.add_argument(
        "--capacity", default=None, help="comma-separated pool sizes, e.g. 8Gi,32Gi,128Gi"
    )
    parser.add_argument(
        "--block-bytes", default=None, help="bytes of one block's KV (64Mi: Llama-3.1-8B bf16)"
    )
    parser.add_argument(
        "--bytes-per-token",
        default=None,
        help="a model's KV bytes per token (128Ki: Llama-3.1-8B bf16), times the block size",
    )
    parser.add_argument("--blocks", default=None, help="comma-separated capacities in blocks")
    parser.add_argument(
        "--policy",
        default=None,
        help="comma-separated: lru, arc, prefix, adaptive, optimal (default: lru, arc, prefix "
        "and optimal)",
    )
    parser.add_argument(
        "--block-size",
        type=_positive,
        default=None,
        help="tokens per hash id for records without block_size (default 512)",
    )
    parser.add_argument("--limit", type=_positive, default=None, help="replay the first N requests")
    parser.add_argument(
        "--nodes",
        type=_positive,
        default=None,
        help="replay over N nodes (pool and storage each), routing requests by --route",
    )
    parser.add_argument(
        "--route",
        choices=["prefix", "random", "both"],
        default=None,
        help="with --nodes (default prefix): to the node whose KV event stream shows the "
        "longest cached prefix (compared with random), or at random",
    )
    parser.add_argument(
        "--agent",
        default=None,
        metavar="ADDR",
        help="replay against this live agent (its pool, policy and tiers) with real chunk "
        "bytes, instead of the index at each capacity",
    )
    parser.add_argument(
        "--chunk-bytes",
        default=None,
        help="row size with --agent (the agent's chunkBytes; default 64Ki)",
    )
    parser.add_argument(
        "--namespace", default=None, help="namespace with --agent (default: a fresh one)"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw hit rate against capacity, one line per policy, the optimal bound shaded",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _trace_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--agent", default=None, metavar="ADDR", help="ipc://PATH of the agent")
    where.add_argument("--config", type=Path, default=None, help="the agent's config YAML")
    parser.add_argument(
        "-o", "--output", default="-", help="JSONL file (.gz: gzip), - for stdout (default)"
    )
    parser.add_argument(
        "--block-size",
        type=_positive,
        default=16,
        help="tokens per chunk, for input_length (vLLM's offloading block size; default 16)",
    )
    parser.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per agent call")


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="trace file (.jsonl or .jsonl.gz)")
    goal = parser.add_mutually_exclusive_group()
    goal.add_argument(
        "--target-hit-rate", type=float, default=None, help="e.g. 0.3 (hit prompt tokens)"
    )
    goal.add_argument(
        "--memory-budget",
        "--capacity",
        default=None,
        help="host bytes per node, e.g. 256Gi (8G is 8 x 10^9 bytes, as Kubernetes reads it)",
    )
    parser.add_argument(
        "--block-bytes",
        default=None,
        help="bytes of one chunk (default: the export's chunk_bytes; 64Mi for 512-token "
        "Llama-3.1-8B blocks)",
    )
    parser.add_argument(
        "--bytes-per-token", default=None, help="a model's KV bytes per token (128Ki: Llama-3.1-8B)"
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="the host tier's policy (lru, arc, prefix, adaptive; default: the tier's default)",
    )
    parser.add_argument("--points", type=_positive, default=12, help="capacities on the curve")
    parser.add_argument(
        "--sample-rate",
        type=float,
        default=None,
        help="the trace's sampling of requests (default: the export's, else 1)",
    )
    parser.add_argument("--block-size", type=_positive, default=None, help="as for kvtier replay")
    parser.add_argument("--limit", type=_positive, default=None, help="the first N requests")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="draw the curve"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


@dataclass(frozen=True)
class Command:
    """A subcommand: its flags, the function it hands over to, and its help texts."""

    name: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    help: str
    description: str


COMMANDS = (
    Command(
        "agent",
        _agent_arguments,
        _agent,
        help="run the node agent",
        description="Run the node agent: the node's shared host-memory KV tier. "
        "Stops cleanly on SIGTERM; the pool stays for a warm restart.",
    ),
    Command(
        "csi",
        _csi_arguments,
        _csi,
        help="run the CSI node plugin (csi.kvtier.io)",
        description="Run the CSI node plugin that gives pods their tier's node-local "
        "directory (a size-limited tmpfs) as an ephemeral inline volume. Needs root and "
        "the mount capability: the chart runs it as the one privileged kvtier component.",
    ),
    Command(
        "operator",
        _operator_arguments,
        _operator,
        help="run the Kubernetes operator",
        description="Run the kopf operator: reconciles KVCacheTier resources into agents, "
        "aggregates KVCacheNode reports into status, and serves the pod-injection webhook. "
        "Settings come from KVTIER_* environment variables (see kvtier.operator.settings).",
    ),
    Command(
        "vllm-config",
        _vllm_config_arguments,
        _vllm_config,
        help="print the --kv-transfer-config for vLLM engines on an agent's node",
        description="Print the --kv-transfer-config JSON that connects a vLLM engine to the "
        "agent described by a config file (what the operator injects into pods).",
    ),
    Command(
        "peer-keys",
        _peer_keys_arguments,
        _peer_keys,
        help="write a new CURVE key pair for the peer tier",
        description="Write the cluster's CURVE key pair (public.key, secret.key, Z85) that "
        "agents of a tier authenticate each other with; refuses to overwrite a secret key.",
    ),
    Command(
        "demo",
        _demo_arguments,
        _demo,
        help="run an agent against a synthetic multi-turn chat workload",
        description="Start an agent and several client processes replaying multi-turn chats "
        "with shared system prompts, then report hit rate, bytes moved, evictions and the "
        "prefill tokens that cache hits avoided.",
    ),
    Command(
        "bench",
        _bench_arguments,
        _bench,
        help="measure throughput and latency against raw baselines",
        description="Benchmarks report ratios against a baseline measured in the same run.",
    ),
    Command(
        "replay",
        _replay_arguments,
        _replay,
        help="replay a request trace through the host tier's index at several capacities",
        description="Replay a Mooncake-format JSONL trace (timestamp, input_length, hash_ids; "
        "gzip accepted) through the agent's own index and eviction policies, and report per "
        "capacity and policy the hit rate as vLLM sees it (hit prompt tokens up to a "
        "request's first miss / prompt tokens, over the last half of the requests, as "
        "kvcache-simulator counts it), the block hit rate beside it, and the offline optimal.",
    ),
    Command(
        "trace",
        _trace_arguments,
        _trace,
        help="export an agent's access log as a Mooncake-format trace",
        description="Export the requests the agent's access log holds (key digests renumbered, "
        "timestamps, no content) as JSONL that kvtier replay and kvtier plan read. Talks to "
        "the agent's local socket only; kubectl kvtier trace runs it in the agent's pod.",
    ),
    Command(
        "plan",
        _plan_arguments,
        _plan,
        help="recommend host and secondary-tier capacity from a trace",
        description="Replay a trace (a file, or an agent's export) at capacities from one "
        "chunk to the trace's whole working set, print the hit-rate curve and its knee, and "
        "recommend host capacity per node and secondary-tier capacity for a target hit rate "
        "or a memory budget.",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="A node-shared, tiered KV cache for vLLM on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.description)
        command.arguments(child)
        child.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`kvtier replay --json | head`): what it did not read is
        # dropped, as any filter's output is, with no traceback; the shell's status for
        # a writer a pipe stopped.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
