"""Identifiers, key encodings and record layouts shared by every layer.

This is the bottom of the package: it imports nothing from overlayckpt. Every
on-disk key and value is built and parsed here, so the schema is described in
one place (see docs/design.md for the meaning of each table).
"""
from __future__ import annotations

import datetime
import hashlib
import stat
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from overlayckpt.names import NAME_MAX as NAME_MAX  # (re-exported: names.py stays free of msgpack)
from overlayckpt.tables import BMAP, DIRENTS, NODES, XATTRS

DEFAULT_BLOCK_SIZE = 4096
# the block sizes a store may have (a power of two): a bundle's, a store's, --block-size
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 512, 1 << 20
MAX_FILE_SIZE = 1 << 40  # bytes: a larger size in a record is damage (or an attack), not data
PATH_MAX = 4096  # bytes in a path (Linux), a symlink target included

ROOT_INO = 1
# Inodes of lower entries are the lower's own st_ino: stable across remounts
# without a store write per lookup, and equal to what git's index recorded
# before the mount, so the first `git status` need not re-hash every file.
# Number 1 is FUSE's root: a lower entry numbered 1 gets LOWER_INO_ONE.
# Inodes of entries created in the overlay come from a persistent counter far above.
FIRST_UPPER_INO = 1 << 48
LOWER_INO_ONE = FIRST_UPPER_INO - 1
# Virtual inodes of the control directory: never stored, never journaled.
CONTROL_INO_BASE = 1 << 62


CONTROL_NAME = b".overlayckpt"
WHITEOUT = b"\0" * 8  # dirent value that hides a lower entry
ZERO_BLOCK = b""  # bmap value for a block known to be all zeros

# Tables whose values the journal's undo entries describe.
T_NODES, T_DIRENTS, T_BMAP, T_XATTRS = 1, 2, 3, 4
TABLE_NAMES = {T_NODES: NODES, T_DIRENTS: DIRENTS, T_BMAP: BMAP, T_XATTRS: XATTRS}

# Node flags.
F_OPAQUE = 1  # directory: do not merge the lower directory's entries
F_XATTRS_OWN = 2  # xattrs live entirely in the xattrs table (lower ones copied up)

_U64 = struct.Struct(">Q")


def iso_time(ns: int) -> str:
    """A nanosecond timestamp as ISO 8601 UTC, as log, conversation and export show it."""
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat(
        timespec="milliseconds")


def pack_obj(obj: object) -> bytes:
    # paths are str decoded with surrogateescape (names need not be UTF-8)
    return msgpack.packb(obj, unicode_errors="surrogateescape")


def unpack_obj(raw: bytes) -> Any:
    return msgpack.unpackb(raw, unicode_errors="surrogateescape")


KEY_MAX = 511  # bytes in an LMDB key
_CUT_DIGEST = 16


def path_key(prefix: bytes, path: bytes) -> bytes:
    """prefix + path as a key; for a path too long for one (PATH_MAX is 4,096), prefix, the
    path's beginning, a NUL (never in a path) and a digest: such a row keeps the path whole."""
    if len(prefix) + len(path) <= KEY_MAX:
        return prefix + path
    digest = hashlib.blake2b(path, digest_size=_CUT_DIGEST).digest()
    return prefix + path[:KEY_MAX - len(prefix) - 1 - _CUT_DIGEST] + b"\0" + digest


def path_cut(key: bytes, prefix_len: int) -> bool:
    """Whether path_key cut the path of key (whose prefix has prefix_len bytes)."""
    return b"\0" in key[prefix_len:]


def u64(n: int) -> bytes:
    return _U64.pack(n)


# the NODES key of the first overlay inode: keys begin with the inode, big-endian, so a
# byte compare tells the overlay's keys from the repo's
FIRST_UPPER_KEY = u64(FIRST_UPPER_INO)


def from_u64(b: bytes) -> int:
    return _U64.unpack(b)[0]


def dirent_key(parent: int, name: bytes) -> bytes:
    return _U64.pack(parent) + name


def bmap_key(ino: int, blockno: int) -> bytes:
    return _U64.pack(ino) + _U64.pack(blockno)


def xattr_key(ino: int, name: bytes) -> bytes:
    return _U64.pack(ino) + name


def lower_ino(st_ino: int) -> int:
    return st_ino if st_ino != ROOT_INO else LOWER_INO_ONE


