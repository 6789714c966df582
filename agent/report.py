"""The agent's report: what it holds and how it serves, published where the operator and
`kubectl` read it (its own KVCacheNode), at a bounded rate.

Published when something meaningful changed, but at most every `minIntervalSeconds`, and at
least every `intervalSeconds` as a heartbeat: a thousand agents with steady traffic cost the
API server one small write per agent per heartbeat, not one per request.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime as dt
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvtier
from kvtier.agent.config import ReportConfig

log = logging.getLogger("kvtier.agent.report")
KVN = "/apis/kvtier.io/v1alpha1/namespaces/{namespace}/kvcachenodes"
WATCH_IDLE_SECONDS = 330  # a watch with no event for this long is re-established


def build_report(stats: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """KVCacheNode status from the agent's stats (as the `stats` request returns them)."""
    tiers = [
        {
            "name": "host",
            "usedBytes": stats["used_bytes"],
            "capacityBytes": stats["capacity_bytes"],
            "chunks": stats["chunks"],
            "hits": stats["hits"],
            "misses": stats["lookups"] - stats["hits"],
        }
    ]
    secondary_hits = 0
    for tier in stats.get("tiers", []):
        secondary_hits += int(tier.get("hits", 0))
        tiers.append(
            {
                "name": tier["name"],
                "usedBytes": tier["used_bytes"],
                "capacityBytes": tier["capacity_bytes"],
                "chunks": tier["chunks"],
                "hits": tier.get("hits", 0),
                "misses": tier.get("misses", 0),
            }
        )
    lookups, hits = int(stats["lookups"]), int(stats["hits"]) + secondary_hits
    return {
        "heartbeat": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "ready": True,
        "tiers": tiers,
        "lookups": lookups,
        "hits": hits,
        "peers": stats.get("peers", []),
        "fingerprints": sorted(stats.get("namespaces", {})),
        "summary": {
            "host": f"{stats['used_bytes'] >> 20}Mi/{stats['capacity_bytes'] >> 20}Mi",
            "hitRate": f"{hits / lookups:.0%}" if lookups else "-",
            "peers": len(stats.get("peers", [])),
        },
    }


@dataclass(frozen=True)
class Member:
    """Another agent of the same tier, as its report says."""

    node: str
    endpoint: str
    heartbeat: dt.datetime | None
    nixl: bytes | None = None  # its NIXL agent metadata, when it has NIXL


def _unb64(value: str | None) -> bytes | None:
    try:
        return base64.b64decode(value, validate=True) if value else None
    except (binascii.Error, ValueError):
        return None


def _parse_time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


class Registry(ABC):
    node: str
    endpoint: str | None = None  # this agent's peer endpoint, published with its report
    nixl: bytes | None = None  # and its NIXL agent metadata

    def _nixl_text(self) -> str | None:
        return base64.b64encode(self.nixl).decode() if self.nixl else None

    @abstractmethod
    def publish(self, status: dict[str, Any]) -> None: ...

    @abstractmethod
    def members(self) -> list[Member]:
        """The agents of this tier that published a peer endpoint (this one included)."""

    def close(self) -> None:  # noqa: B027 - only registries that hold connections need it
        """Stop following the other agents."""


