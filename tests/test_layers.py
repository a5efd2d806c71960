"""Imports point one way: the core knows nothing of FUSE or the CLI; only store.py touches LMDB."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "overlayckpt"
CORE = {"records", "errors", "store", "lower", "tree", "overlay", "journal", "timeline",
        "conversation", "apply", "maintenance", "patch", "session", "commands"}
UPPER = {"fuseops", "control", "views", "mount", "cli", "cli_timeline", "client", "demo", "rewind"}


def imports(module: str) -> set[str]:
    tree = ast.parse((PKG / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level and node.module:
                out.add("." + node.module.split(".")[0])
            elif node.level:
                out |= {"." + a.name for a in node.names}
            elif node.module:
                out.add(node.module.split(".")[0])
    return out


def test_core_does_not_import_fuse_or_cli() -> None:
    for module in CORE:
        found = imports(module)
        assert "pyfuse3" not in found, module
        assert not {"." + u for u in UPPER} & found, (module, found)


def test_only_the_store_imports_lmdb() -> None:
    for path in PKG.glob("*.py"):
        if path.stem != "store":
            assert "lmdb" not in imports(path.stem), path.name


def test_records_is_the_bottom() -> None:
    assert not {i for i in imports("records") if i.startswith(".")}
