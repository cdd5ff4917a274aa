"""No modules of edgeproxy import each other, not even for annotations only.

`lint-imports` holds the layer contracts of `.importlinter`; a cycle inside one layer is
beyond them, so this test looks for one in the whole import graph, imports under
``if TYPE_CHECKING:`` counted.
"""

from __future__ import annotations

from pathlib import Path

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            module, child = work.pop()
            if child == 0:
                index[module] = low[module] = len(index)
                stack.append(module)
                on_stack.add(module)
            if child < len(edges[module]):
                work.append((module, child + 1))
                target = edges[module][child]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
    return found


def test_cycles_are_found() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")]:
        graph.add_import(importer=importer, imported=imported)
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_type_only_imports_included() -> None:
    # No cache: a stale one could hide a cycle just written.
    graph = grimp.build_graph(
        "edgeproxy",
        include_external_packages=False,
        exclude_type_checking_imports=False,
        cache_dir=None,
    )
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other:\n" + "\n".join(
        " <-> ".join(component) for component in cycles
    )


def test_no_module_is_over_800_lines() -> None:
    """One concept a module: a module past 800 lines holds two (split it by concern)."""
    package = Path(__file__).resolve().parent.parent / "edgeproxy"
    long = {
        str(path.relative_to(package)): lines
        for path in package.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 800
    }
    assert not long, long
