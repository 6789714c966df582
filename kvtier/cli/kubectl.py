"""`kubectl kvtier`: what the kvtier cache is doing, and why a pod gets no hits.

Installed as the `kubectl-kvtier` command, which kubectl runs as a plug-in. Reads the same
objects `kubectl get kvt,kvn` shows and the pods' injection annotations, through the
current kubeconfig context. `trace` runs `kvtier trace` in a node's agent pod with
`kubectl exec`, so RBAC on `pods/exec` decides who may read a node's access log.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Pod
from rich.console import Console
from rich.table import Table

from kvtier.api.node_status import NodeStatus, read_node_status
from kvtier.api.units import format_bytes
from kvtier.kube import (
    ApiError,
    Client,
    KVCacheNode,
    KVCacheTier,
    as_dict,
    credentials_problem,
    not_found,
)

STALE_SECONDS = 60.0


def _client() -> Client:
    """The current kubeconfig context, as kubectl uses it."""
    problem = credentials_problem()
    if problem is not None:
        raise SystemExit(
            f"no usable kubeconfig ({problem}): set KUBECONFIG or create ~/.kube/config"
        )
    return Client()


def _tiers_and_nodes(client: Client, namespace: str | None) -> tuple[list[Any], list[Any]]:
    """The KVCacheTiers and KVCacheNodes of a namespace (all namespaces for None)."""
    where = namespace or "*"
    return (
        [as_dict(t) for t in client.list(KVCacheTier, namespace=where)],
        [as_dict(n) for n in client.list(KVCacheNode, namespace=where)],
    )


def _fresh(status: NodeStatus, now: dt.datetime) -> bool:
    beat = status.heartbeat_time()
    return beat is not None and (now - beat).total_seconds() <= STALE_SECONDS


def _why(entry: dict[str, Any]) -> str:
    """An entry of the tier's status.agents as `Reason: message`."""
    reason, message = entry.get("reason", ""), entry.get("message", "")
    return f"{reason}: {message}" if message else str(reason)


def collect_status(namespace: str | None) -> dict[str, Any]:
    """Per tier, its agents by node: each KVCacheNode's report, and the reason the operator
    found (status.agents) for an agent that is not running; an agent that never reported
    (an unschedulable or crash-looping pod) is a row with its reason only."""
    with _client() as client:
        tiers, nodes = _tiers_and_nodes(client, namespace)
    now = dt.datetime.now(dt.UTC)
    report = []
    for tier in tiers:
        meta, status = tier["metadata"], tier.get("status") or {}
        why = {str(a.get("node")): _why(a) for a in status.get("agents") or []}
        agents = []
        for node in nodes:
            if node["metadata"]["namespace"] != meta["namespace"]:
                continue
            if node["spec"].get("tier") != meta["name"]:
                continue
            ns = read_node_status(node)
            name = node["spec"]["node"]
            agents.append(
                {
                    "node": name,
                    "ready": _fresh(ns, now) and name not in why,
                    "reason": why.get(name, ""),
                    "tiers": ns.to_manifest()["tiers"],
                    "hitRate": ns.hit_rate,
                    "peers": ns.peers,
                    "fingerprints": ns.fingerprints,
                    # where a router subscribes to the node's KV events, when it has a stream
                    "events": ns.to_manifest().get("events"),
                }
            )
        reported = {a["node"] for a in agents}
        agents += [
            {
                "node": name,
                "ready": False,
                "reason": reason,
                "tiers": [],
                "hitRate": None,
                "peers": [],
                "fingerprints": [],
                "events": None,
            }
            for name, reason in why.items()
            if name not in reported
        ]
        conditions = status.get("conditions", [])
        report.append(
            {
                "namespace": meta["namespace"],
                "name": meta["name"],
                "conditions": {c["type"]: c["status"] for c in conditions},
                # what a condition that is not True says, e.g. AgentsReady's reasons
                "messages": {
                    c["type"]: c["message"]
                    for c in conditions
                    if c.get("message") and c["status"] != "True"
                },
                "summary": status.get("summary", {}),
                "agents": sorted(agents, key=lambda a: str(a["node"])),
            }
        )
    return {"tiers": report}


