"""A small asynchronous Kubernetes API client for the objects the operator owns.

kopf watches and patches the resources it handles; children (ConfigMaps, DaemonSets, ...)
are created and repaired through this client, which reuses the credentials kopf logged in
with, so both always talk to the same API server as the same identity.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from typing import Any

import aiohttp

Manifest = dict[str, Any]

_PLURALS = {
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "Service": "services",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "DaemonSet": "daemonsets",
    "KVCacheTier": "kvcachetiers",
    "KVCacheNode": "kvcachenodes",
    "Secret": "secrets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def object_url(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    url = f"{prefix}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{url}/{name}" if name else url


def _ssl_context(info: Any) -> ssl.SSLContext | bool:
    if getattr(info, "insecure", False):
        return False
    context = (
        ssl.create_default_context(cafile=info.ca_path)
        if info.ca_path
        else (ssl.create_default_context())
    )
    if info.ca_data:
        context.load_verify_locations(cadata=base64.b64decode(info.ca_data).decode())
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl loads client certificates from files only.
        paths = []
        for data, suffix in ((info.certificate_data, ".crt"), (info.private_key_data, ".key")):
            with tempfile.NamedTemporaryFile(delete=False, suffix=suffix) as f:
                f.write(base64.b64decode(data))
                paths.append(f.name)
        cert, key = paths
    if cert:
        context.load_cert_chain(cert, key)
    return context


class KubeClient:
    def __init__(self, info: Any) -> None:
        """`info` is kopf's ConnectionInfo (server, token or client certificate, CA)."""
        headers = {"Content-Type": "application/json"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = aiohttp.BasicAuth(info.username, info.password) if info.username else None
        self._base = info.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            headers=headers,
            auth=auth,
            connector=aiohttp.TCPConnector(ssl=_ssl_context(info)),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def request(
        self, method: str, url: str, body: Any = None, content_type: str = "application/json"
    ) -> Manifest | None:
        async with self._session.request(
            method, self._base + url, json=body, headers={"Content-Type": content_type}
        ) as resp:
            if resp.status == 404:
                return None
            if resp.status >= 400:
                raise KubeError(resp.status, await resp.text())
            data = await resp.json(content_type=None)
            return dict(data) if isinstance(data, dict) else None

    async def get(self, manifest: Manifest) -> Manifest | None:
        meta = manifest["metadata"]
        return await self.request(
            "GET",
            object_url(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]),
        )

    async def exists(self, kind: str, namespace: str, name: str) -> bool:
        return await self.request("GET", object_url("v1", kind, namespace, name)) is not None

    async def create(self, manifest: Manifest) -> Manifest | None:
        meta = manifest["metadata"]
        return await self.request(
            "POST",
            object_url(manifest["apiVersion"], manifest["kind"], meta["namespace"]),
            manifest,
        )

    async def merge_patch(self, manifest: Manifest, patch: Manifest) -> Manifest | None:
        meta = manifest["metadata"]
        return await self.request(
            "PATCH",
            object_url(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]),
            patch,
            "application/merge-patch+json",
        )

    async def close(self) -> None:
        await self._session.close()
