"""The reference in docs/ stays in step with the code, and the MkDocs site builds.

``python tests/test_docs.py`` rewrites what is generated: the config table of
docs/configuration.md (from ``edgeproxy config-docs``) and each hook's entry in
docs/plugins.md (its signature and docstring, from edgeproxy/hookspecs.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "configuration.md"
HOOKS_PAGE = DOCS / "plugins.md"
TABLE_START = "<!-- config-table:start -->"
TABLE_END = "<!-- config-table:end -->"
REGENERATE = "python tests/test_docs.py"


def config_docs() -> str:
    """The table as the command prints it: the generator the docs must match."""
    result = subprocess.run(
        [sys.executable, "-m", "edgeproxy", "config-docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"edgeproxy config-docs failed:\n{result.stderr}"
    return result.stdout.strip()


def _split_page(text: str) -> tuple[str, str, str]:
    """The page before the table, the table, and the page after it."""
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1, (
        f"docs/configuration.md needs exactly one {TABLE_START} and one {TABLE_END}"
    )
    head, rest = text.split(TABLE_START)
    table, tail = rest.split(TABLE_END)
    return head, table.strip(), tail


def write_config_table() -> None:
    head, _old, tail = _split_page(CONFIG_PAGE.read_text())
    CONFIG_PAGE.write_text(f"{head}{TABLE_START}\n{config_docs()}\n{TABLE_END}{tail}")


def _hook_heading(name: str) -> str:
    from edgeproxy import hookspecs

    params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    return f"### `{name}({params})`"


def _hook_doc(name: str) -> str:
    """The hook's docstring as Markdown (reST ``code`` becomes `code`)."""
    from edgeproxy import hookspecs

    return (inspect.getdoc(getattr(hookspecs, name)) or "").replace("``", "`")


def write_hook_entries() -> None:
    """Rewrite each documented hook's heading and text from its spec, in place.

    A new hook needs a heading of its own first, placed in pipeline order.
    """
    names = set(_hookspecs())
    lines = HOOKS_PAGE.read_text().splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = re.match(r"#+ `(edgeproxy_\w+)\(", lines[i])
        if match and match.group(1) in names:
            name = match.group(1)
            out += [_hook_heading(name), "", *_hook_doc(name).splitlines(), ""]
            i += 1
            while i < len(lines) and not lines[i].startswith("#"):
                i += 1
            continue
        out.append(lines[i])
        i += 1
    HOOKS_PAGE.write_text("\n".join(out) + "\n")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _all_docs() -> str:
    return "\n".join(page.read_text() for page in _pages())


def _hookspecs() -> list[str]:
    from edgeproxy import hookspecs

    return sorted(
        name
        for name, obj in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("edgeproxy_") and obj.__module__ == hookspecs.__name__
    )


def test_config_table_is_the_generators_output() -> None:
    _head, table, _tail = _split_page(CONFIG_PAGE.read_text())
    assert table == config_docs(), (
        "the config table in docs/configuration.md is not what `edgeproxy config-docs` prints; "
        f"regenerate it with `{REGENERATE}`"
    )


def test_every_config_key_has_a_description() -> None:
    for line in config_docs().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        assert cells[-1], f"{cells[0]} has no description"


def test_every_hook_is_documented() -> None:
    names = _hookspecs()
    assert names, "no edgeproxy_* hook specifications found in edgeproxy/hookspecs.py"
    page = HOOKS_PAGE.read_text()
    headings = page.splitlines()
    for name in names:
        assert any(line.startswith("#") and f"`{name}(" in line for line in headings), (
            f"{name} is not documented: add a `### `{name}(...)`` heading to docs/plugins.md "
            f"(## Hooks, in pipeline order), then run `{REGENERATE}`"
        )
        assert _hook_heading(name) in headings, (
            f"{name}'s heading in docs/plugins.md is not its signature; "
            f"regenerate it with `{REGENERATE}`"
        )
        # The whole docstring, down to how results combine.
        assert _hook_doc(name) in page, (
            f"{name}'s entry in docs/plugins.md differs from its docstring; "
            f"regenerate it with `{REGENERATE}`"
        )


def test_every_page_is_in_the_nav() -> None:
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = [page.relative_to(DOCS).as_posix() for page in _pages()]
    assert pages, "docs/ has no pages"
    for page in pages:
        assert page in nav, f"docs/{page} is not in the nav of mkdocs.yml"
    for entry in nav:
        assert (DOCS / entry).is_file(), f"mkdocs.yml's nav names docs/{entry}, which is missing"


GENERATED = ("bench/results/",)


def test_paths_named_in_docs_exist() -> None:
    """Repository paths the pages name, and the modules of the architecture's table."""
    path_re = re.compile(
        r"`((?:edgeproxy|bench|examples|plugins|tests|\.ci)/[\w./-]*|\.importlinter)`"
    )
    for page in _pages():
        for path in path_re.findall(page.read_text()):
            if path.startswith(GENERATED):
                continue  # written by the benches, git-ignored: absent in a fresh checkout
            assert (ROOT / path).exists(), f"docs/{page.name} names {path}, which is missing"
    for row in (DOCS / "architecture.md").read_text().splitlines():
        cells = row.split(" | ")
        folder = re.fullmatch(r"`(edgeproxy/[\w/]+/)`", cells[1]) if len(cells) > 2 else None
        if folder is None:
            continue
        for name in re.findall(r"`([\w/]+\.py|\w+/)`", cells[2]):
            assert (ROOT / folder.group(1) / name).exists(), (
                f"docs/architecture.md names {name} in {folder.group(1)}, which is missing"
            )


def test_readme_links_into_docs_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#[^)\s]*)?\)", readme)
    assert links, "the README links to no page of docs/"
    for link in links:
        assert (ROOT / link).is_file(), f"the README links to {link}, which is missing"


def test_readme_commands_are_the_ci_and_getting_started_ones() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2, "the README's quick start has the demo and the test command"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any("pytest" in command and command in ci for command in commands), (
        "the README's test command is not the one .ci/run runs"
    )
    getting_started = (DOCS / "getting-started.md").read_text().splitlines()
    for command in commands:
        assert command in getting_started, f"docs/getting-started.md lacks {command!r}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        reason = "mkdocs is not importable: install the dev extra (pip install -e '.[dev]')"
        print(reason)
        pytest.skip(reason)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


if __name__ == "__main__":
    write_config_table()
    write_hook_entries()
    print("rewrote the config table of docs/configuration.md and the hooks of docs/plugins.md")
