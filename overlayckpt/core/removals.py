"""The removal log: unlinks and rmdirs answered before Python stored them
(Overlay.remove_later).

A removal is checked, answered and then committed with the next write transaction
(Store.defer), so that a burst of them (`rm -rf`, a package manager's clean-up)
shares its commits, as writes do. Before it is answered, its record goes to this
file: the page cache outlives a killed daemon, and the next Session.open stores
the removals it answered and never stored (SPEC 3.1), as writebehind.py does for
writes. Removals and writes commute (a write goes by inode, a removal by name,
and anything that makes or reads a name commits the removals first), so the two
logs are replayed one after the other.

A record: u32 length, then msgpack [number, parent, name, pid, comm, time_ns,
the parent's path, is_rmdir] (a replay looks the path up first, so that the
journal names the file as the daemon would have).
Numbers only grow; meta "removals" holds the last one stored (committed with
it). Once everything in the file is stored and it holds more than TRIM_BYTES,
it is emptied.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct

import msgpack

from overlayckpt.core.journal import Caller
from overlayckpt.core.overlay import Overlay
from overlayckpt.errors import FsError
from overlayckpt.records import from_u64, u64
from overlayckpt.store.lmdbstore import Store
from overlayckpt.tables import META, REMOVALS_KEY

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


class RemovalLog:
    """The daemon's end of the log: it appends, and empties what is all stored."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.fd = os.open(os.path.join(store.path, LOG_NAME),
                          os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size
        self.last = stored(store)  # the number of the last record appended

    def append(self, parent: int, name: bytes, is_rmdir: bool, caller: Caller, t: int,
               where: str) -> bytes:
        """Log one removal before it is answered; the meta value that marks it stored."""
        if self.size > TRIM_BYTES and not self.store.deferred():
            # every removal logged so far is stored (or failed when stored): none is needed
            os.ftruncate(self.fd, 0)
            self.size = 0
        self.last += 1
        body = msgpack.packb([self.last, parent, name, caller.pid, caller.comm, t,
                              os.fsencode(where), is_rmdir])
        self.size += os.write(self.fd, _LEN.pack(len(body)) + body)
        return u64(self.last)

    def close(self) -> None:
        os.close(self.fd)


Record = tuple[int, int, bytes, int, str, int, str, bool]


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
            number, parent, name, pid, comm, t, where, is_rmdir = msgpack.unpackb(body)
        except (ValueError, TypeError, msgpack.UnpackException):
            break
        if not (all(isinstance(v, int) for v in (number, parent, pid, t)) and isinstance(name, bytes)
                and isinstance(comm, str) and isinstance(where, bytes) and isinstance(is_rmdir, bool)):
            break  # not a record of ours: nothing after it is trusted either
        if number > after:
            out.append((number, parent, name, pid, comm, t, os.fsdecode(where), is_rmdir))
    return out


def recover(overlay: Overlay, store_dir: str) -> int:
    """Store the removals a killed daemon answered and never stored; how many."""
    path = os.path.join(store_dir, LOG_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    records = _records(data, stored(overlay.store))
    for number, parent, name, pid, comm, t, where, is_rmdir in records:
        done = u64(number)
        _look_up(overlay, where)
        try:
            overlay.remove(Caller(pid, comm or "recovered"), parent, name, is_rmdir, logged=done, t=t)
        except FsError as e:
            log.warning("an answered removal of %r in inode %d could not be stored again: %s",
                        name, parent, os.strerror(e.errno))
            _mark(overlay.store, done)
    if records:
        log.warning("stored %d removals that a stopped daemon had answered", len(records))
    return len(records)


def _look_up(overlay: Overlay, where: str) -> None:
    """Look the parent's path up, so that the overlay knows the paths the journal names
    (the inode alone would serve the unlink)."""
    with contextlib.suppress(FsError):
        overlay.live(lambda r: overlay.resolve(r, where))


def _mark(store: Store, done: bytes) -> None:
    """Move past a record whose removal failed for good (a replay would fail the same way)."""
    store.write(lambda w: w.put(META, REMOVALS_KEY, done))


def discard(store_dir: str) -> None:
    """Empty the log after a power cut: the store went back to a sync point, and a
    removal no fsync reached may be lost as on any file system."""
    path = os.path.join(store_dir, LOG_NAME)
    if os.path.exists(path):
        os.truncate(path, 0)

