"""JSON access logs as a plugin: ``[plugins] enabled = ["edgeproxy.plugins.access_log"]``.

Its settings (``[plugins.settings.access_log]``) are ``path`` and ``queue_size``, the
same as the built-in ``[access_log]`` section; what each line holds is documented on
:class:`edgeproxy.AccessLog` and in docs/observability.md.
"""

from __future__ import annotations

from typing import Any

from edgeproxy import AccessLog

__all__ = ["AccessLog", "edgeproxy_plugin"]


def edgeproxy_plugin(settings: dict[str, Any]) -> AccessLog:
    """Plugin factory: edgeproxy calls it with ``[plugins.settings.access_log]``."""
    return AccessLog.from_settings(settings)
