"""The package's layers: imports point one way, no circles, third-party imports in their layer.

Every module of overlayckpt is read with ast; every import counts, wherever it
stands (module level, inside a function, under TYPE_CHECKING: that is where
circles hide), relative ones resolved to full module names. Each module gets
the rank of its folder (or, for a top-level module, its own); a module may
import only modules of its own rank or below. docs/design.md ("Layers") has
the table.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = "overlayckpt"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# rank of each subpackage or top-level module (the first name below overlayckpt)
RANKS = {
    "records": 0, "errors": 0, "tables": 0, "names": 0, "messages": 0,
    "store": 1,
    "core": 2,
    "agents": 3,
    "export": 4,
    "service": 5,
    "fuse": 6,
    "mount": 7,
    "cli": 8, "__main__": 8, "demo": 8,
}
# the package __init__ (empty) belongs to no layer: nothing may import it for its content
PACKAGE_RANK = 0
# third-party modules only these layers (name prefixes of our modules) may import
RESTRICTED = {
    "lmdb": ("overlayckpt.store",),
    "pyfuse3": ("overlayckpt.fuse", "overlayckpt.mount"),
    "prompt_toolkit": ("overlayckpt.cli.rewind",),
}

Graph = dict[str, set[str]]  # module -> the modules it imports (ours and third-party)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module `name` (the file at path) imports, at any depth of the file."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                # `from pkg import mod` imports the module pkg.mod when there is one
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in known else mod)
    return out


def package_graph() -> Graph:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: imports_of(path, name, set(files)) for name, path in files.items()}


def rank(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return PACKAGE_RANK
    return RANKS.get(parts[1])


def check(graph: Graph) -> list[str]:
    """What is wrong with a module graph: upward imports, modules without a rank,
    third-party imports outside their layer, a circle. Empty when all is well."""
    problems = []
    ours = {m for m in graph if m.split(".")[0] == PACKAGE}
    for mod in sorted(ours):
        mine = rank(mod)
        if mine is None:
            problems.append(f"{mod} has no rank: add its folder to RANKS")
            continue
        for dep in sorted(graph[mod]):
            top = dep.split(".")[0]
            if top == PACKAGE:
                theirs = rank(dep)
                if theirs is None:
                    problems.append(f"{mod} imports {dep}, which has no rank")
                elif theirs > mine:
                    problems.append(f"upward import: {mod} (rank {mine}) imports {dep} (rank {theirs})")
            elif top in RESTRICTED and not any(
                    mod == p or mod.startswith(p + ".") for p in RESTRICTED[top]):
                problems.append(f"{mod} imports {top}, allowed only in {', '.join(RESTRICTED[top])}")
    sorter = graphlib.TopologicalSorter({m: {d for d in graph[m] if d in ours and d != m}
                                         for m in ours})
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        # graphlib lists each node before the nodes that depend on it: reversed, each
        # module in the list imports the next
        problems.append("import circle: " + " -> ".join(reversed(e.args[1])))
    return problems


def with_packages(graph: Graph) -> Graph:
    """graph plus the import Python makes of each module's package (its __init__) before
    the module itself: `from overlayckpt.cli import client` runs cli/__init__.py first."""
    out = {m: set(deps) for m, deps in graph.items()}
    for mod in graph:
        parent = mod.rpartition(".")[0]
        if parent in graph and parent != PACKAGE:
            out[mod].add(parent)
    return out


def circle_within(graph: Graph, prefix: str) -> list[str]:
    """An import circle among the modules of one package (prefix and below), counting each
    module's import of its package's __init__; empty when there is none."""
    graph = with_packages(graph)
    inside = {m for m in graph if m == prefix or m.startswith(prefix + ".")}
    sorter = graphlib.TopologicalSorter({m: {d for d in graph[m] if d in inside and d != m}
                                         for m in inside})
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))
    return []


def test_the_package_is_layered() -> None:
    graph = package_graph()
    assert len(graph) > 40, "the walk found too few modules"
    problems = check(graph)
    assert not problems, "\n".join(problems)


def test_the_command_line_has_no_circle() -> None:
    """app.py imports the command modules; none of them imports app, not even through the
    package's __init__ (which every one of them runs first)."""
    circle = circle_within(package_graph(), "overlayckpt.cli")
    assert not circle, "import circle in cli/: " + " -> ".join(circle)


def test_a_circle_through_a_package_init_is_found() -> None:
    graph = {"overlayckpt.cli": {"overlayckpt.cli.app"}, "overlayckpt.cli.app": {"overlayckpt.cli.log"},
             "overlayckpt.cli.log": {"overlayckpt.cli.client"}, "overlayckpt.cli.client": set()}
    assert check(graph) == []  # (the plain graph has no circle)
    assert "overlayckpt.cli" in circle_within(graph, "overlayckpt.cli")


def test_function_level_and_type_checking_imports_count() -> None:
    """The circles of the flat package hid in exactly these: make sure they are read."""
    graph = package_graph()
    # session.py imports pins inside Session.open
    assert "overlayckpt.core.pins" in graph["overlayckpt.service.session"]
    # cli/app.py imports cli.timeline inside build_parser
    assert "overlayckpt.cli.timeline" in graph["overlayckpt.cli.app"]


def test_relative_imports_are_resolved(tmp_path: Path) -> None:
    pkg = tmp_path / "overlayckpt" / "core"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "from . import y\nfrom ..store import lmdbstore\nfrom .y import z\n"
        "def f():\n    from ..cli import app\n")
    known = {"overlayckpt.core.y", "overlayckpt.store.lmdbstore", "overlayckpt.cli.app"}
    assert imports_of(pkg / "x.py", "overlayckpt.core.x", known) == known


@pytest.mark.parametrize("graph, expect", [
    ({"overlayckpt.core.timeline": {"overlayckpt.service.session"},
      "overlayckpt.service.session": set()}, "upward import: overlayckpt.core.timeline"),
    ({"overlayckpt.core.a": {"overlayckpt.core.b"}, "overlayckpt.core.b": {"overlayckpt.core.c"},
      "overlayckpt.core.c": {"overlayckpt.core.a"}}, "import circle: "),
    ({"overlayckpt.core.tree": {"lmdb"}}, "overlayckpt.core.tree imports lmdb"),
    ({"overlayckpt.service.session": {"pyfuse3"}}, "imports pyfuse3"),
    ({"overlayckpt.cli.app": {"prompt_toolkit"}}, "imports prompt_toolkit"),
    ({"overlayckpt.newthing.x": set()}, "has no rank"),
])
def test_the_check_fails_on_a_bad_graph(graph: Graph, expect: str) -> None:
    problems = check(graph)
    assert any(expect in p for p in problems), problems


def test_the_check_passes_a_good_graph() -> None:
    assert check({"overlayckpt.cli.app": {"overlayckpt.core.timeline", "prompt_toolkit.x"} - {
        "prompt_toolkit.x"}, "overlayckpt.core.timeline": {"overlayckpt.store.lmdbstore", "trio"},
        "overlayckpt.store.lmdbstore": {"lmdb", "overlayckpt.records"},
        "overlayckpt.records": set()}) == []


MAX_MODULE_LINES = 650  # a module past this owns more than one thing: split it along what it owns


def test_no_module_is_longer_than_its_limit() -> None:
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"over {MAX_MODULE_LINES} lines: {long}"
