"""A stateful Kubernetes API server on loopback for the operator tests: kmock's emulator,
run on its own thread and event loop, with the server behaviours kopf and kvtier rely on that
the emulator leaves out (server fields on create, resourceVersion bumped on every change,
field management and server-side apply, a separate status subresource), the built-in
resources and kvtier's CRDs registered for discovery, and a kubeconfig pointing at it —
over plain HTTP with a token, or over TLS with the CA and a client certificate inlined in
the kubeconfig (`certificate-authority-data`, `client-certificate-data`), as clusters made by
kubeadm and kind hand them out."""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import itertools
import json
import ssl
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.test_utils
import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
import yaml

from tests import field_management as fm
from tests.apiserver_rules import load_crd
from tests.certificates import Certificates

_versions = itertools.count(1)
APPLY = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
# Resources with a status subresource: their status is written only through /status, and
# everything else only through the main resource.
WITH_STATUS = {"kvcachetiers", "kvcachenodes", "daemonsets", "deployments", "pods"}


class KubeEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """kmock's emulator with what a real API server adds to every write: server fields,
    field management and server-side apply (field_management.py), the status subresource kept
    apart from the main resource, and `generation` following spec changes."""

    updates: list[tuple[str, str]]  # (plural, name) of every update, for write counting

    async def _handle(self, request: Any) -> Any:
        # kmock keeps every request and matches each new one by scanning them all: a long
        # test would slow down quadratically. Only requests still being dispatched matter.
        del self._requests[:-32]
        if request.resource is not None and request.action == kmock.action.UPDATE:
            self.updates.append((request.resource.plural, request.name))
        if request.resource is not None and request.action in {
            kmock.action.CREATE,
            kmock.action.UPDATE,
        }:
            try:
                request = await self._written(request)
            except fm.Conflict as exc:
                return _plain_json(_status(409, "Conflict", str(exc)))
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                # a failed `test` op included: a real server answers 422 Unprocessable Entity
                return _plain_json(_status(422, "Invalid", str(exc)))
            if isinstance(request, aiohttp.web.Response):
                return _plain_json(request)
        return _plain_json(await super()._handle(request))

    async def _render_error(self, exc: Exception) -> Any:
        return _plain_json(await super()._render_error(exc))

    async def _written(self, request: Any) -> Any:
        """The request rewritten to store the whole object a real server would store."""
        manager = fm.manager_of(request.params, request.headers.get("User-Agent", ""))
        if request.action == kmock.action.CREATE:
            created = fm.update(None, request.data, manager)
            if request.resource.plural in WITH_STATUS:
                created.pop("status", None)  # written only through /status
            return _rewrite(request, data=_created(created))
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            stored = self._objects[key] if key in self._objects else None  # noqa: SIM401
            live = None if stored is None or stored.deleted else copy.deepcopy(stored.raw)
        kind = request.headers.get("Content-Type", "").split(";")[0]
        if kind == APPLY:
            config = yaml.safe_load(request.text)
            new = fm.apply(live, config, manager, request.params.get("force") == "true")
            if live is None:
                return _rewrite(request, action=kmock.action.CREATE, data=_created(new))
        elif live is None:
            return _status(404, "NotFound", f"{request.resource.plural} {request.name!r} not found")
        elif kind == JSON_PATCH:
            new = fm.update(live, jsonpatch.apply_patch(live, request.data), manager)
        else:  # merge patch; a strategic merge patch merges lists by their keys
            new = fm.update(
                live, fm.merge(live, request.data, patch=True, lists=kind == STRATEGIC), manager
            )
        if request.resource.plural in WITH_STATUS:
            if request.subresource == "status":
                new = {**live, "status": new.get("status"), "metadata": live["metadata"]}
            else:
                new["status"] = live.get("status")
            new = {k: v for k, v in new.items() if v is not None}
        if _comparable(new) == _comparable(live):
            return aiohttp.web.json_response(live)  # nothing changed: no write, no event
        meta = new["metadata"]
        if new.get("spec") != live.get("spec"):
            meta["generation"] = int(live["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = str(next(_versions))
        return _rewrite(request, data=[{"op": "replace", "path": "", "value": new}])


def _plain_json(response: Any) -> Any:
    """`application/json` without a charset, as a real API server answers: lightkube turns
    only such answers into ApiError (with the Status), anything else into a bare HTTP error."""
    if not response.prepared and response.content_type == "application/json":
        response.headers["Content-Type"] = "application/json"
    return response


def _rewrite(request: Any, **changes: Any) -> Any:
    """The request with other contents: kmock matches its reactions against the very request
    object it parsed, so the (frozen) request is changed in place rather than copied."""
    for name, value in changes.items():
        object.__setattr__(request, name, value)
    return request


def _created(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.setdefault("metadata", {})
    if "name" not in meta and "generateName" in meta:
        meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("generation", 1)
    meta.setdefault("creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    meta["resourceVersion"] = str(next(_versions))
    return obj


def _comparable(obj: dict[str, Any]) -> Any:
    """The object without what changes on every write (times of managedFields entries)."""
    meta = dict(obj.get("metadata") or {})
    meta["managedFields"] = [
        {k: v for k, v in e.items() if k != "time"} for e in meta.get("managedFields") or []
    ]
    return {**obj, "metadata": meta}


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
    return aiohttp.web.json_response({**body, "reason": reason, "message": message}, status=code)


class KubeAPI:
    """Start with `with KubeAPI(tmp) as api:`; `api.kubeconfig` is the path for clients.
    With `tls=True` it serves HTTPS only to clients holding a certificate of its own CA."""

    def __init__(self, directory: Path, tls: bool = False) -> None:
        self.directory = directory
        self.certificates = Certificates.generate() if tls else None
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
        self._server = (
            kmock.Server(self.emulator, server_cls=_tls_server(self._server_context()))
            if self.certificates
            else kmock.Server(self.emulator)
        )
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        self._session = aiohttp.ClientSession()

    async def _stop(self) -> None:
        await self._session.close()
        await self._server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def _server_context(self) -> ssl.SSLContext:
        """Server side of TLS: its certificate, and client certificates required."""
        assert self.certificates is not None
        certs = self.certificates
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=certs.ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
        cert, key = self.directory / "apiserver.crt", self.directory / "apiserver.key"
        cert.write_bytes(certs.server_cert)
        key.write_bytes(certs.server_key)
        context.load_cert_chain(cert, key)
        return context

    def client_context(self) -> ssl.SSLContext | None:
        if self.certificates is None:
            return None
        certs = self.certificates
        context = ssl.create_default_context(cadata=certs.ca.decode())
        cert, key = self.directory / "client.crt", self.directory / "client.key"
        cert.write_bytes(certs.client_cert)
        key.write_bytes(certs.client_key)
        context.load_cert_chain(cert, key)
        return context

    @property
    def kubeconfig(self) -> Path:
        cluster: dict[str, Any] = {"server": self.url}
        user: dict[str, Any] = {"token": "test"}
        if self.certificates is not None:

            def b64(data: bytes) -> str:
                return base64.b64encode(data).decode()

            cluster["certificate-authority-data"] = b64(self.certificates.ca)
            user = {
                "client-certificate-data": b64(self.certificates.client_cert),
                "client-key-data": b64(self.certificates.client_key),
            }
        path = self.directory / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "kmock",
                    "clusters": [{"name": "kmock", "cluster": cluster}],
                    "users": [{"name": "kmock", "user": user}],
                    "contexts": [
                        {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}
                    ],
                }
            )
        )
        return path

    def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object and then write its status through /status, as its controller
        would: an API server drops the status of a create where a status subresource exists."""
        code, created = self.request("POST", collection, obj)
        assert code in (200, 201), created
        if "status" not in obj:
            return dict(created)
        path = f"{collection}/{obj['metadata']['name']}/status"
        code, written = self.request(
            "PATCH", path, {"status": obj["status"]}, "application/merge-patch+json"
        )
        assert code == 200, written
        return dict(written)

    # --- a tiny client for the tests ---------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        manager: str = "kvtier-tests",
    ) -> tuple[int, Any]:
        """`manager`: the field manager of a write, as `kubectl --field-manager` sets it."""

        async def call() -> tuple[int, Any]:
            async with (
                aiohttp.ClientSession() as session,
                session.request(
                    method,
                    self.url + path,
                    data=None if body is None else json.dumps(body),
                    headers={"Content-Type": content_type},
                    params={"fieldManager": manager} if method in {"POST", "PATCH"} else None,
                    ssl=self.client_context() or True,
                ) as resp,
            ):
                text = await resp.text()
                return resp.status, (json.loads(text) if text.strip() else None)

        return self._run(call())  # type: ignore[no-any-return]


def _tls_server(context: ssl.SSLContext) -> type[aiohttp.test_utils.RawTestServer]:
    class TLSServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, **kwargs: Any) -> None:
            await super().start_server(ssl=context, **kwargs)

    return TLSServer
