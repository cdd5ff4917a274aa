"""JSON access logs: one line per request, through orjson.

Built in: ``[access_log] enabled = true`` (with ``path`` and ``queue_size``)
registers it without listing it under ``[plugins]``. As a plugin, its
settings (``[plugins.settings.access_log]``) are the same:

``path``
    File to append to. The file is opened at startup (a failure aborts
    startup, naming the plugin) and written by a background thread, so the
    event loop never waits on the disk; a file moved away (log rotation) is
    reopened within a second. ``-`` (the default) sends each line instead to
    the ``edgeproxy.access`` logger at INFO level, through whatever handlers
    the application configured.
``queue_size``
    Lines waiting for the writer thread at most, default 10000. When the disk
    cannot keep up, further lines are dropped (and counted, with a warning)
    rather than slow requests down.

Each line is one JSON object with: ``ts`` (Unix time at completion),
``request_id``, ``trace_id``, ``method``, ``path`` (without the query
string, which may carry secrets), ``route`` (the ``[[routes]]`` name),
``status``, ``region``, ``attempts``,
``tenant``, ``client_ip``, ``country``, ``priority``, ``sse``, ``bytes``
(body bytes sent), ``ttfb_ms`` (client-perceived, to the response headers),
``upstream_ttfb_ms``, ``duration_ms``, ``cache``, ``degraded``, ``error``
and ``usage`` (the region's token counts, for LLM answers). Timings are
milliseconds or null. Prompts and answers are never logged.
"""

from __future__ import annotations

from typing import Any

from edgeproxy import AccessLog

__all__ = ["AccessLog", "edgeproxy_plugin"]


def edgeproxy_plugin(settings: dict[str, Any]) -> AccessLog:
    """Plugin factory: edgeproxy calls it with ``[plugins.settings.access_log]``."""
    return AccessLog.from_settings(settings)
