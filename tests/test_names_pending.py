"""Which names made in a directory C takes into its published listing (fuse/csrc/names.c,
fastpath_listing_change), driven through the library with no mount: a request's arrival
(as the reader thread sees it), Python's commit stamps and its add, in the orders a race
between a create and anything else that changes the directory would give. A listing
whose names are no longer whole must never take a name: it would answer as absent a name
that something else made in the directory meanwhile.
"""
from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator

import pyfuse3
import pytest

from overlayckpt.fuse import fastpath
from overlayckpt.records import CONTROL_INO_BASE
from test_fastpath_constants import load_library

FUSE_CREATE, FUSE_UNLINK, FUSE_RMDIR, FUSE_RENAME, FUSE_LINK = 35, 10, 11, 12, 13
IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, padding
CREATE_IN = struct.Struct("<IIII")  # flags, mode, umask, open_flags
ATTRS = pyfuse3.EntryAttributes


@pytest.fixture
def lib() -> Iterator[ctypes.CDLL]:
    lib = load_library()
    lib.fastpath_configure(ctypes.c_uint64(CONTROL_INO_BASE))
    lib.fastpath_names_clock.restype = ctypes.c_uint64
    lib.fastpath_listing_change.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t,
                                            ctypes.c_char_p, ctypes.c_size_t]
    lib.fastpath_publish_listing.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
                                             ctypes.c_size_t]
    lib.fastpath_names_touch.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.fastpath_names_arriving.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    yield lib


def entry(ino: int, mode: int) -> ATTRS:
    a = ATTRS()
    a.st_ino, a.st_mode, a.entry_timeout, a.attr_timeout = ino, mode, 3600.0, 3600.0
    return a


def publish(lib: ctypes.CDLL, d: int, names: list[bytes]) -> None:
    listing = [(b".", entry(d, 0o40755)), (b"..", entry(1, 0o40755))]
    listing += [(n, entry(d * 1000 + i, 0o100644)) for i, n in enumerate(sorted(names))]
    buf = b"".join(struct.pack("<I", len(n)) + n + fastpath._entry_out(a) for n, a in listing)
    assert lib.fastpath_publish_listing(lib.fastpath_names_clock(), d, buf, len(buf)) > 0


def arrive(lib: ctypes.CDLL, opcode: int, d: int, arg: bytes) -> None:
    mem = IN_HEADER.pack(IN_HEADER.size + len(arg), opcode, 7, d, 0, 0, 1, 0) + arg
    lib.fastpath_names_arriving(mem, len(mem))


def create(lib: ctypes.CDLL, d: int, name: bytes) -> None:
    arrive(lib, FUSE_CREATE, d, CREATE_IN.pack(0, 0o100644, 0, 0) + name + b"\0")


def commit(lib: ctypes.CDLL, *inodes: int) -> None:
    """Python's commit: every inode whose records it wrote (Store.on_commit)."""
    arr = (ctypes.c_uint64 * len(inodes))(*inodes)
    lib.fastpath_names_touch(arr, len(inodes))


def add(lib: ctypes.CDLL, d: int, name: bytes) -> bool:
    return bool(lib.fastpath_listing_change(d, name, len(name), None, 0))


def test_a_burst_is_taken_name_after_name(lib: ctypes.CDLL) -> None:
    publish(lib, 501, [b"a", b"b"])
    for i in range(40):
        name = b"new%d" % i
        create(lib, 501, name)
        commit(lib, 501, 90000 + i)  # (the directory and the new inode)
        assert add(lib, 501, name), i


def test_nothing_is_taken_once_another_change_came_between(lib: ctypes.CDLL) -> None:
    """A restore (or anything Python commits) touching the directory between a create's
    arrival and its commit: the add is refused, and so is every later one."""
    publish(lib, 502, [b"a"])
    create(lib, 502, b"x")
    commit(lib, 502)  # (a restore's commit, say: it added names to 502)
    commit(lib, 502, 91000)
    assert not add(lib, 502, b"x")
    create(lib, 502, b"y")
    commit(lib, 502, 91001)
    assert not add(lib, 502, b"y")


@pytest.mark.parametrize("opcode, arg", [
    (FUSE_UNLINK, b"a\0"),
    (FUSE_RENAME, struct.pack("<Q", 600) + b"a\0b\0"),  # (into another directory)
])
def test_a_removal_or_move_out_ends_it(lib: ctypes.CDLL, opcode: int, arg: bytes) -> None:
    publish(lib, 503, [b"a"])
    arrive(lib, opcode, 503, arg)
    commit(lib, 503)
    create(lib, 503, b"z")
    commit(lib, 503, 92000)
    assert not add(lib, 503, b"z")


