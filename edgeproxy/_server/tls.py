"""TLS on the listeners: the server side SSL contexts, and their reload on SIGHUP.

A context is built once per listener and reloaded in place: new handshakes get the new
certificate, connections already open keep theirs. A reload is tried on a scratch
context first, so that a bad file (a key that does not match, a truncated PEM) leaves
the listener serving with the old pair.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from edgeproxy._core.config import Config, ConfigError

__all__ = ["ListenerTls", "check_tls_files"]

logger = logging.getLogger("edgeproxy.tls")


class ListenerTls:
    """The SSL context of one listener (``section`` is ``server`` or ``admin``).

    Raises :class:`~edgeproxy.ConfigError` naming the key when a file cannot be read,
    is not PEM, or the key does not match the certificate.
    """

    def __init__(
        self,
        section: str,
        cert: str,
        key: str,
        *,
        client_ca: str | None = None,
        base_dir: Path | None = None,
        alpn: tuple[str, ...] = ("http/1.1",),
    ) -> None:
        self.section = section
        self._alpn = list(alpn)
        self._cert = self._path(cert, base_dir)
        self._key = self._path(key, base_dir)
        self._client_ca = self._path(client_ca, base_dir) if client_ca else None
        self.context = self._new_context()
        self._load(self.context)

    @staticmethod
    def _path(value: str, base_dir: Path | None) -> Path:
        path = Path(value).expanduser()
        return path if path.is_absolute() or base_dir is None else base_dir / path

    def _new_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(self._alpn)
        # Forward-secret AEAD suites only for TLS 1.2 (1.3's are all of that kind).
        context.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20")
        context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
        return context

    def _key_name(self, name: str) -> str:
        return f"{self.section}.{name}"

    def _load(self, context: ssl.SSLContext) -> None:
        errors = []
        for name, path in (("tls_cert", self._cert), ("tls_key", self._key)):
            try:
                path.read_bytes()
            except OSError as exc:
                errors.append(f"{self._key_name(name)}: cannot read {path}: {exc.strerror or exc}")
        if errors:
            raise ConfigError(errors)
        try:
            context.load_cert_chain(self._cert, self._key)
        except ssl.SSLError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc):
                message = (
                    f"{self._key_name('tls_key')}: {self._key} is not the key of "
                    f"{self._key_name('tls_cert')} {self._cert}"
                )
            else:
                message = (
                    f"{self._key_name('tls_cert')}, {self._key_name('tls_key')}: not a PEM "
                    f"certificate chain and its private key ({exc.reason or exc})"
                )
            raise ConfigError([message]) from None
        if self._client_ca is not None:
            try:
                context.load_verify_locations(cafile=self._client_ca)
            except (OSError, ssl.SSLError) as exc:
                reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
                raise ConfigError(
                    [f"{self._key_name('tls_client_ca')}: cannot load {self._client_ca}: {reason}"]
                ) from None
            context.verify_mode = ssl.CERT_REQUIRED

    def reload(self) -> bool:
        """Load the files again into the live context; False (logged, the old pair kept)
        when they do not load."""
        try:
            self._load(self._new_context())
        except ConfigError as exc:
            logger.error(
                "%s TLS not reloaded, the current certificate stays: %s", self.section, exc
            )
            return False
        self._load(self.context)
        logger.info("%s TLS certificate reloaded from %s", self.section, self._cert)
        return True


def check_tls_files(config: Config) -> None:
    """Load every TLS file the listeners of ``config`` name, raising
    :class:`~edgeproxy.ConfigError` with one line per problem (``check-config``, and the
    supervisor before it starts workers on a config)."""
    errors: list[str] = []
    server, admin = config.server, config.admin
    pairs = [("server", server.tls_cert, server.tls_key, server.tls_client_ca)]
    pairs.append(("admin", admin.tls_cert, admin.tls_key, None))
    for section, cert, key, client_ca in pairs:
        if cert and key:
            try:
                ListenerTls(section, cert, key, client_ca=client_ca, base_dir=config.base_dir)
            except ConfigError as exc:
                errors.extend(exc.errors)
    if errors:
        raise ConfigError(errors, source=None)
