"""Namespace changes answered before they are stored: unlinks, rmdirs, and creates
of files and directories (Answered).

A burst of them (`rm -rf`, an install, an unpacked archive) would pay one commit
each. Instead each is checked against the live state (what was answered and is
not stored yet included), logged, answered, and committed with the next write
transaction (Store.defer), so that a burst shares its commits, as writes do.
Only writes and these are ever deferred: a write changes nothing the checks here
read, a removal its own name (`unlinking`), a create its own name (`creating`; a
directory made is empty but for the names being made in it, `made_dirs`);
anything else that makes or reads a name, or reads an inode they change, stores
them first. A create's inode number is the one its commit will take (the
counter's next, and the creates answered before it each take one), pinned in its
record.

Before it is answered, an operation's record goes to the log (the store file
removals.log, its name from when only removals were answered early): the page
cache outlives a killed daemon, and the next Session.open stores what it answered
and never stored (SPEC 3.1), as writebehind.py does for writes. These and writes
commute (a write goes by inode, and a create's record carries the inode number
its writes name), so the two logs are replayed one after the other, this first.

A record: u32 length, then msgpack [number, parent, name, pid, comm, time_ns,
the parent's path, is_rmdir] for a removal, or [..., the parent's path, inode,
mode, uid, gid] for a create of a file or directory (a replay looks the path up
first, so that the journal names the file as the daemon would have). Numbers only grow; meta
"removals" holds the last one stored (committed with it). Once everything in the
file is stored and it holds more than TRIM_BYTES, it is emptied.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat
import struct
from collections.abc import Callable
from typing import NamedTuple

import msgpack

from overlayckpt.core.journal import Caller, now_ns
from overlayckpt.core.overlay import Mutation, Overlay, create_op
from overlayckpt.errors import FsError
from overlayckpt.names import is_file_name
from overlayckpt.records import FIRST_UPPER_INO, Node, from_u64, u64
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import META, NEXT_INO_KEY, REMOVALS_KEY

log = logging.getLogger(__name__)

LOG_NAME = "removals.log"  # (a store file: its name stays whatever this module is called)
TRIM_BYTES = 1 << 20
_LEN = struct.Struct("<I")
# a record longer than this is damage, not a record (a name is at most 255 bytes, a
# path 4,095)
MOST_BYTES = 8192


def stored(store: Store) -> int:
    """The number of the last record stored (0: none)."""
    raw = store.read(lambda r: r.get(META, REMOVALS_KEY))
    return 0 if raw is None else from_u64(raw)


class Answered:
    """The daemon's end: it checks, logs and defers, and empties the log once all of it is stored."""

    def __init__(self, overlay: Overlay) -> None:
        self.ov = overlay
        self.store = overlay.store
        self.fd = os.open(os.path.join(self.store.path, LOG_NAME),
                          os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size
        self.last = stored(self.store)  # the number of the last record appended
        self.unlinking: dict[tuple[int, bytes], bool] = {}  # removals not stored: is_rmdir
        self.creating: dict[tuple[int, bytes], int] = {}  # creates not stored: inode
        self.made_dirs: dict[int, tuple[Node, str]] = {}  # of those, directories: node, path
        self._last_ino = 0  # the inode number the last create was answered with

    def _append(self, fields: list[object]) -> bytes:
        """Log one operation before it is answered; the meta value that marks it stored."""
        if self.size > TRIM_BYTES and not self.store.deferred():
            # every operation logged so far is stored (or failed when stored): none is needed
            os.ftruncate(self.fd, 0)
            self.size = 0
        self.last += 1
        body = msgpack.packb([self.last, *fields])
        self.size += os.write(self.fd, _LEN.pack(len(body)) + body)
        return u64(self.last)

    def remove(self, caller: Caller, parent: int, name: bytes, is_rmdir: bool,
               failed: Callable[[Exception], None]) -> tuple[int, Node]:
        """unlink or rmdir. Returns the inode and the parent's node as the removal leaves
        them, for the reply; failed(e): it failed when stored."""
        key = (parent, name)
        if self.creating:  # (a name made and not stored is in no state a check reads)
            self.store.store_deferred()

        def check(r: ReadTxn) -> tuple[int, Node]:
            pnode = self.ov.dir_node(r, parent)
            ino = self.ov.lookup(r, parent, name)
            if key in self.unlinking:
                raise FsError(errno.ENOENT)
            if self.ov.node(r, ino).is_dir != is_rmdir:
                raise FsError(errno.EISDIR if not is_rmdir else errno.ENOTDIR)
            if is_rmdir and any((ino, n) not in self.unlinking for n, _, _ in self.ov.entries(r, ino)):
                raise FsError(errno.ENOTEMPTY)
            return ino, pnode
        ino, pnode = self.store.peek(check)
        t = now_ns()
        logged = self._append([parent, name, caller.pid, caller.comm, t,
                               os.fsencode(self.ov.path_of(parent)), is_rmdir])
        self.unlinking[key] = is_rmdir
        self._defer(caller, "rmdir" if is_rmdir else "unlink", self.ov.removal(parent, name, is_rmdir, logged, t),
                    lambda: self.unlinking.pop(key, None), failed, ino, parent)
        return ino, self._parent_after(parent, pnode, t)

    def create(self, caller: Caller, parent: int, name: bytes, mode: int, uid: int, gid: int,
               failed: Callable[[Exception], None]) -> tuple[int, Node, Node]:
        """A regular file's or a directory's create. Returns its inode and node, and the
        parent's node as the create leaves it, for the reply; failed(e): it failed when
        stored. The parent may be a directory made and not stored yet."""
        is_dir = stat.S_ISDIR(mode)
        assert is_dir or stat.S_ISREG(mode)
        self.ov.check_name(parent, name)
        key = (parent, name)
        made_parent = self.made_dirs.get(parent)

        def check(r: ReadTxn) -> tuple[Node, int]:
            counter = r.meta_int(NEXT_INO_KEY, FIRST_UPPER_INO)
            if key in self.creating:
                raise FsError(errno.EEXIST)
            if made_parent is not None:  # (it has no names but those being made)
                return dataclasses.replace(made_parent[0]), counter
            pnode = self.ov.dir_node(r, parent)
            # (a name being removed is free: its removal is stored first)
            if key not in self.unlinking and self.ov.existing(r, parent, name) is not None:
                raise FsError(errno.EEXIST)
            return pnode, counter
        pnode, counter = self.store.peek(check)
        ino = max(counter, self._last_ino + 1)
        t = now_ns()
        made_mode, made_gid = self.ov.inherited(pnode, mode, gid)
        node = self.ov.new_node(made_mode, uid, made_gid, t)
        where = made_parent[1] if made_parent is not None else self.ov.path_of(parent)
        logged = self._append([parent, name, caller.pid, caller.comm, t, os.fsencode(where),
                               ino, made_mode, uid, made_gid])
        self._last_ino = ino
        self.creating[key] = ino
        if is_dir:
            self.made_dirs[ino] = (node, os.path.join(where, os.fsdecode(name)))

        def stored() -> None:
            self.creating.pop(key, None)
            self.made_dirs.pop(ino, None)
        self._defer(caller, create_op(mode), self.ov.made(parent, name, ino, node, logged), stored, failed,
                    ino, parent)
        return ino, node, self._parent_after(parent, pnode, t)

    def _defer(self, caller: Caller, op: str, change: Callable[[Mutation], object], stored: Callable[[], object],
               failed: Callable[[Exception], None], ino: int, parent: int) -> None:
        """Have change (of ino in parent, journaled as op) committed with the next write
        transaction, as announced (Store.defer); stored() as it is stored (or fails)."""
        def txn(m: Mutation) -> object:
            stored()
            return change(m)
        self.store.defer(self.ov.journaled(caller, op, txn), failed, (ino, parent), 0, announced=True)

    def making(self, parent: int, name: bytes) -> bool:
        """Whether parent/name may be a name answered and not stored yet: one being made,
        or any in a directory being made."""
        return (parent, name) in self.creating or parent in self.made_dirs

    def _parent_after(self, parent: int, pnode: Node, t: int) -> Node:
        """The parent's node as an operation answered at t leaves it, with the others
        answered and not stored (the rmdirs each take one of its links, the mkdirs add
        one)."""
        pnode.mtime_ns = pnode.ctime_ns = t
        pnode.nlink -= sum(d for (p, _), d in self.unlinking.items() if p == parent)
        pnode.nlink += sum(1 for (p, _), i in self.creating.items() if p == parent and i in self.made_dirs)
        return pnode

    def close(self) -> None:
        os.close(self.fd)


class Record(NamedTuple):
    number: int
    parent: int
    name: bytes
    caller: Caller
    t: int
    where: str  # the parent's path
    is_rmdir: bool  # (a removal's)
    made: tuple[int, int, int, int] | None  # a create's inode, mode, uid and gid; None: a removal


def _record(fields: object) -> Record | None:
    """fields as a record, if they are shaped like one (None: not a record of ours)."""
    if not isinstance(fields, list) or len(fields) not in (8, 11):
        return None
    number, parent, name, pid, comm, t, where, *rest = fields
    if not (all(_u64(v) for v in (number, parent, pid, t)) and isinstance(name, bytes)
            and isinstance(comm, str) and isinstance(where, bytes)):
        return None
    caller = Caller(pid, comm or "recovered")
    if len(rest) == 1:
        return Record(number, parent, name, caller, t, os.fsdecode(where), rest[0], None) \
            if isinstance(rest[0], bool) else None
    ino, mode, uid, gid = rest
    if all(_u64(v) for v in rest) and (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and is_file_name(name):
        return Record(number, parent, name, caller, t, os.fsdecode(where), False, (ino, mode, uid, gid))
    return None


def _u64(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64


def _records(data: bytes, after: int) -> list[Record]:
    """The whole records of data numbered above after, in order."""
    out = []
    pos = 0
    while pos + _LEN.size <= len(data):
        (size,) = _LEN.unpack_from(data, pos)
        body = data[pos + _LEN.size:pos + _LEN.size + size]
        if size > MOST_BYTES or len(body) < size:
            break  # a torn tail: what follows was never answered
        pos += _LEN.size + size
        try:
            rec = _record(msgpack.unpackb(body))
        except (ValueError, TypeError, msgpack.UnpackException):
            break
        if rec is None:
            break  # not a record of ours: nothing after it is trusted either
        if rec.number > after:
            out.append(rec)
    return out


def recover(overlay: Overlay, store_dir: str) -> int:
    """Store what a killed daemon answered and never stored; how many operations."""
    path = os.path.join(store_dir, LOG_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    records = _records(data, stored(overlay.store))
    for rec in records:
        done = u64(rec.number)
        _look_up(overlay, rec.where)
        try:
            if rec.made is None:
                overlay.remove(rec.caller, rec.parent, rec.name, rec.is_rmdir, logged=done, t=rec.t)
            else:
                ino, mode, uid, gid = rec.made
                overlay.make(rec.caller, rec.parent, rec.name, ino, overlay.new_node(mode, uid, gid, rec.t), done)
        except FsError as e:
            log.warning("an answered %s of %r in inode %d could not be stored again: %s",
                        "removal" if rec.made is None else "create", rec.name, rec.parent,
                        os.strerror(e.errno))
            _mark(overlay.store, done)
    if records:
        log.warning("stored %d creates and removals that a stopped daemon had answered", len(records))
    return len(records)


def _look_up(overlay: Overlay, where: str) -> None:
    """Look the parent's path up, so that the overlay knows the paths the journal names
    (the inode alone would serve the change)."""
    with contextlib.suppress(FsError):
        overlay.live(lambda r: overlay.resolve(r, where))


def _mark(store: Store, done: bytes) -> None:
    """Move past a record that failed for good (a replay would fail the same way)."""
    store.write(lambda w: w.put(META, REMOVALS_KEY, done))


def discard(store_dir: str) -> None:
    """Empty the log after a power cut: the store went back to a sync point, and a
    change no fsync reached may be lost as on any file system."""
    path = os.path.join(store_dir, LOG_NAME)
    if os.path.exists(path):
        os.truncate(path, 0)

