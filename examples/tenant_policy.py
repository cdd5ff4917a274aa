"""A custom plugin: a per-tenant model allow-list, and a header on every answer.

Enable it by file path, with its settings::

    [plugins]
    enabled = ["tenant_policy.py"]   # relative to the config file

    [plugins.settings.tenant_policy]
    tenant_header = "X-Tenant-Id"
    default_models = ["small"]

    [plugins.settings.tenant_policy.models]
    acme = ["small", "large"]

A request whose JSON ``model`` is not allowed for its tenant gets a 403 in the
OpenAI error shape before any upstream work.
"""

from __future__ import annotations

from typing import Any

from edgeproxy import RequestContext, Response, UpstreamReply, error_response, hookimpl


class TenantPolicy:
    def __init__(
        self,
        models: dict[str, list[str]],
        *,
        default_models: list[str] | None = None,
        tenant_header: str = "X-Tenant-Id",
    ) -> None:
        self.models = {tenant: set(allowed) for tenant, allowed in models.items()}
        self.default_models = set(default_models or ())
        self.tenant_header = tenant_header

    @hookimpl
    def edgeproxy_request_received(self, ctx: RequestContext) -> Response | None:
        tenant = ctx.tenant or ctx.headers.get(self.tenant_header) or "anonymous"
        ctx.tenant = tenant
        body = ctx.json
        if not isinstance(body, dict) or "model" not in body:
            return None
        allowed = self.models.get(tenant, self.default_models)
        if body["model"] not in allowed:
            return error_response(
                403,
                "invalid_request_error",
                f"model {body['model']!r} is not enabled for tenant {tenant!r}",
                code="model_not_allowed",
            )
        return None

    @hookimpl
    def edgeproxy_upstream_response(self, ctx: RequestContext, reply: UpstreamReply) -> None:
        reply.headers.append(("X-Tenant", ctx.tenant or "anonymous"))


def edgeproxy_plugin(settings: dict[str, Any]) -> TenantPolicy:
    return TenantPolicy(
        dict(settings.get("models", {})),
        default_models=list(settings.get("default_models", [])),
        tenant_header=str(settings.get("tenant_header", "X-Tenant-Id")),
    )
