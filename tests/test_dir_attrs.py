"""Directory attributes answered in C (fuse/csrc/dirattrs.c) are Python's answers.

After a change in a directory the kernel asks for its attributes again; C answers
from what the changing request published. Each test compares what the kernel got
that way with what Python answers once the published attributes are gone (any other
change drops them; statx(AT_STATX_FORCE_SYNC) sends a GETATTR whatever the kernel
holds), and checks that C did answer.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from conftest import Mount

AT_FDCWD = -100
AT_STATX_FORCE_SYNC = 0x2000
AT_SYMLINK_NOFOLLOW = 0x100
STATX_BASIC_STATS = 0x7FF
_libc = ctypes.CDLL(None, use_errno=True)


def synced(path: Path) -> tuple[int, ...]:
    """The attributes the daemon answers now (statx forcing a GETATTR), as attrs() gives them
    (of a symlink itself, as lstat)."""
    buf = ctypes.create_string_buffer(256)
    flags = AT_STATX_FORCE_SYNC | AT_SYMLINK_NOFOLLOW
    if _libc.statx(AT_FDCWD, os.fsencode(path), flags, STATX_BASIC_STATS, buf) != 0:
        raise OSError(ctypes.get_errno(), f"statx {path}")
    raw = buf.raw
    u32 = lambda off: int.from_bytes(raw[off:off + 4], "little")  # noqa: E731
    u64 = lambda off: int.from_bytes(raw[off:off + 8], "little")  # noqa: E731
    ns = lambda off: int.from_bytes(raw[off:off + 8], "little", signed=True) * 10**9 + u32(off + 8)  # noqa: E731
    mode = int.from_bytes(raw[28:30], "little")
    return (u64(32), mode, u32(16), u32(20), u32(24), u64(40), u64(48), ns(64), ns(112), ns(96))


def attrs(path: Path) -> tuple[int, ...]:
    """What a plain stat gets: from the kernel's cache, or C's answer, or Python's."""
    s = os.stat(path, follow_symlinks=False)
    return (s.st_ino, s.st_mode, s.st_nlink, s.st_uid, s.st_gid, s.st_size, s.st_blocks,
            s.st_atime_ns, s.st_mtime_ns, s.st_ctime_ns)


def from_c(m: Mount) -> int:
    return m.ctl_ok({"cmd": "status"})["dir_attrs_from_c"]


def python_answer(m: Mount, d: Path) -> tuple[int, ...]:
    """d's attributes from Python: a control command drops what C holds first."""
    from_c(m)
    return synced(d)


def test_each_change_in_a_directory_is_answered_as_python_answers(mounted: Mount) -> None:
    m = mounted
    d, other = m.mnt / "work", m.mnt / "other"
    os.mkdir(d)
    os.mkdir(other)

    def make_file() -> None:
        with open(d / "a.txt", "w") as f:  # (open() asks an ioctl, the write a WRITE)
            f.write("a")

    changes = [
        ("create", make_file, [d]),
        ("mkdir", lambda: os.mkdir(d / "sub"), [d]),
        ("symlink", lambda: os.symlink("a.txt", d / "ln"), [d]),
        ("link", lambda: os.link(d / "a.txt", d / "hard"), [d]),
        ("mkfifo", lambda: os.mkfifo(d / "fifo"), [d]),
        ("rename in", lambda: os.rename(d / "a.txt", d / "b.txt"), [d]),
        ("rename out", lambda: os.rename(d / "b.txt", other / "b.txt"), [d, other]),
        ("move a dir", lambda: os.rename(d / "sub", other / "sub"), [d, other]),
        ("mkdir over", lambda: os.mkdir(d / "empty"), [d]),
        ("dir over a dir", lambda: os.rename(other / "sub", d / "empty"), [d, other]),
        ("unlink", lambda: os.unlink(d / "hard"), [d]),
        ("rmdir", lambda: os.rmdir(d / "empty"), [d]),
        ("repo dir", lambda: (m.mnt / "src" / "new.py").write_text("x"), [m.mnt / "src"]),
        ("root", lambda: os.mkdir(m.mnt / "top"), [m.mnt]),
    ]
    everywhere = [m.mnt, m.mnt / "src", d, other]
    answered = from_c(m)
    for what, change, dirs in changes:
        change()
        seen = [attrs(p) for p in dirs]  # the kernel asks: C answers
        now = from_c(m)
        assert now >= answered + len(dirs), f"{what}: C answered {now - answered} of {len(dirs)}"
        assert seen == [python_answer(m, p) for p in dirs], what
        # and no other directory's attributes were left behind
        assert [attrs(p) for p in everywhere] == [python_answer(m, p) for p in everywhere], what
        answered = from_c(m)


def test_a_burst_of_removals_is_answered_as_python_answers_after_it(mounted: Mount) -> None:
    """Removals are answered before they are stored (core/answered.py), a burst of them
    committed together: each answer's directory attributes count the removals before
    it that are not stored yet (an rmdir takes a link of its parent)."""
    m = mounted
    d = m.mnt / "burst"
    os.mkdir(d)
    for i in range(12):
        os.mkdir(d / f"sub{i}")
        (d / f"f{i}").write_text("x")
    before = python_answer(m, d)
    for i in range(12):  # one after the other, faster than the 2 ms a removal may wait
        os.rmdir(d / f"sub{i}")
        os.unlink(d / f"f{i}")
    seen = attrs(d)  # C's answer, from the last removal's
    assert seen == python_answer(m, d)
    assert seen[2] == before[2] - 12 == 2  # the links of the twelve subdirectories gone


