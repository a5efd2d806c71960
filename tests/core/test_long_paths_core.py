"""Names and paths at Linux's limits: a name of 256 bytes is ENAMETOOLONG in a lookup as
in a create, and a path of up to 4,095 bytes (longer than an LMDB key) is created, listed
by log, thinned and checked like any other. In process, over a real store; the mount
compares the same with a native directory in tests/test_posix_diff.py."""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from overlayckpt.core.apply import apply_live
from overlayckpt.core.maintenance import fsck, thin
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import FsError
from overlayckpt.records import NAME_MAX, ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, content, ino, native_tree, put, tree_of


def deep(s: Session, length: int) -> str:
    """Directories of 200-byte names down to a path of about length bytes."""
    ov, parent = s.overlay, ROOT_INO
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) + 210 < length:
        name = b"d%03d" % len(parts) + b"x" * 196
        parent, _ = ov.create(ME, parent, name, stat.S_IFDIR | 0o755, 0, 0)
        parts.append(name.decode())
    return "/".join(parts)


def test_a_name_longer_than_name_max_is_enametoolong_in_a_lookup(session: Session) -> None:
    ov = session.overlay
    for name in (b"n" * (NAME_MAX + 1), b"README.md" + b"x" * NAME_MAX):
        with pytest.raises(FsError) as e:
            ov.live(lambda r: ov.lookup(r, ROOT_INO, name))
        assert e.value.errno == errno.ENAMETOOLONG
    assert ov.live(lambda r: ov.lookup(r, ROOT_INO, b"README.md")) == ino(ov, "README.md")


async def files_listed(s: Session) -> list[str]:
    """The paths of the newest log entry that lists files."""
    entries = (await s.command({"cmd": "log", "limit": 5}))["checkpoints"]
    return [f["path"] for f in next(e for e in entries if e["files"])["files"]]


async def test_paths_longer_than_a_store_key_are_created_listed_and_thinned(session: Session) -> None:
    s = session
    path = deep(s, 4000)
    assert len(path) > 3500
    names = [f"{path}/" + "f" * 200 + str(i) for i in range(3)]  # the same first 500 bytes
    for name in names:
        put(s.overlay, ME, name, b"x\n")
    gone = f"{path}/" + "g" * 200
    put(s.overlay, ME, gone, b"made and removed in one checkpoint\n")
    s.overlay.remove(ME, ino(s.overlay, path), gone.rsplit("/", 1)[1].encode(), is_rmdir=False)
    put(s.overlay, ME, "README.md", b"edited\n")
    listed = await files_listed(s)
    assert set(names + ["README.md"]) <= set(listed) and gone not in listed
    for name in names[:2]:
        s.overlay.remove(ME, ino(s.overlay, path), name.rsplit("/", 1)[1].encode(), is_rmdir=False)
    await files_listed(s)  # (log seals the group)
    assert fsck(s.store)["clean"]
    await thin(s.store, budget=1)  # merges the groups: their rows are rewritten
    assert fsck(s.store)["clean"]


def test_apply_pins_and_writes_a_repo_file_at_a_path_longer_than_a_store_key(
        open_session: Callable[..., Session], repo: Path) -> None:
    rel = "/".join(f"d{i:02d}" + "x" * 196 for i in range(15)) + "/deep.txt"
    os.makedirs(repo / os.path.dirname(rel))
    (repo / rel).write_bytes(b"original\n")
    s = open_session(repo)
    put(s.overlay, ME, rel, b"edited\n")
    put(s.overlay, ME, rel.rsplit("/", 1)[0] + "/new.txt", b"new\n")
    live = tree_of(s.overlay)
    assert apply_live(s.ctx)["pinned"] >= 1  # the original is kept in the store before it changes
    assert native_tree(repo) == live
    tl = Timeline(s.ctx)
    origin = tree_of(s.overlay, lambda r: tl.state(r, tl.get(r, 0)))
    assert origin[rel][2] == b"original\n" and content(s.overlay, rel) == b"edited\n"
    assert fsck(s.store)["clean"]
