"""Redaction of configured patterns in prompts, answers and logs.

Settings (``[plugins.settings.redact]``):

``patterns``
    Names of built-in patterns (``email``, ``api_key``, ``credit_card``,
    ``ipv4``) and/or regular expressions (Python syntax). Default
    ``["email", "api_key"]``. An expression that matches the empty string is
    refused. ``credit_card`` only matches numbers that pass the Luhn check.
``replacement``
    Text put in place of a match, default ``[REDACTED]``.
``requests``
    Redact string values in JSON request bodies (prompts) before they go
    upstream: bodies declared ``*json*`` or without a content type, and any
    other buffered body that parses as a JSON object or array. Default true.
    Other bodies (multipart uploads, ...) are not inspected.
``reject_unreadable``
    With ``requests``, refuse a request declared JSON (or without a content
    type) whose body cannot be inspected, rather than forward it unredacted:
    no ``Content-Length`` (411), larger than the proxy buffers (413), or, when
    declared JSON, not valid JSON (400). Default true.
``responses``
    Redact text answers (``text/*``, JSON, SSE, or no content type) on their
    way to the client. Default true. Binary bodies pass untouched.

    - SSE is redacted one whole event at a time (a match never straddles two
      network reads); each ``data:`` line holding JSON is parsed and its
      string values redacted, so JSON escapes cannot hide a match. An event
      longer than ``max_buffer`` is flushed at line ends. Note that a model
      streams a few characters per event: a match spread over several events
      is not caught.
    - Other bodies with a ``Content-Length`` up to ``max_buffer`` are
      redacted whole (JSON ones value by value) and sent at once.
    - Anything else is redacted per network read, so a match split across
      two reads can slip through.

    The proxy asks regions for ``Accept-Encoding: identity``; a text answer
    that still arrives compressed cannot be inspected and is replaced by a
    502 error.
``max_buffer``
    Bytes held at most per response (see above), default 1 MiB.
``logs``
    Redact every record of the ``edgeproxy`` loggers (``edgeproxy`` and
    ``edgeproxy.*``): message, traceback and stack text, as the record is
    created, so every handler sees the redacted record. A redacted traceback
    replaces the record's ``exc_info``. This hooks the process-wide log record
    factory from startup to shutdown, so with several proxies in one process
    every enabled ``redact`` applies to every ``edgeproxy`` record. Default true.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from edgeproxy import (
    Exchange,
    RequestContext,
    Response,
    SSEEventTooLarge,
    SSEReader,
    UpstreamReply,
    error_response,
    hookimpl,
)

__all__ = ["BUILTIN_PATTERNS", "Redactor", "edgeproxy_plugin"]

BUILTIN_PATTERNS = {
    # The lookbehind makes a match start only where a run of address characters
    # starts, so a long run without "@" costs linear, not quadratic, time.
    "email": (
        r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+"
        r"@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
    ),
    "api_key": (
        r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}"
        r"|\bAKIA[0-9A-Z]{16}\b"
        r"|\bgh[pousr]_[A-Za-z0-9]{36,}"
        r"|\bAIza[0-9A-Za-z_-]{35}"
    ),
    "credit_card": r"\b[0-9](?:[ -]?[0-9]){12,18}\b",
    # Not inside a longer dotted number such as a version "1.2.3.4.5".
    "ipv4": (
        r"(?<![0-9.])(?:(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}"
        r"(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])(?!\.?[0-9])"
    ),
}

_STATE_KEY = "redact"
_DEFAULT_MAX_BUFFER = 1024 * 1024
_SETTINGS = frozenset(
    {"patterns", "replacement", "requests", "reject_unreadable", "responses", "logs", "max_buffer"}
)
_LINE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n|$)")
_TEXT_TYPES = ("text/", "application/x-ndjson", "application/javascript", "application/xml")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = ord(ch) - 48
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _is_text(content_type: str) -> bool:
    ctype = content_type.split(";", 1)[0].strip().lower()
    return not ctype or "json" in ctype or ctype.endswith("+xml") or ctype.startswith(_TEXT_TYPES)


def _header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


class Redactor:
    """Finds and replaces the configured patterns in text, JSON, SSE and log records."""

    def __init__(
        self,
        patterns: Iterable[str] = ("email", "api_key"),
        *,
        replacement: str = "[REDACTED]",
        requests: bool = True,
        reject_unreadable: bool = True,
        responses: bool = True,
        logs: bool = True,
        max_buffer: int = _DEFAULT_MAX_BUFFER,
    ) -> None:
        self.replacement = replacement
        self._subs: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = []
        for pattern in patterns:
            source = BUILTIN_PATTERNS.get(pattern, pattern)
            try:
                regex = re.compile(source)
            except re.error as exc:
                raise ValueError(f"pattern {pattern!r} is not a valid expression: {exc}") from None
            if regex.fullmatch(""):
                raise ValueError(f"pattern {pattern!r} matches the empty string")
            # A function, never a template: backslashes in the replacement stay literal.
            self._subs.append((regex, self._luhn_sub if pattern == "credit_card" else self._sub))
        if not self._subs:
            raise ValueError("no patterns to redact")
        self.requests = requests
        self.reject_unreadable = reject_unreadable
        self.responses = responses
        self.max_buffer = max_buffer
        self.logs = logs
        self._log_hook: _LogRecordHook | None = None

    def _sub(self, match: re.Match[str]) -> str:
        return self.replacement

    def _luhn_sub(self, match: re.Match[str]) -> str:
        digits = "".join(ch for ch in match.group() if ch in "0123456789")
        return self.replacement if _luhn(digits) else match.group()

    # -- redaction primitives ---------------------------------------------

    def text(self, value: str) -> str:
        for regex, replacement in self._subs:
            value = regex.sub(replacement, value)
        return value

    def data(self, value: bytes) -> bytes:
        """Redact text bytes; bytes that are not UTF-8 (a split character) pass unchanged."""
        text = value.decode("utf-8", "surrogateescape")
        redacted = self.text(text)
        return value if redacted == text else redacted.encode("utf-8", "surrogateescape")

    def json(self, value: Any) -> tuple[Any, bool]:
        """Redact every string value (not keys) of parsed JSON, in place; ``(value, changed)``."""
        if isinstance(value, str):
            redacted = self.text(value)
            return redacted, redacted != value
        changed = False
        stack = [value] if isinstance(value, dict | list) else []
        while stack:  # iterative: a deeply nested body must not exhaust the stack
            node = stack.pop()
            items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            for key, item in items:
                if isinstance(item, str):
                    redacted = self.text(item)
                    if redacted != item:
                        node[key] = redacted
                        changed = True
                elif isinstance(item, dict | list):
                    stack.append(item)
        return value, changed

    def json_bytes(self, body: bytes) -> bytes:
        """A whole body: value by value when it is JSON, else as text."""
        stripped = body.lstrip()
        if stripped[:1] in (b"{", b"["):
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                pass
            else:
                redacted, changed = self.json(parsed)
                return orjson.dumps(redacted) if changed else body
        return self.data(body)

    def sse(self, events: bytes) -> bytes:
        """Complete SSE lines: JSON ``data:`` lines value by value, the others as text."""
        out: list[bytes] = []
        for match in _LINE.finditer(events):
            line, end = match.group(1), match.group(2)
            if not line and not end:
                continue
            if line.startswith(b"data:"):
                prefix_len = 6 if line.startswith(b"data: ") else 5
                value = line[prefix_len:]
                if value[:1] in (b"{", b"["):
                    line = line[:prefix_len] + self.json_bytes(value)
                else:
                    line = line[:prefix_len] + self.data(value)
            else:
                line = self.data(line)
            out.append(line + end)
        return b"".join(out)

    # -- requests ----------------------------------------------------------

    @hookimpl(trylast=True)
    def edgeproxy_request_received(self, request: Exchange, ctx: RequestContext) -> Response | None:
        if not self.requests:
            return None
        content_type = ctx.headers.get("content-type")
        # Some servers read a body without a content type as JSON: inspect those too.
        declared_json = content_type is None or "json" in content_type.lower()
        if not ctx.body_read:
            # Streamed upstream as it arrives: nothing here can look inside.
            if not (declared_json and self.reject_unreadable):
                return None
            if request.content_length is None:
                return _error(411, "A JSON request body needs a Content-Length.", "length_required")
            return _error(413, "The JSON request body is too large.", "request_too_large")
        body = ctx.body
        if not body:
            return None
        data = ctx.json
        if data is None:
            # Not parsed by the proxy (no JSON content type, or invalid): any body
            # that is a JSON object or array is a prompt to some server.
            if declared_json or body.lstrip()[:1] in (b"{", b"["):
                try:
                    data = orjson.loads(body)
                except orjson.JSONDecodeError:
                    if declared_json and self.reject_unreadable:
                        return _error(400, "The request body is not valid JSON.", "invalid_json")
                    return None
            if data is None:
                return None
        redacted, changed = self.json(data)
        if changed:
            ctx.set_json(redacted)
            # set_json declares application/json; keep what the client declared.
            if content_type is None:
                ctx.headers.popall("content-type", None)
            else:
                ctx.headers["content-type"] = content_type
        return None

    # -- responses ---------------------------------------------------------

    @hookimpl
    def edgeproxy_upstream_request(self, headers: list[tuple[str, str]]) -> None:
        if self.responses:
            # Compressed answers cannot be redacted: ask for them plain.
            headers[:] = [(k, v) for k, v in headers if k != "accept-encoding"]
            headers.append(("accept-encoding", "identity"))

    @hookimpl(trylast=True)
    def edgeproxy_upstream_response(self, ctx: RequestContext, reply: UpstreamReply) -> None:
        ctx.extra.pop(_STATE_KEY, None)
        if not self.responses:
            return
        content_type = _header(reply.headers, "content-type") or ""
        if not _is_text(content_type):
            return
        encoding = (_header(reply.headers, "content-encoding") or "identity").strip().lower()
        if encoding != "identity":
            # Fail closed: the client gets an error instead of what could not be inspected.
            reply.status = 502
            reply.headers[:] = [
                (k, v)
                for k, v in reply.headers
                if k.lower() not in ("content-encoding", "content-type", "content-length")
            ]
            reply.headers.append(("content-type", "application/json"))
            ctx.extra[_STATE_KEY] = _Blocked()
            return
        length = _header(reply.headers, "content-length")
        if content_type.lower().startswith("text/event-stream"):
            ctx.extra[_STATE_KEY] = _SseState(self)
        elif length is not None and length.isdigit() and int(length) <= self.max_buffer:
            ctx.extra[_STATE_KEY] = _WholeBody(self, int(length))
        else:
            ctx.extra[_STATE_KEY] = _PerChunk(self)

    @hookimpl(tryfirst=True)
    def edgeproxy_stream_chunk(self, ctx: RequestContext, chunk: bytes) -> bytes | None:
        # tryfirst: see the region's own bytes, and hand every other plugin redacted ones.
        state = ctx.extra.get(_STATE_KEY)
        if not isinstance(state, _ResponseState):
            return None
        return state.feed(chunk)

    # -- logs --------------------------------------------------------------

    @hookimpl
    def edgeproxy_startup(self) -> None:
        if self.logs and self._log_hook is None:
            self._log_hook = _LogRecordHook(self)
            self._log_hook.install()

    @hookimpl
    def edgeproxy_shutdown(self) -> None:
        if self._log_hook is not None:
            self._log_hook.uninstall()
            self._log_hook = None

    def redact_record(self, record: logging.LogRecord) -> None:
        """Redact a log record's message, traceback and stack text in place."""
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the handler's to report
            return
        redacted = self.text(message)
        if redacted != message:
            record.msg = redacted
            record.args = None
        if record.exc_info and record.exc_info[1] is not None:
            trace = _FORMATTER.formatException(record.exc_info)
            redacted = self.text(trace)
            if redacted != trace:
                # Formatters print exc_text; nothing may reach the raw exception.
                record.exc_text = redacted
                record.exc_info = None
        if record.stack_info:
            record.stack_info = self.text(record.stack_info)