def test_creates_that_alternate_between_directories_are_answered_in_c(mounted: Mount) -> None:
    """A package install writes lib/ and dist/ by turns: each keeps its answer while a
    create in the other changes only that one."""
    m = mounted
    lib, dist = m.mnt / "pkg" / "lib", m.mnt / "pkg" / "dist"
    os.makedirs(lib)
    os.makedirs(dist)
    answered = from_c(m)
    for i in range(20):
        for d in (lib, dist):
            fd = os.open(d / f"m{i}.js", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, b"module.exports = 1;\n")
            os.close(fd)
    # each create but the first in a directory found the directory's answer in C
    assert from_c(m) - answered >= 2 * 19
    assert [attrs(d) for d in (lib, dist)] == [python_answer(m, d) for d in (lib, dist)]


def test_a_restore_leaves_no_answer_of_c_behind(mounted: Mount) -> None:
    m = mounted
    d = m.mnt / "docs"
    (d / "one.txt").write_text("1")
    before = python_answer(m, d)
    cid = m.ctl_ok({"cmd": "checkpoint", "message": "before"})["id"]
    answered = from_c(m)
    (d / "two.txt").write_text("2")
    (d / "three").mkdir()
    assert attrs(d) != before and from_c(m) > answered  # C holds the new ones
    m.cli("restore", str(cid))
    assert attrs(d) == before
    assert python_answer(m, d) == before


def test_creates_from_threads_leave_no_older_answer_behind(mounted: Mount) -> None:
    """Threads create in one directory while another stats it: the kernel keeps no
    answer older than the last change (C answers under the lock Python drops by)."""
    m = mounted
    d = m.mnt / "many"
    os.mkdir(d)
    stop = threading.Event()

    def create(k: int) -> None:
        for i in range(150):
            with open(d / f"{k}-{i}", "w") as f:
                f.write("x")
            if i % 10 == 0:
                os.mkdir(d / f"{k}-dir{i}")

    def look() -> None:
        while not stop.is_set():
            attrs(d)

    lookers = [threading.Thread(target=look) for _ in range(2)]
    creators = [threading.Thread(target=create, args=(k,)) for k in range(3)]
    for t in lookers + creators:
        t.start()
    for t in creators:
        t.join()
    stop.set()
    for t in lookers:
        t.join()
    assert from_c(m) > 0
    last = attrs(d)
    assert last == python_answer(m, d)
    assert last[2] == 2 + 3 * 15  # nlink: the subdirectories


def test_a_burst_of_mkdirs_and_creates_is_answered_as_python_answers_after_it(mounted: Mount) -> None:
    """Directories and files are made before they are stored (core/answered.py), files
    and directories in directories not stored yet too: each answer's directory
    attributes count the mkdirs before it that are not stored yet (each adds a link to
    its parent), and what the kernel got is what Python answers once they are stored."""
    m = mounted
    d = m.mnt / "made"
    os.mkdir(d)
    for i in range(12):  # one after the other, faster than the 2 ms a create may wait
        os.mkdir(d / f"sub{i}")
        (d / f"sub{i}" / "index.js").write_text("x")
        os.mkdir(d / f"sub{i}" / "lib")
    seen = [attrs(p) for p in [d] + [d / f"sub{i}" for i in range(12)]]
    assert seen == [python_answer(m, p) for p in [d] + [d / f"sub{i}" for i in range(12)]]
    assert seen[0][2] == 14 and all(s[2] == 3 for s in seen[1:])
    assert sorted(os.listdir(d / "sub7")) == ["index.js", "lib"]


def test_a_rename_drops_the_answers_of_what_it_changes_only(mounted: Mount) -> None:
    """A rename drops C's answers of its two directories as it is taken, and of a directory
    it moves or replaces as it is committed (the request names neither); the others stay:
    an editor's saves into one directory after another find each directory's answer."""
    m = mounted
    a, b, keep = m.mnt / "a", m.mnt / "b", m.mnt / "keep"
    for d in (a, b, keep, a / "sub", b / "empty"):
        os.mkdir(d)
    (a / "t.tmp").write_text("y")
    answered = from_c(m)  # (a control command drops them all)
    (keep / "f").write_text("x")  # (a change in a directory publishes its answer)
    os.rename(a / "t.tmp", b / "t")
    seen = synced(keep)  # (statx forcing a GETATTR)
    assert from_c(m) == answered + 1, "the answer of a directory the rename did not change went"
    assert seen == python_answer(m, keep)

    (a / "sub" / "g").write_text("z")
    os.rename(a / "sub", b / "sub")  # a directory moved
    assert synced(b / "sub") == python_answer(m, b / "sub")
    (b / "sub" / "h").write_text("z")
    (b / "empty" / "h").write_text("z")
    os.unlink(b / "empty" / "h")
    os.rename(b / "sub", b / "empty")  # a directory replaced by another
    assert synced(b / "empty") == python_answer(m, b / "empty")
    assert [synced(d) for d in (a, b)] == [python_answer(m, d) for d in (a, b)]
