"""backout in process over a real store: the three-way cases, conflicts that change
nothing, undo by restore, the paths filter, creations, deletions, modes, symlinks, renames."""
from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from overlayckpt.core.backout import _write, merge_lines, work_out
from overlayckpt.core.conversation import live_lines
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import UserError
from overlayckpt.service.session import Session

from .helpers_core import ME, content, exists, ino, node, put, tree_of
from .test_checkpoints_core import KernelHooks, hooks  # noqa: F401  (the fixture)

TEN = "".join(f"line {i}\n" for i in range(10)).encode()


def set_file(s: Session, path: str, data: bytes) -> None:
    """step's form of helpers_core.put: path's content becomes data."""
    put(s.overlay, ME, path, data)


def edit_line(s: Session, path: str, n: int, text: str) -> None:
    lines = content(s.overlay, path).splitlines(keepends=True)
    lines[n] = text.encode() + b"\n"
    put(s.overlay, ME, path, b"".join(lines))


def remove(s: Session, path: str) -> None:
    ov = s.overlay
    parent, _, name = path.rpartition("/")
    is_dir = node(ov, path).is_dir
    ov.remove(ME, ino(ov, parent), os.fsencode(name), is_dir)


def symlink(s: Session, path: str, target: bytes) -> None:
    ov = s.overlay
    parent, _, name = path.rpartition("/")
    ov.create(ME, ino(ov, parent), os.fsencode(name), stat.S_IFLNK | 0o777, 0, 0, target=target)


def step(s: Session, *edits: Any) -> int:
    """Run the edits (each a function and its arguments) as one checkpoint; its id."""
    for fn, *args in edits:
        fn(s, *args)
    tl = Timeline(s.ctx)
    tl.seal()
    return tl.latest().id  # type: ignore[union-attr]  # sealed: a checkpoint exists


async def backout(s: Session, cid: int, *paths: str) -> dict[str, Any]:
    cmd: dict[str, Any] = {"cmd": "backout", "id": cid}
    if paths:
        cmd["paths"] = list(paths)
    return await s.command(cmd)


def journal(s: Session) -> int:
    return s.store.read(lambda r: r.count(b"journal"))


async def refused(s: Session, cid: Any, *paths: str) -> str:
    """backout refuses: its message, and the tree and the journal are as they were."""
    tree, records = tree_of(s.overlay), journal(s)
    with pytest.raises(UserError) as e:
        await backout(s, cid, *paths)
    assert tree_of(s.overlay) == tree and journal(s) == records
    return str(e.value)


@pytest.fixture
def ten(session: Session) -> Session:
    """A session whose repo has notes.txt of ten numbered lines (added by a checkpoint)."""
    step(session, (set_file, "notes.txt", TEN))
    return session


# -- the line merge --------------------------------------------------------------------

def lines(text: str) -> list[bytes]:
    return [x.encode() + b"\n" for x in text.split()]


@pytest.mark.parametrize("base,ours,theirs,merged", [
    ("a b c d e", "a b c d E", "a B c d e", "a B c d E"),  # apart: both kept
    ("a b c d e", "a b c d e", "a B c d e", "a B c d e"),
    ("a b c d e", "a b c X d e", "b c d e", "b c X d e"),  # an insertion, a deletion
    ("a b c d e", "a B c d e", "a B c d e", "a B c d e"),  # the same change on both sides
])
def test_merge_lines_keeps_both_sides_apart(base: str, ours: str, theirs: str, merged: str) -> None:
    out, clashes = merge_lines(lines(base), lines(ours), lines(theirs))
    assert out == lines(merged) and clashes == []


@pytest.mark.parametrize("base,ours,theirs", [
    ("a b c d e", "a X c d e", "a Y c d e"),  # the same line
    ("a b c d e", "a X c d e", "a b Y d e"),  # lines next to each other (git's rule)
    ("a b c d e", "a b X c d e", "a b Y c d e"),  # two insertions at one place
])
def test_merge_lines_clashes_where_both_sides_meet(base: str, ours: str, theirs: str) -> None:
    out, clashes = merge_lines(lines(base), lines(ours), lines(theirs))
    assert out == lines(ours) and len(clashes) == 1
    assert clashes[0].ours != clashes[0].theirs


