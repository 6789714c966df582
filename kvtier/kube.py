"""kvtier's one Kubernetes API client library, lightkube, and what its users share.

The operator (kopf's event loop), the agent (a reporter thread and a watch thread) and
`kubectl kvtier` all talk to the API server through lightkube: it has an asynchronous and a
synchronous client over the same configuration loader, which reads in-cluster service-account
credentials and kubeconfigs alike (inline `certificate-authority-data`, client certificates,
token files, exec plugins), does server-side apply, and resumes watches from the last
resourceVersion. The vLLM plug-in never imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml
from lightkube import ApiError, AsyncClient, Client, codecs
from lightkube.core.resource_registry import resource_registry
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import OnErrorAction, OnErrorResult

GROUP = "kvtier.io"
VERSION = "v1alpha1"
FIELD_MANAGER = "kvtier-operator"  # the operator's server-side apply identity

KVCacheTier = create_namespaced_resource(GROUP, VERSION, "KVCacheTier", "kvcachetiers")
KVCacheNode = create_namespaced_resource(GROUP, VERSION, "KVCacheNode", "kvcachenodes")

Manifest = dict[str, Any]
# One INFO line per HTTP request would drown the operator's and the agent's own logs.
logging.getLogger("httpx2").setLevel(logging.WARNING)

__all__ = [
    "FIELD_MANAGER",
    "ApiError",
    "AsyncClient",
    "Client",
    "KVCacheNode",
    "KVCacheTier",
    "as_dict",
    "resource_of",
    "retry_watch",
    "to_object",
]


def credentials_problem() -> str | None:
    """Why no client of the API server can be made here, or None: no service account and
    no kubeconfig, or a kubeconfig that does not parse as one (lightkube then raises
    whatever its YAML reader or its lookups raise, not its ConfigError)."""
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.core.exceptions import ConfigError

    try:
        KubeConfig.from_env()  # the service account in a pod, else KUBECONFIG or ~/.kube/config
    except ConfigError as exc:
        return str(exc)
    except (OSError, ValueError, LookupError, TypeError, AttributeError, yaml.YAMLError) as exc:
        said = " ".join(str(exc).split())  # yaml's errors span lines
        return f"the kubeconfig cannot be read ({type(exc).__name__}: {said})"
    return None


def resource_of(api_version: str, kind: str) -> Any:
    """The lightkube resource type of a kind (built-in, or one of kvtier's CRDs)."""
    return resource_registry.load(api_version, kind)


def to_object(manifest: Manifest) -> Any:
    """A manifest (as the builders make them) as the lightkube object to send."""
    return codecs.from_dict(manifest)


def as_dict(obj: Any) -> Manifest:
    """What lightkube returned, as the plain manifest the rest of kvtier works with."""
    return dict(obj.to_dict())


def not_found(exc: ApiError) -> bool:
    return exc.status.code == 404


def retry_watch(_exc: Exception, count: int) -> OnErrorResult:
    """Watch errors (the API server restarting, a dropped stream): resume from the last
    resourceVersion (lightkube lists afresh after 410 Gone), backing off up to 30 s."""
    return OnErrorResult(OnErrorAction.RETRY, sleep=min(30.0, 0.5 * 2 ** min(count, 6)))
