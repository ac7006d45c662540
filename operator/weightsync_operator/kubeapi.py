"""The few API calls the operator makes, for any kind it manages, through one generic path.

Children are written with server-side apply under one field manager
(``weightsync-operator``) and ``force``: applying the same object twice is a
no-op, two racing reconciles converge on the same object, and a restarted
operator re-applies what it applied before instead of creating a duplicate.
The token and TLS Secrets are the exception: each is created once and never
re-applied, so a reconcile can never rotate them under running pods.

This is the only module that talks to the kubernetes client; everything above
it passes plain dicts (the same JSON the API server stores).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client

from weightsync_operator.names import MANAGER

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        # no namespace: every namespace (a list only)
        out = f"{base}/namespaces/{quote(namespace)}/{self.plural}" if namespace else f"{base}/{self.plural}"
        return f"{out}/{quote(name)}" if name else out


KINDS = {
    k.kind: k
    for k in (
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Service", "services"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("weightsync.io/v1alpha1", "RLJob", "rljobs"),
        Kind("weightsync.io/v1alpha1", "WeightVersion", "weightversions"),
    )
}
"""The kinds a job owns or reads (every one but Secret and RLJob is watched, see ``handlers.WATCHED``)."""
LEASE = Kind("coordination.k8s.io/v1", "Lease", "leases")
"""The leader election's lock (``leader``): the operator's own, never a job's."""
EVENT = Kind("v1", "Event", "events")
"""Read only where a controller reports what it could not create (a StatefulSet's pods): never watched."""
NODE = Kind("v1", "Node", "nodes")
"""Read by the built-in gang admission (``admission``), which also lists pods of every namespace."""
WORKLOAD = Kind("kueue.x-k8s.io/v1beta2", "Workload", "workloads")
"""Kueue's admission unit: a job's Workload (``kueue``), watched only with the Kueue integration on."""
FLAVOR = Kind("kueue.x-k8s.io/v1beta2", "ResourceFlavor", "resourceflavors")
"""Read for the node labels of the flavors Kueue assigned to a job."""
_PATHS = {**KINDS, **{k.kind: k for k in (LEASE, EVENT, NODE, WORKLOAD, FLAVOR)}}
TIMEOUT_S = 30.0
"""No API call blocks longer (a reconcile's retry backoff takes over)."""


class ApiError(Exception):
    """A non-2xx answer: ``status`` is the HTTP code, ``reason`` the API server's (``Invalid``, ``Forbidden``, ...)
    and ``detail`` its message."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        try:
            answer = json.loads(body)
            message, reason = str(answer.get("message", body)), str(answer.get("reason", ""))
        except (ValueError, AttributeError):
            message, reason = body, ""
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status, self.reason, self.detail = status, reason, message


class Api:
    """Generic get/list/apply/create/delete/patch-status over one ApiClient."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._client = api_client

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = TIMEOUT_S,
    ) -> Obj | None:
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self._client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self._client.call_api(*params, _request_timeout=timeout)
        data = response.read()  # type: ignore[no-untyped-call,unused-ignore]
        text = data.decode() if isinstance(data, bytes) else str(data or "")
        if not 200 <= response.status < 300:
            raise ApiError(response.status, method, path, text)
        parsed: Obj | None = json.loads(text) if text else None
        return parsed

    def get(self, kind: str, namespace: str, name: str, timeout: float = TIMEOUT_S) -> Obj | None:
        try:
            return self._call("GET", _PATHS[kind].path(namespace, name), timeout=timeout)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, label_selector: str, field_selector: str = "") -> list[Obj]:
        """Objects of ``kind`` in ``namespace`` (every namespace, or a cluster-scoped kind, when empty)."""
        query = {"labelSelector": label_selector} | ({"fieldSelector": field_selector} if field_selector else {})
        out = self._call("GET", _PATHS[kind].path(namespace), query=query) or {}
        items: list[Obj] = out.get("items", [])
        return items

    def apply(self, obj: Obj) -> Obj | None:
        """Server-side apply ``obj`` under the operator's field manager."""
        meta = obj["metadata"]
        path = KINDS[obj["kind"]].path(meta["namespace"], meta["name"])
        return self._call(
            "PATCH",
            path,
            body=obj,
            query={"fieldManager": MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def create(self, obj: Obj, timeout: float = TIMEOUT_S) -> bool:
        """Create ``obj`` unless it exists; True when this call created it."""
        try:
            self._call("POST", _PATHS[obj["kind"]].path(obj["metadata"]["namespace"]), body=obj, timeout=timeout)
        except ApiError as err:
            if err.status == 409:
                return False
            raise
        return True

    def replace(self, obj: Obj, timeout: float = TIMEOUT_S) -> Obj | None:
        """PUT ``obj`` if its ``metadata.resourceVersion`` is still current: the object as written, or None when
        somebody wrote in between."""
        meta = obj["metadata"]
        try:
            return self._call(
                "PUT", _PATHS[obj["kind"]].path(meta["namespace"], meta["name"]), body=obj, timeout=timeout
            )
        except ApiError as err:
            if err.status == 409:
                return None
            raise

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        """Delete if present; True when this call deleted it."""
        try:
            self._call("DELETE", KINDS[kind].path(namespace, name), body={"propagationPolicy": propagation})
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: Obj, resource_version: str | None) -> None:
        """Merge-patch the status subresource; with ``resource_version``, only if nobody wrote in between."""
        self.patch(kind, namespace, name, {"status": status}, resource_version, "/status")

    def patch(
        self, kind: str, namespace: str, name: str, body: Obj, resource_version: str | None = None, sub: str = ""
    ) -> None:
        """Merge-patch the object (``sub``: a subresource, e.g. ``/status``); with ``resource_version``, only if
        nobody wrote in between."""
        if resource_version:
            body = {**body, "metadata": {**body.get("metadata", {}), "resourceVersion": resource_version}}
        path = _PATHS[kind].path(namespace, name) + sub
        self._call("PATCH", path, body=body, content_type="application/merge-patch+json")
