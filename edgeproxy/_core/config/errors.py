"""The one config error, and pydantic's errors as ``key: reason`` lines."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["ConfigError", "format_errors"]


class ConfigError(ValueError):
    """The configuration is invalid. ``errors`` holds one ``key: reason`` line per problem."""

    def __init__(self, errors: list[str], *, source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}:\n  " + "\n  ".join(errors))


def format_errors(exc: ValidationError) -> list[str]:
    """One ``key: reason`` line per problem, keys written as TOML writes them."""
    lines = []
    for err in exc.errors():
        loc = ""
        for part in err["loc"]:
            if isinstance(part, int):
                loc += f"[{part}]"
            else:
                # A key that is empty or not a bare TOML key is shown quoted, as TOML writes it.
                name = str(part)
                if not name or not name.replace("_", "").replace("-", "").isalnum():
                    name = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
                loc += f".{name}" if loc else name
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        if loc:
            lines.append(f"{loc}: {msg}")
        else:
            lines.append(msg)
    return lines