def test_a_rename_into_it_is_taken(lib: ctypes.CDLL) -> None:
    """An editor's save: a temporary name made, then renamed over the file; and a name
    moved in from another directory."""
    publish(lib, 506, [b"a", b"f"])
    create(lib, 506, b".f.tmp")
    commit(lib, 506, 95000)
    assert add(lib, 506, b".f.tmp")
    arrive(lib, FUSE_RENAME, 506, struct.pack("<Q", 506) + b".f.tmp\0f\0")
    commit(lib, 506, 95000, 506001)  # (the directory, the file moved, the one replaced)
    assert add(lib, 506, b"f")
    publish(lib, 507, [b"x"])
    arrive(lib, FUSE_RENAME, 507, struct.pack("<Q", 506) + b"x\0y\0")
    commit(lib, 506, 507, 95001)
    assert add(lib, 506, b"y")
    create(lib, 507, b"z")  # (507 lost a name C's listing of it still has)
    commit(lib, 507, 95002)
    assert not add(lib, 507, b"z")


def rename(lib: ctypes.CDLL, d: int, old: bytes, new: bytes, moved: int) -> bool:
    """A rename within d: its arrival, Python's commit, and what Python then tells C."""
    arrive(lib, FUSE_RENAME, d, struct.pack("<Q", d) + old + b"\0" + new + b"\0")
    commit(lib, d, moved)
    return bool(lib.fastpath_listing_change(d, new, len(new), old, len(old)))


def test_saves_under_names_never_used_again_keep_the_listing_whole(lib: ctypes.CDLL) -> None:
    """An editor's saves, each under a temporary name of its own: the name renamed away
    leaves the names made since the listing, and the listing stays whole throughout."""
    publish(lib, 508, [b"f"])
    for i in range(2000):
        tmp = b".f.%d.tmp" % i
        create(lib, 508, tmp)
        commit(lib, 508, 96000 + i)
        assert add(lib, 508, tmp), i
        assert rename(lib, 508, tmp, b"f", 96000 + i), i


def test_a_flat_directory_takes_65536_names(lib: ctypes.CDLL) -> None:
    """A burst of files made in one directory (an unpacked dataset, a build's objects):
    each name is taken, up to ADDED_MOST (65,536), and none after it."""
    publish(lib, 509, [b"a"])
    inodes = (n for n in range(97000, 200000) if _slot(n) != _slot(509))  # (a shared slot: stale)
    taken = 0
    for i in range(66000):
        name = b"f%06d" % (i * 7919 % 66000)  # (not in order: each goes between others)
        create(lib, 509, name)
        commit(lib, 509, next(inodes))
        taken += add(lib, 509, name)
    assert taken == 1 << 16


def _slot(ino: int) -> int:
    """ino's stamp slot in names.c (TOUCH_BITS 16): inodes sharing one drop each other's answers."""
    return (ino * 0x9E3779B97F4A7C15 % (1 << 64)) >> 48


def test_a_rename_away_of_a_published_name_keeps_the_listing_whole(lib: ctypes.CDLL) -> None:
    """A name the listing was published with stays in it (its entry names an inode the
    rename stamped: its lookup goes to Python), and the names made next are taken."""
    publish(lib, 510, [b"a", b"b"])
    assert rename(lib, 510, b"a", b"c", 510000)
    create(lib, 510, b"d")
    commit(lib, 510, 98000)
    assert add(lib, 510, b"d")


def removed(lib: ctypes.CDLL, d: int, name: bytes) -> bool:
    return bool(lib.fastpath_listing_change(d, None, 0, name, len(name)))


def test_removals_keep_the_listing_whole(lib: ctypes.CDLL) -> None:
    """A build's outputs removed and made again: each unlink and rmdir Python reports
    keeps the listing whole, and the next names made are taken; one it never reports
    (a removal that failed) leaves it stale."""
    publish(lib, 511, [b"a.o", b"b.o", b"sub"])
    create(lib, 511, b"c.o")
    commit(lib, 511, 99000)
    assert add(lib, 511, b"c.o")
    for opcode, name, ino in ((FUSE_UNLINK, b"a.o", 511000), (FUSE_UNLINK, b"c.o", 99000),
                              (FUSE_RMDIR, b"sub", 511002)):
        arrive(lib, opcode, 511, name + b"\0")
        commit(lib, 511, ino)
        assert removed(lib, 511, name), name
    create(lib, 511, b"d.o")
    commit(lib, 511, 99001)
    assert add(lib, 511, b"d.o")
    arrive(lib, FUSE_UNLINK, 511, b"b.o\0")
    commit(lib, 511, 511001)
    create(lib, 511, b"e.o")
    commit(lib, 511, 99002)
    assert not add(lib, 511, b"e.o")


def test_a_name_made_without_its_arrival_is_refused(lib: ctypes.CDLL) -> None:
    publish(lib, 504, [b"a"])
    commit(lib, 504, 93000)
    assert not add(lib, 504, b"m")
    assert not add(lib, 999999, b"m")  # (no listing)


def test_everything_changed_refuses(lib: ctypes.CDLL) -> None:
    publish(lib, 505, [b"a"])
    create(lib, 505, b"n")
    lib.fastpath_names_changed()
    commit(lib, 505, 94000)
    assert not add(lib, 505, b"n")
