"""Diff, git-format patches (checked with a real `git apply`), apply to the repo, thin and gc."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from overlayckpt.core.apply import apply_checkpoint, apply_live
from overlayckpt.core.maintenance import fsck, gc, referenced_blocks, thin
from overlayckpt.core.patch import render, stat_lines
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import UserError
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, content, ino, native_tree, tree_of

REG = stat.S_IFREG | 0o644


def files_only(tree: dict[str, tuple]) -> dict[str, tuple]:
    """What a patch can carry: files and symlinks (git knows no directories)."""
    return {p: v for p, v in tree.items() if v[0] != "d"}


def edit_everything(s: Session) -> None:
    """Text edits, a binary edit, an added file without a final newline, a deletion,
    a mode change, a new symlink, a rename and a file in a new directory."""
    ov = s.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"# DEMO")
    ov.write(ME, ino(ov, "docs/guide.txt"), 10000, b"inserted\n")
    ov.write(ME, ino(ov, "bin.dat"), 5, b"\xff\x00\xfe")
    i, _ = ov.create(ME, ROOT_INO, b"new.txt", REG, 0, 0)
    ov.write(ME, i, 0, b"no newline at the end")
    ov.remove(ME, ino(ov, "src/pkg"), b"__init__.py", False)
    ov.setattr(ME, ino(ov, "src/main.py"), mode=0o755)
    ov.create(ME, ROOT_INO, b"to-readme", stat.S_IFLNK | 0o777, 0, 0, target=b"README.md")
    ov.rename(ME, ino(ov, "src/pkg"), b"util.py", ino(ov, "src"), b"util.py", 0)
    d, _ = ov.create(ME, ROOT_INO, b"newdir", stat.S_IFDIR | 0o755, 0, 0)
    f, _ = ov.create(ME, d, b"inner.py", REG, 0, 0)
    ov.write(ME, f, 0, b"x = 1\n")


def git_apply(patch: str, tree: Path) -> None:
    subprocess.run(["git", "apply", "--check", "-"], input=patch.encode(), cwd=tree, check=True,
                   capture_output=True)
    subprocess.run(["git", "apply", "-"], input=patch.encode(), cwd=tree, check=True,
                   capture_output=True)


def test_diff_lists_each_change(session: Session) -> None:
    edit_everything(session)
    tl = Timeline(session.ctx)
    changes = session.store.read(lambda r: tl.changes(r, tl.get(r, 0), None))
    got = {c.path: c.change for c in changes}
    assert got == {"README.md": "M", "bin.dat": "M", "docs/guide.txt": "M", "new.txt": "A",
                   "newdir/inner.py": "A", "hardlink.md": "M", "src/main.py": "M", "src/pkg/__init__.py": "D",
                   "src/pkg/util.py": "D", "src/util.py": "A", "to-readme": "A"}
    stats = {p: (a, r) for p, _, a, r in stat_lines(changes)}
    assert stats["newdir/inner.py"] == (1, 0) and stats["src/pkg/util.py"] == (0, 2)
    assert stats["bin.dat"] == (None, None)  # binary: no line counts, as git's "-"


def test_patch_applies_with_git_apply_to_a_copy_of_the_repo(session: Session, repo: Path,
                                                            tmp_path: Path) -> None:
    edit_everything(session)
    tl = Timeline(session.ctx)
    patch = session.store.read(lambda r: render(tl.changes(r, tl.get(r, 0), None)))
    assert "GIT binary patch" in patch and "\\ No newline at end of file" in patch
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, symlinks=True)
    git_apply(patch, copy)
    assert files_only(native_tree(copy)) == files_only(tree_of(session.overlay))


async def test_diff_command_between_two_checkpoints(session: Session, repo: Path,
                                                    tmp_path: Path) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"# one")
    a = Timeline(session.ctx).checkpoint("a", None, ME)
    at_a = tree_of(ov)
    ov.write(ME, ino(ov, "README.md"), 0, b"# two")
    ov.remove(ME, ROOT_INO, b"run.sh", False)
    b = Timeline(session.ctx).checkpoint("b", None, ME)
    ov.write(ME, ino(ov, "README.md"), 0, b"# 333")  # after b: not in the diff
    reply = await session.command({"cmd": "diff", "a": "a", "b": "b"})
    assert (reply["a"], reply["b"]) == (a.id, b.id)
    # hardlink.md is another name of README.md's inode: it changed too
    assert [f["path"] for f in reply["files"]] == ["README.md", "hardlink.md", "run.sh"]
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, symlinks=True)
    (copy / "README.md").write_bytes(at_a["README.md"][2])  # copytree split the hard link
    (copy / "hardlink.md").write_bytes(at_a["hardlink.md"][2])
    git_apply(reply["patch"], copy)
    assert (copy / "README.md").read_bytes().startswith(b"# two")
    assert (copy / "hardlink.md").read_bytes() == (copy / "README.md").read_bytes()
    assert not (copy / "run.sh").exists()
    stat_only = await session.command({"cmd": "diff", "a": "a", "b": "b", "stat": True})
    assert "patch" not in stat_only


async def test_diff_of_a_restore_is_empty_against_its_target(session: Session) -> None:
    ov = session.overlay
    Timeline(session.ctx).checkpoint("t", None, ME)
    ov.write(ME, ino(ov, "README.md"), 0, b"zzz")
    await Timeline(session.ctx).restore("t", ME)
    reply = await session.command({"cmd": "diff", "a": "t"})
    assert reply["files"] == [] and reply["patch"] == ""


# -- apply ---------------------------------------------------------------------------

def test_apply_live_makes_the_repo_the_live_tree(session: Session, repo: Path) -> None:
    edit_everything(session)
    live = tree_of(session.overlay)
    stats = apply_live(session.ctx)
    assert stats["written"] > 0 and stats["removed"] > 0
    assert native_tree(repo) == live
    # history still sees the original repo (pins)
    tl = Timeline(session.ctx)
    origin = tree_of(session.overlay, lambda r: tl.state(r, tl.get(r, 0)))
    assert origin["src/pkg/util.py"][2] == b"def answer():\n    return 42\n"
    assert "new.txt" not in origin
    assert apply_live(session.ctx)["written"] == 0  # nothing left to write


def test_apply_refuses_to_overwrite_a_change_made_in_the_repo(session: Session, repo: Path) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"OURS")
    (repo / "README.md").write_bytes(b"theirs, made behind the session\n")
    with pytest.raises(UserError, match="README.md"):
        apply_live(session.ctx)
    assert (repo / "README.md").read_bytes() == b"theirs, made behind the session\n"
    apply_live(session.ctx, force=True)
    assert (repo / "README.md").read_bytes().startswith(b"OURS")


def test_apply_accepts_a_repo_change_that_equals_ours(session: Session, repo: Path) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "run.sh"), 0, b"#!/bin/bash")
    (repo / "run.sh").write_bytes(content(ov, "run.sh"))  # same bytes, new mtime
    apply_live(session.ctx)
    assert (repo / "run.sh").read_bytes().startswith(b"#!/bin/bash")


async def test_apply_a_checkpoint_through_the_command(session: Session, repo: Path) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"STEP")
    ck = Timeline(session.ctx).checkpoint("step", None, ME)
    at_step = tree_of(ov)
    ov.remove(ME, ROOT_INO, b"README.md", False)  # after the checkpoint: not applied
    reply = await session.command({"cmd": "apply", "checkpoint": ck.id})
    assert reply["repo"] == str(repo.resolve())
    assert native_tree(repo) == at_step


def test_apply_checkpoint_of_an_unknown_ref_is_refused(session: Session) -> None:
    with pytest.raises(UserError):
        apply_checkpoint(session.ctx, "no-such")


# -- thin and gc ------------------------------------------------------------------------

def many_versions(s: Session, n: int, first: int = 0) -> None:
    """n checkpoints, each with another 2-block version of the file big."""
    ov = s.overlay
    try:
        i = ino(ov, "big")
    except Exception:
        i, _ = ov.create(ME, ROOT_INO, b"big", REG, 0, 0)
    for v in range(first, first + n):
        ov.write(ME, i, 0, bytes([v]) * 8192)
        Timeline(s.ctx).seal()


def test_gc_keeps_every_block_history_needs(session: Session) -> None:
    many_versions(session, 5)
    assert gc(session.store)["removed_blocks"] == 0
    assert fsck(session.store)["clean"]


def test_gc_removes_an_unreferenced_block(session: Session) -> None:
    digest = session.store.write(lambda w: w.put_block(b"orphan" + bytes(4090)))
    assert digest not in session.store.read(referenced_blocks)
    assert gc(session.store)["removed_blocks"] == 1
    assert session.store.read(lambda r: r.get(b"blocks", digest)) is None


async def test_thin_drops_old_automatic_checkpoints_and_keeps_named_ones(session: Session) -> None:
    ov = session.overlay
    many_versions(session, 3)
    Timeline(session.ctx).checkpoint("keep", None, ME)
    kept = content(ov, "big")
    many_versions(session, 6, first=100)
    tl = Timeline(session.ctx)
    before = session.store.read(tl.all)
    blocks_before = session.store.read(lambda r: r.count(b"blocks"))
    assert await thin(session.store, 10**12) == {"thinned": 0}  # under budget: nothing
    result = await thin(session.store, 0)
    assert result["thinned"] > 0 and result["removed_blocks"] > 0
    after = session.store.read(tl.all)
    assert len(after) == len(before) - result["thinned"]
    assert {c.id for c in after} >= {0, before[-1].id, tl_id(session, "keep")}
    assert session.store.read(lambda r: r.count(b"blocks")) < blocks_before
    # every kept checkpoint still gives its exact tree
    at_keep = tree_of(ov, lambda r: tl.state(r, tl.get(r, "keep")))
    assert at_keep["big"][2] == kept
    assert "big" not in tree_of(ov, lambda r: tl.state(r, tl.get(r, 0)))
    assert fsck(session.store)["clean"]


def tl_id(s: Session, name: str) -> int:
    tl = Timeline(s.ctx)
    return s.store.read(lambda r: tl.get(r, name).id)


async def test_restore_after_thin_is_exact(session: Session) -> None:
    ov = session.overlay
    many_versions(session, 4)
    Timeline(session.ctx).checkpoint("mid", None, ME)
    at_mid = tree_of(ov)
    many_versions(session, 4, first=50)
    await thin(session.store, 0)
    await Timeline(session.ctx).restore("mid", ME)
    assert tree_of(ov) == at_mid


async def test_gc_and_fsck_commands(session: Session) -> None:
    many_versions(session, 2)
    reply = await session.command({"cmd": "gc", "budget": 0})
    assert "thinned" in reply
    reply = await session.command({"cmd": "fsck"})
    assert reply["clean"] and reply["problems"] == [] and reply["repaired"] == []
    with pytest.raises(UserError):
        await session.command({"cmd": "gc", "budget": -1})


def test_fsck_finds_a_corrupt_and_a_missing_block(session: Session) -> None:
    many_versions(session, 1, first=7)  # not zeros: zero blocks are never stored
    store = session.store
    digest, raw = store.read(lambda r: next(iter(r.range_from(b"blocks"))))
    store.write(lambda w: w.put(b"blocks", digest, store.encode_block(b"x" * 4096)))
    result = fsck(store)
    assert not result["clean"] and "does not match its digest" in result["problems"][0]
    store.write(lambda w: w.delete(b"blocks", digest))
    assert "referenced but missing" in fsck(store)["problems"][0]
    store.write(lambda w: w.put(b"blocks", digest, raw))  # put right: the teardown fsck passes
    assert fsck(store)["clean"]


@pytest.mark.parametrize("edit_first", [True, False])
def test_apply_rewrites_a_repo_file_that_got_a_second_name_elsewhere(
        session: Session, repo: Path, edit_first: bool) -> None:
    """A lower file linked into another directory and changed: its record's parent hint is
    the new name's directory, yet its own directory must be visited too."""
    ov = session.overlay
    util = ino(ov, "src/pkg/util.py")
    if edit_first:
        ov.write(ME, util, 0, b"changed")
    ov.link(ME, util, ino(ov, "docs"), b"util-link.py")
    if not edit_first:
        ov.write(ME, util, 0, b"changed")
    apply_live(session.ctx)
    assert native_tree(repo) == tree_of(ov)
    assert (repo / "src/pkg/util.py").read_bytes().startswith(b"changed")
    assert os.path.samefile(repo / "src/pkg/util.py", repo / "docs/util-link.py")
