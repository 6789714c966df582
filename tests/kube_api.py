"""A stateful Kubernetes API server on loopback for the operator tests: kmock's emulator,
run on its own thread and event loop, with the few server behaviours kopf relies on that the
emulator leaves out (uid, resourceVersion, generation and creationTimestamp set on create,
resourceVersion bumped on every change), the built-in resources and kvtier's CRDs
registered for discovery, and a kubeconfig pointing at it."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml

from tests.apiserver_rules import load_crd

_versions = itertools.count(1)


class KubeEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    updates: list[tuple[str, str]]  # (plural, name) of every update, for write counting

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and request.action == kmock.action.UPDATE:
            self.updates.append((request.resource.plural, request.name))
        data = request.data if isinstance(request.data, dict) else None
        if request.resource is not None and data is not None:
            meta = data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if "name" not in meta and "generateName" in meta:
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault(
                    "creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                )
            if request.action in {kmock.action.CREATE, kmock.action.UPDATE}:
                meta["resourceVersion"] = str(next(_versions))
        return await super()._handle(request)


class KubeAPI:
    """Start with `with KubeAPI(tmp) as api:`; `api.kubeconfig` is the path for clients."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.emulator: Any = None
        self._server: Any = None
        self._session: Any = None
        self.url = ""

    def __enter__(self) -> KubeAPI:
        self._thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *_: object) -> None:
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _run(self, coro: Any, timeout: float = 30) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    async def _start(self) -> None:
        self.emulator = KubeEmulator()
        self.emulator.updates = []
        self.emulator.resources.load_bundled()
        for name in ("kvcachetier.yaml", "kvcachenode.yaml"):
            crd = load_crd(name)
            names = crd["spec"]["names"]
            key = f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}/{names['plural']}"
            self.emulator.resources[key] = kmock.ResourceInfo(
                namespaced=True,
                kind=names["kind"],
                singular=names["singular"],
                shortnames=set(names.get("shortNames", [])),
                subresources={"status"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
        await self.emulator.__aenter__()
        self._server = kmock.Server(self.emulator)
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        self._session = aiohttp.ClientSession()

    async def _stop(self) -> None:
        await self._session.close()
        await self._server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    @property
    def kubeconfig(self) -> Path:
        path = self.directory / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "kmock",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "kmock", "user": {"token": "test"}}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}
                    ],
                }
            )
        )
        return path

    # --- a tiny client for the tests ---------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        async def call() -> tuple[int, Any]:
            async with (
                aiohttp.ClientSession() as session,
                session.request(
                    method,
                    self.url + path,
                    data=None if body is None else json.dumps(body),
                    headers={"Content-Type": content_type},
                ) as resp,
            ):
                text = await resp.text()
                return resp.status, (json.loads(text) if text.strip() else None)

        return self._run(call())  # type: ignore[no-any-return]