class FileRegistry(Registry):
    """One JSON file per node in a shared directory: single-machine setups and tests."""

    def __init__(self, directory: Path, node: str) -> None:
        self.directory = directory
        self.node = node
        self.path = directory / f"{node}.json"
        directory.mkdir(parents=True, exist_ok=True)

    def publish(self, status: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        record = {
            "node": self.node,
            "endpoint": self.endpoint,
            "nixlMetadata": self._nixl_text(),
            "status": status,
        }
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def members(self) -> list[Member]:
        found = []
        for path in self.directory.glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record.get("endpoint"):
                found.append(
                    Member(
                        record["node"],
                        record["endpoint"],
                        _parse_time(record["status"].get("heartbeat")),
                        _unb64(record.get("nixlMetadata")),
                    )
                )
        return found


class KubernetesRegistry(Registry):
    """The agent's own KVCacheNode: created once, then its status patched."""

    def __init__(self, config: ReportConfig, node: str) -> None:
        import kopf

        logger = logging.getLogger("kvtier.agent.login")
        settings = kopf.OperatorSettings()
        info = kopf.login_with_service_account(settings=settings, logger=logger) or (
            kopf.login_with_kubeconfig(settings=settings, logger=logger)
        )
        if info is None:
            raise RuntimeError("no Kubernetes credentials (service account or kubeconfig)")
        self._server = info.server.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if info.token:
            self._headers["Authorization"] = f"Bearer {info.token}"
        self._ssl = ssl.create_default_context(cafile=info.ca_path) if info.ca_path else None
        if info.insecure and self._ssl is not None:
            self._ssl.check_hostname = False
            self._ssl.verify_mode = ssl.CERT_NONE
        self._collection = KVN.format(namespace=config.namespace)
        self.node = node
        self.tier = config.tier
        self.name = f"{config.tier}-{node}"[:253]
        self._body: dict[str, Any] = {
            "apiVersion": "kvtier.io/v1alpha1",
            "kind": "KVCacheNode",
            "metadata": {
                "name": self.name,
                "namespace": config.namespace,
                "labels": {"kvtier.io/tier": str(config.tier)},
            },
            "spec": {"tier": config.tier, "node": node, "version": kvtier.__version__},
        }
        self._created = False
        self._members: dict[str, Member] = {}
        self._members_lock = threading.Lock()
        self._synced = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stream: http.client.HTTPConnection | None = None
        self._closed = threading.Event()

    def _request(
        self, method: str, path: str, body: Any, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        request = urllib.request.Request(
            self._server + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={**self._headers, "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(request, timeout=10, context=self._ssl) as resp:
                return int(resp.status), json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return int(err.code), None

    def members(self) -> list[Member]:
        """The tier's agents as a watch keeps them (started on first use): one LIST, then a
        stream of changes, rather than a LIST of every KVCacheNode by every agent each
        period, which a thousand nodes would make a thousand times heavier."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="kvtier-members", daemon=True)
            self._watcher.start()
            self._synced.wait(timeout=2)
        with self._members_lock:
            return list(self._members.values())

    def _member(self, item: dict[str, Any]) -> Member | None:
        spec = item.get("spec") or {}
        control = (spec.get("endpoints") or {}).get("control")
        if spec.get("tier") != self.tier or not control:
            return None
        return Member(
            spec["node"],
            control,
            _parse_time((item.get("status") or {}).get("heartbeat")),
            _unb64(spec.get("nixlMetadata")),
        )

    def _watch(self) -> None:
        """LIST, then WATCH from the listing's version; on any error or expiry, again."""
        selector = "labelSelector=" + urllib.parse.quote(f"kvtier.io/tier={self.tier}")
        while not self._closed.is_set():
            try:
                code, listing = self._request("GET", f"{self._collection}?{selector}", None)
                if code != 200 or not listing:
                    raise RuntimeError(f"listing KVCacheNodes: HTTP {code}")
                found = {}
                for item in listing.get("items", []):
                    if (member := self._member(item)) is not None:
                        found[item["metadata"]["name"]] = member
                with self._members_lock:
                    self._members = found
                self._synced.set()
                version = (listing.get("metadata") or {}).get("resourceVersion", "")
                self._follow(
                    f"{self._collection}?{selector}&watch=1&timeoutSeconds=300"
                    f"&resourceVersion={version}"
                )
            except Exception as exc:  # the API server restarts, the watch expires
                log.debug("watching KVCacheNodes: %s", exc)
                self._closed.wait(2)

    def _follow(self, path: str) -> None:
        url = urllib.parse.urlsplit(self._server)
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            conn = http.client.HTTPSConnection(
                url.hostname or "", url.port, timeout=WATCH_IDLE_SECONDS, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(
                url.hostname or "", url.port, timeout=WATCH_IDLE_SECONDS
            )
        self._stream = conn
        try:
            conn.request("GET", url.path + path, headers=self._headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"watching KVCacheNodes: HTTP {response.status}")
            for line in response:
                event = json.loads(line)
                item = event.get("object") or {}
                name = (item.get("metadata") or {}).get("name")
                if event.get("type") == "ERROR" or not name:
                    return  # e.g. 410 Gone: the version is too old; list again
                member = None if event["type"] == "DELETED" else self._member(item)
                with self._members_lock:
                    if member is None:
                        self._members.pop(name, None)
                    else:
                        self._members[name] = member
        finally:
            self._stream = None
            conn.close()

    def close(self) -> None:
        self._closed.set()
        stream = self._stream
        if stream is not None and stream.sock is not None:
            with contextlib.suppress(OSError):  # ends the blocked read of the watch
                stream.sock.shutdown(socket.SHUT_RDWR)
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def publish(self, status: dict[str, Any]) -> None:
        if not self._created:
            spec = self._body["spec"]
            if self.endpoint:
                spec["endpoints"] = {"control": self.endpoint}
            if self.nixl:
                spec["nixlMetadata"] = self._nixl_text()
            code, _ = self._request("POST", self._collection, self._body)
            if code == 409:  # left by this node's previous agent: its address and NIXL agent
                code, _ = self._request(  # have changed since
                    "PATCH",
                    f"{self._collection}/{self.name}",
                    {"spec": spec},
                    "application/merge-patch+json",
                )
            if code not in (200, 201):
                raise RuntimeError(f"creating KVCacheNode {self.name}: HTTP {code}")
            self._created = True
        code, _ = self._request(
            "PATCH",
            f"{self._collection}/{self.name}/status",
            {"status": status},
            "application/merge-patch+json",
        )
        if code == 404:
            self._created = False  # deleted under us: recreated next time
        elif code >= 300:
            raise RuntimeError(f"updating KVCacheNode {self.name}: HTTP {code}")


def make_registry(config: ReportConfig) -> Registry | None:
    node = config.node or os.environ.get("NODE_NAME") or socket.gethostname()
    if config.target == "kubernetes":
        return KubernetesRegistry(config, node)
    if config.target == "file":
        assert config.directory is not None
        return FileRegistry(config.directory, node)
    return None


class Reporter:
    """A thread publishing `collect()` through the registry at a bounded rate."""

    def __init__(
        self, config: ReportConfig, registry: Registry, collect: Callable[[], dict[str, Any]]
    ) -> None:
        self.config = config
        self.registry = registry
        self.collect = collect
        self.publishes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-report", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _loop(self) -> None:
        last_sent: dict[str, Any] | None = None
        last_time = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            status = build_report(self.collect(), dt.datetime.now(dt.UTC))
            comparable = {k: v for k, v in status.items() if k != "heartbeat"}
            due = now - last_time >= self.config.interval_seconds
            changed = last_sent is not None and comparable != last_sent
            if last_sent is None or due or changed:
                try:
                    self.registry.publish(status)
                    self.publishes += 1
                    last_sent, last_time = comparable, now
                except Exception as exc:  # the API server may be briefly unreachable
                    log.warning("could not publish the agent report: %s", exc)
            self._stop.wait(self.config.min_interval_seconds)