def render_status(report: dict[str, Any], console: Console) -> None:
    if not report["tiers"]:
        console.print("no KVCacheTier found")
    for tier in report["tiers"]:
        conditions = ", ".join(f"{k}={v}" for k, v in tier["conditions"].items())
        console.print(f"[bold]{tier['namespace']}/{tier['name']}[/bold]  {conditions}")
        for kind in ("ConfigValid", "AgentsReady"):
            if kind in tier.get("messages", {}):
                console.print(f"  {kind}: {tier['messages'][kind]}", markup=False)
        if not tier["agents"]:
            continue  # AgentsReady above says why there is none
        table = Table()
        columns = ("node", "ready", "reason", "tier", "used/capacity", "hit rate", "peers")
        for col in (*columns, "fingerprints"):
            table.add_column(col)
        for agent in tier["agents"]:
            rate = f"{agent['hitRate']:.0%}" if agent["hitRate"] is not None else "-"
            for i, t in enumerate(agent["tiers"] or [{}]):
                used = (
                    f"{format_bytes(t.get('usedBytes', 0))}/"
                    f"{format_bytes(t.get('capacityBytes', 0))}"
                    if t
                    else "-"
                )
                table.add_row(
                    agent["node"] if i == 0 else "",
                    str(agent["ready"]) if i == 0 else "",
                    agent.get("reason", "") if i == 0 else "",
                    t.get("name", "-"),
                    used,
                    rate if i == 0 else "",
                    str(len(agent["peers"])) if i == 0 else "",
                    ", ".join(agent["fingerprints"]) if i == 0 else "",
                )
        console.print(table)
        for agent in tier["agents"]:
            if stream := agent.get("events"):
                console.print(
                    f"  KV events of {agent['node']}: {stream['endpoint']} (replay "
                    f"{stream['replayEndpoint']}, topic {stream['topic']!r})",
                    markup=False,
                    soft_wrap=True,
                )


def _not_injected(pod: dict[str, Any], tiers: list[Any], namespace: str) -> str:
    """Why the webhook left a pod alone: what it recorded, or what selects the pod."""
    from kvtier.operator.webhook import SKIPPED, selects

    annotations = pod["metadata"].get("annotations") or {}
    if SKIPPED in annotations:
        return f"not injected: {annotations[SKIPPED]}"
    labels = pod["metadata"].get("labels") or {}
    if any(selects(t["spec"].get("podSelector", {}), labels) for t in tiers):
        return (
            "not injected: created before the webhook ran or the webhook was unreachable; "
            "recreate the pod"
        )
    return f"not injected: no KVCacheTier in {namespace} selects its labels {labels}"


def _tier_reasons(tier: dict[str, Any]) -> list[str]:
    """What the tier's own conditions say keeps its engines from sharing chunks."""
    status = tier.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    reasons = []
    if conditions.get("ConfigValid", {}).get("status") == "False":
        reasons.append(f"tier config invalid: {conditions['ConfigValid'].get('message')}")
    if conditions.get("FingerprintConflict", {}).get("status") == "True":
        reasons.append(f"fingerprint mismatch: {conditions['FingerprintConflict'].get('message')}")
    return reasons


def _agent_reasons(nodes: list[Any], tier: dict[str, Any], node_name: str | None) -> list[str]:
    """Whether the pod's node has an agent of the tier reporting, and if not, why not as the
    operator found it (the agent pod unschedulable, crash-looping, ...)."""
    tier_name = str(tier["metadata"]["name"])
    down = next(
        (
            a
            for a in (tier.get("status") or {}).get("agents") or []
            if a.get("node") == node_name and a.get("reason") != "TierFailing"
        ),
        None,
    )
    if down is not None:
        return [f"agent down: the agent of {tier_name} on {node_name}: {_why(down)}"]
    agent = next(
        (
            n
            for n in nodes
            if n["spec"].get("tier") == tier_name and n["spec"].get("node") == node_name
        ),
        None,
    )
    if agent is None:
        return [f"agent down: no agent of {tier_name} reports from node {node_name}"]
    if not _fresh(read_node_status(agent), dt.datetime.now(dt.UTC)):
        return [
            f"agent down: the agent on {node_name} has not reported for over {STALE_SECONDS:.0f}s"
        ]
    return []


def explain_miss(namespace: str, pod_name: str) -> dict[str, Any]:
    """Reasons, most fundamental first, why a pod's engine may get no hits from kvtier."""
    with _client() as client:
        try:
            pod: dict[str, Any] | None = as_dict(client.get(Pod, pod_name, namespace=namespace))
        except ApiError as exc:
            if not not_found(exc):
                raise
            pod = None
        tiers, nodes = _tiers_and_nodes(client, namespace)
    if pod is None:
        return {"pod": pod_name, "reasons": [f"pod {namespace}/{pod_name} not found"]}
    from kvtier.operator.webhook import INJECTED, TIER

    annotations = pod["metadata"].get("annotations") or {}
    tier_name = annotations.get(TIER)
    if INJECTED not in annotations:
        return {
            "pod": pod_name,
            "tier": tier_name,
            "reasons": [_not_injected(pod, tiers, namespace)],
        }
    tier = next((t for t in tiers if t["metadata"]["name"] == tier_name), None)
    if tier is None:
        return {
            "pod": pod_name,
            "tier": tier_name,
            "reasons": [f"injected for KVCacheTier {tier_name}, which no longer exists"],
        }
    node_name = pod["spec"].get("nodeName")
    reasons = _tier_reasons(tier) + _agent_reasons(nodes, tier, node_name)
    if not reasons:
        reasons.append(
            "injected and the agent is up: misses are chunks no engine stored yet "
            "(or evicted); see kubectl kvtier status for occupancy and hit rates"
        )
    return {"pod": pod_name, "tier": tier_name, "node": node_name, "reasons": reasons}


