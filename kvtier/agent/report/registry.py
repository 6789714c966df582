"""Where the agents of a tier find each other and publish their reports: the agent's own
KVCacheNode in a cluster (followed by one watch per agent), or one JSON file per node in a
shared directory on a single machine.

Threading: `members` may be called from any thread; the Kubernetes registry's watch runs on a
thread of its own and swaps its member map under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import socket
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvtier
from kvtier.api.config import ReportConfig
from kvtier.api.node_status import parse_time

log = logging.getLogger("kvtier.agent.report.registry")
API_VERSION = "kvtier.io/v1alpha1"
TIER_LABEL = "kvtier.io/tier"
FIELD_MANAGER = "kvtier-agent"  # the agent's identity in its KVCacheNode's managedFields
WATCH_SECONDS = 300  # the API server ends a watch after this long; it is resumed at once


@dataclass(frozen=True)
class Member:
    """Another agent of the same tier, as its report says."""

    node: str
    endpoint: str
    heartbeat: dt.datetime | None
    curve_key: str | None = None  # the CURVE public key its peer endpoint serves with


class Registry(ABC):
    node: str
    endpoint: str | None = None  # this agent's peer endpoint, published with its report
    # and the CURVE public key it serves with (public; peers dial it only when they trust
    # it). NIXL metadata is never published: peers ask for it over the CURVE channel.
    curve_key: str | None = None

    def advertise(self, endpoint: str, curve_key: str | None = None) -> None:
        """Publish this agent's peer endpoint (and the key it serves with) from its next
        report on: the peer tier binds after the registry exists, so it says so once bound."""
        self.endpoint, self.curve_key = endpoint, curve_key

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
            "curveKey": self.curve_key,
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
                        parse_time(record["status"].get("heartbeat")),
                        record.get("curveKey"),
                    )
                )
        return found


class KubernetesRegistry(Registry):
    """The agent's own KVCacheNode: its spec applied once (server-side apply, so a restarted
    agent's new endpoint replaces its predecessor's), then its status patched; the tier's
    other agents followed by one watch."""

    def __init__(self, config: ReportConfig, node: str) -> None:
        from kvtier.kube import Client

        self._client = Client(field_manager=FIELD_MANAGER)  # service account, else kubeconfig
        self.namespace = config.namespace
        self.node = node
        self.tier = config.tier
        self.name = f"{config.tier}-{node}"[:253]
        self._created = False
        self._members: dict[str, Member] = {}
        self._members_lock = threading.Lock()
        self._synced = threading.Event()
        self._watcher: threading.Thread | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._watch_task: asyncio.Task[None] | None = None

    def _manifest(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"tier": self.tier, "node": self.node, "version": kvtier.__version__}
        if self.endpoint:
            spec["endpoints"] = {"control": self.endpoint}
        if self.curve_key:
            spec["curveKey"] = self.curve_key
        return {
            "apiVersion": API_VERSION,
            "kind": "KVCacheNode",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {TIER_LABEL: str(self.tier)},
            },
            "spec": spec,
        }

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
            parse_time((item.get("status") or {}).get("heartbeat")),
            spec.get("curveKey"),
        )

    def _watch(self) -> None:
        """The watch runs on an event loop of this thread, so close() can cancel it at once
        (a blocking read of a stream cannot be interrupted from another thread)."""
        loop = asyncio.new_event_loop()
        self._watch_loop = loop
        self._watch_task = loop.create_task(self._follow())
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(self._watch_task)
        loop.close()

    async def _follow(self) -> None:
        """LIST, then WATCH from the listing's version (resumed from the last event's version
        after a dropped stream, listed afresh after 410 Gone); on any other error, again after
        a pause."""
        from kvtier.kube import AsyncClient, KVCacheNode, as_dict, retry_watch

        client = AsyncClient(field_manager=FIELD_MANAGER)
        selector: dict[str, Any] = {TIER_LABEL: str(self.tier)}
        try:
            while True:
                try:
                    listing = client.list(KVCacheNode, namespace=self.namespace, labels=selector)
                    found = {}
                    async for obj in listing:
                        item = as_dict(obj)
                        if (member := self._member(item)) is not None:
                            found[item["metadata"]["name"]] = member
                    with self._members_lock:
                        self._members = found
                    self._synced.set()
                    async for kind, obj in client.watch(
                        KVCacheNode,
                        namespace=self.namespace,
                        labels=selector,
                        resource_version=listing.resourceVersion,
                        server_timeout=WATCH_SECONDS,
                        on_error=retry_watch,
                    ):
                        self._on_event(kind, as_dict(obj))
                except Exception as exc:  # the API server unreachable, credentials refused
                    log.debug("watching KVCacheNodes: %s", exc)
                    await asyncio.sleep(2)
        finally:
            await client.close()

    def _on_event(self, kind: str, item: dict[str, Any]) -> None:
        name = (item.get("metadata") or {}).get("name")
        if not name:
            return
        member = None if kind == "DELETED" else self._member(item)
        with self._members_lock:
            if member is None:
                self._members.pop(name, None)
            else:
                self._members[name] = member

    def close(self) -> None:
        loop, task = self._watch_loop, self._watch_task
        if loop is not None and task is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(task.cancel)
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self._client.close()

    def publish(self, status: dict[str, Any]) -> None:
        from lightkube.types import PatchType

        from kvtier.kube import ApiError, KVCacheNode, not_found, to_object

        if not self._created:
            # Apply, forced: the spec left by this node's previous agent (its address and
            # NIXL agent have changed since) is replaced, whoever wrote it.
            self._client.apply(to_object(self._manifest()), force=True)
            self._created = True
        try:
            self._client.patch(
                KVCacheNode.Status,
                self.name,
                # a merge patch: fields it leaves out stay, so a stream this agent does not
                # run (events) is cleared, not left as an earlier agent's address
                {"status": {"events": None, **status}},
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as exc:
            if not_found(exc):
                self._created = False  # deleted under us: recreated next time
            raise


def make_registry(config: ReportConfig) -> Registry | None:
    node = config.node or os.environ.get("NODE_NAME") or socket.gethostname()
    if config.target == "kubernetes":
        return KubernetesRegistry(config, node)
    if config.target == "file":
        assert config.directory is not None
        return FileRegistry(config.directory, node)
    return None