@dataclass(slots=True)
class Node:
    """Attributes of one inode as the overlay shows it.

    `origin` is the path of the lower entry this inode came from (None for an
    entry created in the overlay); `lower_valid` is how many leading bytes of
    that lower file still show through where the block map has no entry.
    """

    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    nlink: int
    rdev: int = 0
    origin: bytes | None = None
    lower_valid: int = 0
    flags: int = 0
    target: bytes | None = None  # symlink target
    parent: int = 0  # a directory that holds it (hint for pruning diff walks; 0: unknown)

    def pack(self) -> bytes:
        # by hand: dataclasses.astuple deep-copies and is slow on the write path
        return pack_obj((self.mode, self.uid, self.gid, self.size, self.atime_ns, self.mtime_ns,
                              self.ctime_ns, self.nlink, self.rdev, self.origin, self.lower_valid,
                              self.flags, self.target, self.parent))

    @classmethod
    def unpack(cls, raw: bytes) -> Node:
        return cls(*unpack_obj(raw))

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_link(self) -> bool:
        return stat.S_ISLNK(self.mode)


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One mutating operation: who, when, what, and the values it replaced.

    `undo` lists (table, key, previous value or None for absent) in the order
    the operation changed them; applying them in reverse restores the state
    before the operation.
    """

    seq: int
    time_ns: int
    pid: int
    comm: str
    op: str
    paths: tuple[str, ...]
    changes: tuple[str, ...]  # one of A M D R per path
    undo: tuple[tuple[int, bytes, bytes | None], ...]

    def pack(self) -> bytes:
        return pack_obj(
            [self.time_ns, self.pid, self.comm, self.op, list(self.paths), list(self.changes),
             [list(u) for u in self.undo]]
        )

    @classmethod
    def unpack(cls, seq: int, raw: bytes) -> JournalRecord:
        t, pid, comm, op, paths, changes, undo = unpack_obj(raw)
        return cls(seq, t, pid, comm, op, tuple(paths), tuple(changes),
                   tuple((u[0], u[1], u[2]) for u in undo))

    @classmethod
    def unpack_head(cls, seq: int, raw: bytes) -> JournalRecord:
        """Everything but the undo entries (left empty): what the log shows, without
        building the tens of thousands of entries a restore's record may hold."""
        unpacker = msgpack.Unpacker(unicode_errors="surrogateescape")
        unpacker.feed(raw)
        unpacker.read_array_header()
        t, pid, comm, op, paths, changes = (unpacker.unpack() for _ in range(6))
        return cls(seq, t, pid, comm, op, tuple(paths), tuple(changes), ())

    @staticmethod
    def with_files(raw: bytes, paths: tuple[str, ...], changes: tuple[str, ...]) -> bytes:
        """A packed record with these paths and changes instead of its own, its undo
        entries copied as they are (a restore's file list, written after it)."""
        unpacker = msgpack.Unpacker(unicode_errors="surrogateescape")
        unpacker.feed(raw)
        unpacker.read_array_header()
        for _ in range(4):
            unpacker.skip()
        head = unpacker.tell()
        unpacker.skip()
        unpacker.skip()
        return raw[:head] + pack_obj(list(paths)) + pack_obj(list(changes)) + raw[unpacker.tell():]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A named point of the timeline: the state after all journal records < seq."""

    id: int
    seq: int
    start_seq: int  # first journal record of the changes this checkpoint closes
    time_ns: int
    kind: str  # auto, named, restore
    name: str | None
    message: str | None
    pid: int
    comm: str
    restored_from: int | None = None
    conv_head: int = 0  # the last conversation line of the live branch at this checkpoint
    # at least the inode counter then: an overlay inode numbered from it on did not exist
    # (numbers are never given twice); 0: unknown (older formats before their upgrade, an
    # import that numbered inodes anew)
    next_ino: int = 0

    def pack(self) -> bytes:
        return pack_obj([self.seq, self.start_seq, self.time_ns, self.kind, self.name,
                         self.message, self.pid, self.comm, self.restored_from, self.conv_head,
                         self.next_ino])

    @classmethod
    def unpack(cls, cid: int, raw: bytes) -> Checkpoint:
        return cls(cid, *unpack_obj(raw))


def block_size_problem(n: object) -> str | None:
    """Why n cannot be a store's block size, or None when it can."""
    if not isinstance(n, int) or isinstance(n, bool) or not MIN_BLOCK_SIZE <= n <= MAX_BLOCK_SIZE \
            or n & (n - 1):
        return (f"block size {n!r} is not a power of two from {MIN_BLOCK_SIZE} to "
                f"{MAX_BLOCK_SIZE}")
    return None
