"""Helpers of the in-process tier: a small repo, and reading trees from an Overlay or a directory."""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import make_repo
from overlayckpt.core.journal import Caller
from overlayckpt.core.overlay import Overlay
from overlayckpt.errors import FsError
from overlayckpt.records import ROOT_INO

ME = Caller(4242, "agent")
OTHER = Caller(4343, "other")
BIG_WINDOW = 1e9  # seconds: a group only ends when another process writes or it is sealed


def make_small_repo(path: Path) -> Path:
    """The mount tests' repo, with numbered lines in the multi-block file (6 blocks)."""
    make_repo(path)
    (path / "docs" / "guide.txt").write_text("".join(f"line {i}\n" for i in range(3000)))
    return path


# -- helpers on the live tree ------------------------------------------------------

def ino(ov: Overlay, path: str) -> int:
    return ov.live(lambda r: ov.resolve(r, path))


def node(ov: Overlay, path: str) -> Any:
    return ov.live(lambda r: ov.node(r, ov.resolve(r, path)))


def content(ov: Overlay, path: str) -> bytes:
    return ov.live(lambda r: ov.read_all(r, ov.resolve(r, path)))


def put(ov: Overlay, who: Caller, path: str, data: bytes, append: bool = False) -> None:
    """path's content becomes data, or data is appended to it (the file and its
    directories made where missing)."""
    parent = ROOT_INO
    parts = path.split("/")
    for part in parts[:-1]:
        try:
            parent = ov.live(lambda r: ov.lookup(r, parent, part.encode()))
        except FsError:
            parent = ov.create(who, parent, part.encode(), stat.S_IFDIR | 0o755, 0, 0)[0]
    try:
        target = ino(ov, path)
    except FsError:
        target = ov.create(who, parent, parts[-1].encode(), stat.S_IFREG | 0o644, 0, 0)[0]
    else:
        if not append:
            ov.setattr(who, target, size=0)
    off = len(content(ov, path)) if append else 0
    ov.write(who, target, off, data)


def names(ov: Overlay, path: str = "") -> list[str]:
    return ov.live(lambda r: [os.fsdecode(n) for n, _, _ in ov.entries(r, ov.resolve(r, path))])


def exists(ov: Overlay, path: str) -> bool:
    try:
        ino(ov, path)
        return True
    except FsError:
        return False


def tree_of(ov: Overlay, state_fn: Callable[[Any], Any] | None = None) -> dict[str, tuple]:
    """path -> (kind, permissions, content or target) of a state (the live one by default)."""
    def fn(r: Any) -> dict[str, tuple]:
        s = state_fn(r) if state_fn else r
        out: dict[str, tuple] = {}
        for path, i, n in ov.walk(s):
            if n.is_dir:
                out[path] = ("d", stat.S_IMODE(n.mode))
            elif n.is_link:
                out[path] = ("l", ov.readlink(s, i, n))
            else:
                out[path] = ("f", stat.S_IMODE(n.mode), ov.read_all(s, i, n))
        return out
    return ov.live(fn)


def native_tree(root: Path) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.fsencode(os.readlink(p)))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("f", stat.S_IMODE(st.st_mode), Path(p).read_bytes())
    return dict(sorted(out.items()))