def test_merge_lines_is_linear_on_a_long_file() -> None:
    # difflib's matcher alone is quadratic here (patch.py): this would take minutes
    base = [b"same\n"] * 30000 + [f"{i}\n".encode() for i in range(30000)]
    ours, theirs = base.copy(), base.copy()
    ours[100], theirs[50000] = b"ours\n", b"theirs\n"
    out, clashes = merge_lines(base, ours, theirs)
    assert not clashes and out[100] == b"ours\n" and out[50000] == b"theirs\n"
    assert len(out) == len(base)


# -- the three-way cases ---------------------------------------------------------------------

async def test_backout_of_a_middle_checkpoint_keeps_later_edits_to_other_lines(
        ten: Session, hooks: KernelHooks) -> None:  # noqa: F811
    s = ten
    middle = step(s, (edit_line, "notes.txt", 2, "middle"))
    step(s, (edit_line, "notes.txt", 7, "later"))
    s.conversation_append(b'{"role": "user", "content": "said after the last checkpoint"}')
    before, said = tree_of(s.overlay), s.store.read(live_lines)
    result = await backout(s, middle)
    want = TEN.replace(b"line 7", b"later")
    assert content(s.overlay, "notes.txt") == want
    assert result["backed_out"] == middle and result["files"] == [{"path": "notes.txt", "change": "M"}]
    # a checkpoint of its own, in the log, with the file it changed
    entry = (await s.command({"cmd": "log"}))["checkpoints"][0]
    assert (entry["id"], entry["kind"], entry["summary"]) == (
        result["id"], "backout", f"backed out checkpoint {middle}")
    assert entry["files"] == [{"path": "notes.txt", "change": "M"}]
    # the kernel forgets the file's cached pages and attributes
    assert ino(s.overlay, "notes.txt") in hooks.inodes and hooks.flushes == 1
    # undone by restoring the checkpoint before it: the code and the conversation
    await s.command({"cmd": "restore", "id": result["id"] - 1})
    assert tree_of(s.overlay) == before and s.store.read(live_lines) == said


async def test_a_file_still_as_the_checkpoint_left_it_gets_its_old_content(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 0, "zero"), (edit_line, "notes.txt", 9, "nine"))
    step(s, (set_file, "README.md", b"unrelated\n"))
    await backout(s, cid)
    assert content(s.overlay, "notes.txt") == TEN
    assert content(s.overlay, "README.md") == b"unrelated\n"


async def test_a_backout_already_undone_changes_nothing(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 4, "four"))
    step(s, (set_file, "notes.txt", TEN))  # put back by hand
    records = journal(s)
    assert (await backout(s, cid))["id"] is None
    assert journal(s) == records and content(s.overlay, "notes.txt") == TEN


async def test_backing_out_the_backout_brings_the_change_back(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 4, "four"))
    changed = content(s.overlay, "notes.txt")
    first = await backout(s, cid)
    await backout(s, first["id"])
    assert content(s.overlay, "notes.txt") == changed


# -- conflicts --------------------------------------------------------------------------

@pytest.mark.parametrize("later", [2, 3])  # the same line, the line after it
async def test_a_later_edit_of_the_same_lines_is_a_conflict_with_both_sides(
        ten: Session, later: int) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 2, "middle"))
    step(s, (edit_line, "notes.txt", later, "later"))
    message = await refused(s, cid)
    assert "notes.txt: line" in message and "nothing was changed" in message
    assert "<<<<<<< now" in message and "later" in message
    assert f"||||||| checkpoint {cid}\nmiddle" in message
    assert "=======\nline 2\n" in message and f">>>>>>> before checkpoint {cid}" in message


async def test_one_conflict_changes_no_other_file_either(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 2, "middle"), (set_file, "README.md", b"by the checkpoint\n"))
    step(s, (edit_line, "notes.txt", 2, "later"))
    message = await refused(s, cid)  # README.md alone could be backed out: it is not
    assert "README.md" not in message


async def test_a_binary_file_changed_on_both_sides_is_a_conflict(session: Session) -> None:
    s = session
    data = content(s.overlay, "bin.dat")
    cid = step(s, (set_file, "bin.dat", data[:100] + b"X" + data[101:]))
    step(s, (set_file, "bin.dat", data[:100] + b"X" + data[101:-1] + b"Y"))
    assert "bin.dat: a binary file" in await refused(s, cid)


