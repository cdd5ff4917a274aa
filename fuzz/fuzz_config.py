"""Fuzz the config loader: a TOML file and ``EDGEPROXY_*`` variables to a ``Config``.

Input: the bytes of the config file; optionally a line ``#ENV`` after which
each line is one ``NAME=value`` environment variable (decoded the way
``os.environ`` decodes them, UTF-8 with surrogates for bad bytes).

Property: ``load_config`` returns a ``Config`` or raises ``ConfigError``
with one non-empty line per problem; no other exception, not even another
``ValueError``, escapes: callers (``edgeproxy check-config``, the CLI) catch
``ConfigError`` only.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from _harness import check, fuzz

from edgeproxy._core.config import Config, ConfigError, load_config

_DIR = tempfile.mkdtemp(
    prefix="edgeproxy-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
)
atexit.register(shutil.rmtree, _DIR, True)
_PATH = os.path.join(_DIR, "edgeproxy.toml")
_ENV_MARK = b"\n#ENV\n"


def _environ(raw: bytes) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in raw.split(b"\n")[:8]:
        name, eq, value = line.partition(b"=")
        if not eq or not name or b"\0" in line:
            continue  # the environment cannot hold these
        env[name.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
    return env


def test_one_input(data: bytes) -> None:
    text, _, env = data.partition(_ENV_MARK)
    with open(_PATH, "wb") as f:
        f.write(text)
    try:
        config = load_config(_PATH, environ=_environ(env))
    except ConfigError as exc:
        check(exc.errors, "ConfigError without errors", exc)
        check(all(type(e) is str and e for e in exc.errors), "error lines", exc.errors)
        str(exc)
        return
    check(isinstance(config, Config), "not a Config", config)


if __name__ == "__main__":
    fuzz(test_one_input, "edgeproxy._core.config", "tomllib")
    sys.exit(0)