_FORMATTER = logging.Formatter()


class _ResponseState:
    def feed(self, chunk: bytes) -> bytes:
        raise NotImplementedError


class _Blocked(_ResponseState):
    def __init__(self) -> None:
        self.sent = False

    def feed(self, chunk: bytes) -> bytes:
        if self.sent:
            return b""
        self.sent = True
        message = "The region sent a compressed answer, which cannot be redacted."
        return error_response(502, "upstream_error", message, code="redaction_failed").body


class _PerChunk(_ResponseState):
    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor

    def feed(self, chunk: bytes) -> bytes:
        return self.redactor.data(chunk)


class _WholeBody(_ResponseState):
    """Holds a body of known length until it is complete, then redacts it whole."""

    def __init__(self, redactor: Redactor, length: int) -> None:
        self.redactor = redactor
        self.remaining = length
        self.parts: list[bytes] = []

    def feed(self, chunk: bytes) -> bytes:
        if self.remaining < 0:
            return self.redactor.data(chunk)  # more than announced: per chunk from here
        self.parts.append(chunk)
        self.remaining -= len(chunk)
        if self.remaining > 0:
            return b""
        body = b"".join(self.parts)
        self.parts.clear()
        return self.redactor.json_bytes(body)


class _SseState(_ResponseState):
    """Holds back an unfinished SSE event so that it is redacted whole (the events as
    edgeproxy's SSE reader frames them: each one's exact bytes, redacted line by line)."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor
        self.reader = SSEReader(max_event=redactor.max_buffer)

    def feed(self, chunk: bytes) -> bytes:
        held = self.reader.tail
        try:
            events = self.reader.feed(chunk)
        except SSEEventTooLarge:
            # An overlong event: flush its lines as they are rather than hold it all; the
            # rest of it comes to a fresh reader, line by line all the same.
            pending = held + chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r", 0, len(pending) - 1)) + 1
            if cut <= 0:
                cut = len(pending)
            self.reader = SSEReader(max_event=self.redactor.max_buffer)
            rest = self.reader.feed(pending[cut:]) if cut < len(pending) else []
            return self.redactor.sse(pending[:cut] + b"".join(event.raw for event in rest))
        if not events:
            return b""
        return self.redactor.sse(b"".join(event.raw for event in events))


class _LogRecordHook:
    """Wraps the logging record factory, so records are redacted before any handler sees them.

    Handlers and loggers may be added at any time; the record factory sees
    every record of every logger, and only ``edgeproxy`` ones are touched.
    """

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor
        self.active = False
        self.previous: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()
        # One bound method, so that uninstall can recognise it.
        self.factory = self._make

    def _make(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.previous(*args, **kwargs)
        if self.active and (record.name == "edgeproxy" or record.name.startswith("edgeproxy.")):
            self.redactor.redact_record(record)
        return record

    def install(self) -> None:
        self.previous = logging.getLogRecordFactory()
        self.active = True
        logging.setLogRecordFactory(self.factory)

    def uninstall(self) -> None:
        self.active = False
        if logging.getLogRecordFactory() is self.factory:
            logging.setLogRecordFactory(self.previous)
        # Else someone wrapped the factory after us: we stay in their chain, inactive.


def _error(status: int, message: str, code: str) -> Response:
    return error_response(status, "invalid_request_error", message, code=code)


def edgeproxy_plugin(settings: dict[str, Any]) -> Redactor:
    """Plugin factory: edgeproxy calls it with ``[plugins.settings.redact]``."""
    unknown = set(settings) - _SETTINGS
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    patterns = settings.get("patterns", ["email", "api_key"])
    if isinstance(patterns, str) or not isinstance(patterns, list | tuple):
        raise ValueError("patterns must be a list of pattern names or expressions")
    if not all(isinstance(p, str) for p in patterns):
        raise ValueError("patterns must be strings")
    replacement = settings.get("replacement", "[REDACTED]")
    if not isinstance(replacement, str):
        raise ValueError("replacement must be a string")
    flags: dict[str, bool] = {}
    for name in ("requests", "reject_unreadable", "responses", "logs"):
        if name in settings:
            if not isinstance(settings[name], bool):
                raise ValueError(f"{name} must be true or false")
            flags[name] = settings[name]
    max_buffer = settings.get("max_buffer", _DEFAULT_MAX_BUFFER)
    if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1:
        raise ValueError("max_buffer must be a positive number of bytes")
    return Redactor(patterns, replacement=replacement, max_buffer=max_buffer, **flags)