async def test_a_binary_file_changed_only_by_the_checkpoint_is_put_back(session: Session) -> None:
    s = session
    data = content(s.overlay, "bin.dat")
    cid = step(s, (set_file, "bin.dat", data[:100] + b"X" + data[101:]))
    await backout(s, cid)
    assert content(s.overlay, "bin.dat") == data


async def test_a_created_file_changed_since_is_a_conflict(session: Session) -> None:
    s = session
    cid = step(s, (set_file, "new.txt", b"one\n"))
    step(s, (set_file, "new.txt", b"one\ntwo\n"))
    message = await refused(s, cid)
    assert "new.txt: checkpoint" in message and "from absent to a file of 4 bytes" in message


async def test_a_deleted_file_made_again_differently_is_a_conflict(session: Session) -> None:
    s = session
    cid = step(s, (remove, "src/main.py"))
    step(s, (set_file, "src/main.py", b"different\n"))
    assert "src/main.py: checkpoint" in await refused(s, cid)


# -- bad input -----------------------------------------------------------------------

async def test_bad_input_gets_one_line_and_changes_nothing(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 2, "middle"))
    for ref, paths, says in [(999, (), "unknown checkpoint 999"), ("nosuch", (), "unknown checkpoint"),
                             (0, (), "checkpoint 0 is the session's start"),
                             (cid, ("README.md",), f"checkpoint {cid} did not change README.md")]:
        message = await refused(s, ref, *paths)
        assert says in message and "\n" not in message
    undone = step(s, (set_file, "README.md", b"for a while\n"), (set_file, "README.md", b"# demo\n\nhello\n"))
    assert "changed no files" in await refused(s, undone)
    with pytest.raises(UserError):
        await s.command({"cmd": "backout"})


async def test_a_named_checkpoint_stands_for_the_changes_just_before_it(ten: Session) -> None:
    s = ten
    step(s, (edit_line, "notes.txt", 2, "middle"))
    named = Timeline(s.ctx).checkpoint("middle", None, ME).id  # (no records of its own)
    step(s, (edit_line, "notes.txt", 7, "later"))
    assert (await backout(s, named))["backed_out"] == named
    assert content(s.overlay, "notes.txt") == TEN.replace(b"line 7", b"later")


async def test_what_is_written_while_it_is_worked_out_is_merged_too(ten: Session) -> None:
    """The transaction works the backout out again when the journal moved since its
    snapshot: here a later edit makes it a conflict, and nothing is written."""
    s = ten
    cid = step(s, (edit_line, "notes.txt", 2, "middle"))
    tl = Timeline(s.ctx)
    plan = s.store.read(lambda r: work_out(tl, r, cid, None, False))
    edit_line(s, "notes.txt", 2, "meanwhile")
    tree, records = tree_of(s.overlay), journal(s)
    with pytest.raises(UserError, match="meanwhile"):
        s.store.write(lambda w: _write(tl, w, plan, ME, None, False, []))
    assert tree_of(s.overlay) == tree and journal(s) == records


# -- the paths filter ------------------------------------------------------------------

async def test_paths_limit_the_backout_to_those_files(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 2, "middle"), (set_file, "src/pkg/util.py", b"changed\n"),
               (set_file, "src/main.py", b"also\n"))
    result = await backout(s, cid, "src/pkg")
    assert result["files"] == [{"path": "src/pkg/util.py", "change": "M"}]
    assert content(s.overlay, "src/pkg/util.py") == b"def answer():\n    return 42\n"
    assert content(s.overlay, "src/main.py") == b"also\n"
    assert b"middle" in content(s.overlay, "notes.txt")


async def test_paths_skip_a_conflict_elsewhere(ten: Session) -> None:
    s = ten
    cid = step(s, (edit_line, "notes.txt", 2, "middle"), (set_file, "README.md", b"by it\n"))
    step(s, (edit_line, "notes.txt", 2, "later"))
    await backout(s, cid, "README.md")
    assert content(s.overlay, "README.md") == b"# demo\n\nhello\n"


# -- creations, deletions, renames, modes, symlinks -------------------------------------