AGENT_CONTAINER = "agent"  # the agent DaemonSet's container (kvtier.operator.builders)
AGENT_CONFIG = "/etc/kvtier/agent.yaml"  # where the agent pod mounts its config


def agent_pods(namespace: str, tier: str) -> list[dict[str, Any]]:
    """The running agent pods of a KVCacheTier, by node: the pods of its DaemonSet."""
    selector: dict[str, Any] = {"app.kubernetes.io/name": "kvtier-agent", "kvtier.io/tier": tier}
    with _client() as client:
        found = client.list(Pod, namespace=namespace, labels=selector)
        pods = [as_dict(p) for p in found]
    return sorted(
        (
            pod
            for pod in pods
            if all((pod["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            and (pod.get("status") or {}).get("phase") == "Running"
            and pod["spec"].get("nodeName")
        ),
        key=lambda pod: str(pod["spec"]["nodeName"]),
    )


def trace_command(namespace: str, pod: str, block_size: int) -> list[str]:
    """`kubectl exec` of `kvtier trace` in the agent's container, against its own socket:
    the API server decides (RBAC on pods/exec) who may read a node's access log, and the
    agent listens on nothing new."""
    return [
        *("kubectl", "exec", "-n", namespace, pod, "-c", AGENT_CONTAINER, "--"),
        *("kvtier", "trace", "--config", AGENT_CONFIG, "-o", "-"),
        *("--block-size", str(block_size)),
    ]


def fetch_traces(
    namespace: str, tier: str, node: str | None, output: str, block_size: int
) -> list[tuple[str, str]]:
    """Each chosen node's access log into `output` ({node} in it is the node's name); the
    (node, file) pairs written. Raises SystemExit with the reason when nothing can be."""
    import subprocess

    pods = agent_pods(namespace, tier)
    if node is not None:
        pods = [pod for pod in pods if pod["spec"]["nodeName"] == node]
    if not pods:
        where = f" on node {node}" if node else ""
        raise SystemExit(f"no running agent of KVCacheTier {namespace}/{tier}{where}")
    if len(pods) > 1 and "{node}" not in output:
        nodes = ", ".join(pod["spec"]["nodeName"] for pod in pods)
        raise SystemExit(
            f"agents run on {nodes}: name one with --node, or put {{node}} in --output"
        )
    written = []
    for pod in pods:
        name = str(pod["spec"]["nodeName"])
        path = output.replace("{node}", name)
        command = trace_command(namespace, pod["metadata"]["name"], block_size)
        with open(path, "wb") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, check=False)
        if done.returncode != 0:
            Path(path).unlink(missing_ok=True)
            raise SystemExit(
                f"kubectl exec into {pod['metadata']['name']} on {name} failed: "
                f"{done.stderr.decode(errors='replace').strip()}"
            )
        print(f"{name}: {done.stderr.decode(errors='replace').strip()}", file=sys.stderr)
        written.append((name, path))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl kvtier", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="per node and tier: occupancy, hit rate, peers")
    status.add_argument("-n", "--namespace", default=None)
    status.add_argument("-A", "--all-namespaces", action="store_true")
    status.add_argument("--json", action="store_true")
    explain = sub.add_parser("explain-miss", help="why a pod gets no hits")
    explain.add_argument("pod")
    explain.add_argument("-n", "--namespace", default="default")
    explain.add_argument("--json", action="store_true")
    trace = sub.add_parser(
        "trace", help="fetch a node's access log as a trace (kvtier replay, kvtier plan)"
    )
    trace.add_argument("tier", help="the KVCacheTier")
    trace.add_argument("-n", "--namespace", default="default")
    trace.add_argument("--node", default=None, help="the node whose agent to ask")
    trace.add_argument(
        "-o",
        "--output",
        default="kvtier-trace-{node}.jsonl",
        help="file to write; {node} is replaced by the node's name",
    )
    trace.add_argument("--block-size", type=int, default=16, help="tokens per chunk")
    args = parser.parse_args(argv)
    if args.command == "trace":
        written = fetch_traces(args.namespace, args.tier, args.node, args.output, args.block_size)
        for node, path in written:
            print(f"{node}\t{path}")
        return 0
    if args.command == "status":
        namespace = None if args.all_namespaces else (args.namespace or "default")
        report = collect_status(namespace)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            render_status(report, Console())
        return 0
    result = explain_miss(args.namespace, args.pod)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for reason in result["reasons"]:
            print(f"- {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
