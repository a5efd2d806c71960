"""The write-behind log: writes that the fast path library (fuse/csrc/behind.c)
acknowledged before Python stored them.

The reader thread copies each such write into this file (mapped shared, so it
outlives a killed daemon) before it answers the writer. Python stores the write
as usual and, in the same transaction, how far into the log it has got (meta
"write_behind": the last record's number and where the next one starts). The
next Session.open replays whatever a killed daemon acknowledged and never
stored, so an acknowledged write is never lost to kill -9 (SPEC 3.1).

Layout (the C struct record): header seq, ino, off (u64), size, pid (u32), then
the data padded to 8 bytes. A header whose size is WRAPPED, or a tail shorter
than a header, sends the reader to offset 0. Numbers only grow, so a record
left over from an earlier lap never has the number looked for.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import struct

from overlayckpt.core.journal import Caller
from overlayckpt.core.lower import join
from overlayckpt.core.overlay import Overlay
from overlayckpt.errors import FsError
from overlayckpt.records import FIRST_UPPER_INO
from overlayckpt.store.lmdbstore import Store
from overlayckpt.tables import META, WRITE_BEHIND_KEY

log = logging.getLogger(__name__)

LOG_NAME = "behind.log"  # (a store file: its name stays whatever this module is called)
# more than twice what may wait unstored (fastpath.MAX_BEHIND, and the store's
# MAX_DEFERRED_BYTES) plus the largest write C takes (a quarter of MAX_BEHIND)
LOG_SIZE = 32 << 20
HEADER = struct.Struct("=QQQII")
WRAPPED = 0xFFFFFFFF
_POSITION = struct.Struct(">QQ")


def position(store: Store) -> tuple[int, int]:
    """(number, offset) of the next record after the last one stored."""
    raw = store.read(lambda r: r.get(META, WRITE_BEHIND_KEY))
    if raw is None:
        return 1, 0
    seq, offset = _POSITION.unpack(raw)
    return seq + 1, offset


def pack_position(seq: int, next_offset: int) -> bytes:
    return _POSITION.pack(seq, next_offset)


def skip(store: Store, done: bytes) -> None:
    """Move past a record whose write failed for good (a replay would fail the same way)."""
    store.write(lambda w: w.put(META, WRITE_BEHIND_KEY, done))


def open_log(store_dir: str) -> int:
    """The log file, at its full size (for mapping it)."""
    fd = os.open(os.path.join(store_dir, LOG_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    if os.fstat(fd).st_size != LOG_SIZE:
        os.ftruncate(fd, LOG_SIZE)
    return fd


def discard(store_dir: str) -> None:
    """Empty the log after a power cut: its pages may mix laps and lost writes, and the
    store was rolled back to a sync point, which every acknowledged fsync reached."""
    path = os.path.join(store_dir, LOG_NAME)
    if not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, LOG_SIZE)
        os.fsync(fd)
    finally:
        os.close(fd)
    log.warning("discarded the write-behind log of a daemon whose page cache is gone")


def _records(ring: bytes | mmap.mmap, seq: int, offset: int) -> list[tuple[int, int, int, int, int, bytes]]:
    """The records from (seq, offset) on: (seq, next offset, ino, off, pid, data)."""
    out = []
    for _ in range(len(ring) // HEADER.size):
        if offset + HEADER.size > len(ring):
            offset = 0
        got, ino, off, size, pid = HEADER.unpack_from(ring, offset)
        if got != seq:
            break
        if size == WRAPPED:
            offset = 0
            continue
        start = offset + HEADER.size
        offset = start + (size + 7) // 8 * 8
        out.append((seq, offset, ino, off, pid, ring[start:start + size]))
        seq += 1
    return out


def recover(overlay: Overlay, store_dir: str) -> int:
    """Store the writes a killed daemon acknowledged and never stored; how many."""
    path = os.path.join(store_dir, LOG_NAME)
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size:
            return 0
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as ring:
            records = _records(ring, *position(overlay.store))
    learned = False
    for seq, next_offset, ino, off, pid, data in records:
        done = pack_position(seq, next_offset)
        for _attempt in range(2):
            try:
                overlay.write(Caller(pid, "recovered"), ino, off, data, logged=done)
                break
            except FsError as e:
                if e.errno == errno.ESTALE and ino < FIRST_UPPER_INO and not learned:
                    _learn_lower_paths(overlay)  # a lower file the lost daemon had looked up
                    learned = True
                    continue
                log.warning("an acknowledged write to inode %d could not be stored again: %s",
                            ino, os.strerror(e.errno))
                skip(overlay.store, done)
                break
    if records:
        log.warning("stored %d writes that a stopped daemon had acknowledged", len(records))
    return len(records)


def _learn_lower_paths(overlay: Overlay) -> None:
    """Number every lower entry, as lookups would have (only ever after a kill)."""
    dirs = [b""]
    while dirs:
        base = dirs.pop()
        for name, st in overlay.lower.listdir(base):
            path = join(base, name)
            overlay.ino_of_lower(st, path)
            if stat.S_ISDIR(st.st_mode):
                dirs.append(path)