async def test_created_files_and_their_directories_go(session: Session) -> None:
    s = session
    before = tree_of(s.overlay)
    cid = step(s, (set_file, "made/deep/new.txt", b"new\n"), (set_file, "src/extra.py", b"x = 1\n"))
    step(s, (set_file, "made/kept.txt", b"later\n"))  # made/ has a later file: it stays
    await backout(s, cid)
    after = tree_of(s.overlay)
    assert not exists(s.overlay, "made/deep") and not exists(s.overlay, "src/extra.py")
    assert after.pop("made/kept.txt")[2] == b"later\n" and after.pop("made")[0] == "d"
    assert after == before


async def test_deleted_files_and_directories_come_back(session: Session) -> None:
    s = session
    before = tree_of(s.overlay)
    cid = step(s, (remove, "src/pkg/util.py"), (remove, "src/pkg/__init__.py"), (remove, "src/pkg"),
               (remove, "run.sh"))
    await backout(s, cid)
    assert tree_of(s.overlay) == before  # run.sh executable again, src/pkg a directory again


async def test_a_rename_is_undone_as_a_delete_and_a_create(session: Session) -> None:
    s = session
    before = tree_of(s.overlay)
    ov = s.overlay
    pkg = ino(ov, "src/pkg")
    cid = step(s, (lambda s: ov.rename(ME, pkg, b"util.py", pkg, b"helpers.py", 0),))
    step(s, (edit_line, "src/main.py", 1, "print(1)"))
    await backout(s, cid)
    after = tree_of(ov)
    assert after.pop("src/main.py")[2] == b"import pkg.util\nprint(1)\n"
    before.pop("src/main.py")
    assert after == before


async def test_a_mode_change_is_undone_and_later_content_kept(session: Session) -> None:
    s = session
    ov = s.overlay
    cid = step(s, (lambda s: ov.setattr(ME, ino(ov, "run.sh"), mode=0o600),))
    step(s, (set_file, "run.sh", b"#!/bin/sh\necho later\n"))
    await backout(s, cid)
    assert stat.S_IMODE(node(ov, "run.sh").mode) == 0o755
    assert content(ov, "run.sh") == b"#!/bin/sh\necho later\n"


async def test_a_mode_changed_on_both_sides_is_a_conflict(session: Session) -> None:
    s = session
    ov = s.overlay
    cid = step(s, (lambda s: ov.setattr(ME, ino(ov, "run.sh"), mode=0o600),))
    step(s, (lambda s: ov.setattr(ME, ino(ov, "run.sh"), mode=0o700),))
    assert "changed its mode from 755 to 600, and it is 700 now" in await refused(s, cid)


async def test_symlinks_are_put_back(session: Session) -> None:
    s = session
    before = tree_of(s.overlay)
    cid = step(s, (remove, "link"), (symlink, "link", b"src/main.py"),  # another target
               (remove, "README.md"), (symlink, "README.md", b"docs/guide.txt"))  # a file made a link
    await backout(s, cid)
    assert tree_of(s.overlay) == before


async def test_a_symlink_changed_since_is_a_conflict(session: Session) -> None:
    s = session
    cid = step(s, (remove, "link"), (symlink, "link", b"src/main.py"))
    step(s, (remove, "link"), (symlink, "link", b"run.sh"))
    assert "a symlink to 'run.sh' now" in await refused(s, cid)


async def test_a_large_backout_lists_every_file_over_its_records(session: Session) -> None:
    s = session
    cid = step(s, *[(set_file, f"many/f{i:03}.txt", b"x\n") for i in range(300)])
    result = await backout(s, cid)
    assert len(result["files"]) == 300 and not exists(s.overlay, "many")
    ck = s.store.read(lambda r: Timeline(s.ctx).get(r, result["id"]))
    assert ck.seq - ck.start_seq > 1  # records of a few KB each (journal.RECORD_BYTES)
    entry = (await s.command({"cmd": "log", "limit": 1}))["checkpoints"][0]
    assert entry["files_total"] == 301  # (and fsck at teardown checks the group's rows)


async def test_git_internals_only_with_all_or_a_path(session: Session) -> None:
    s = session
    cid = step(s, (set_file, ".git/HEAD", b"ref: refs/heads/other\n"))
    assert "changed only git's internals" in await refused(s, cid)
    await s.command({"cmd": "backout", "id": cid, "all": True})
    assert not exists(s.overlay, ".git")
