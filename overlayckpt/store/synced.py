"""The store's last synced snapshot, recorded outside LMDB so that a power cut cannot take it.

LMDB commits without syncing (a commit costs no fsync). Its two meta pages then
say nothing about what reached the disk: after a power cut, with the kernel's
writeback in any order, the newer meta page may name pages that were never
written back, or pages overwritten since. So at every sync point the store
(store.py) pins a read transaction on the newest snapshot (LMDB never reuses a
page that a reader can see), fdatasyncs data.mdb, and records that snapshot's
meta page here. The pin is dropped only once a newer record is durable. After
a power cut the recorded meta page is written back into data.mdb: it names
only pages that were on disk at its sync point and never reused after it.

Whether the page cache survived (a killed daemon: LMDB's newest snapshot is
intact) or not (a power cut or kernel crash: only the record can be trusted)
is told by the *incarnation*: the boot id, the device and inode number of
data.mdb, and the unique id of the mount it is reached through (statx
STATX_MNT_ID_UNIQUE, Linux 6.8+; else the reusable mount id). The page cache
of a file lives no longer than the mount of its file system, and a power cut
of that file system is always followed by a new mount: without the mount id, a
pass-through file system that keeps inode numbers across its remounts (LazyFS)
and gets the same anonymous device number back looked like a killed daemon, and
the newest meta page of an un-synced commit was trusted over torn pages.

File layout (`synced`): two slots of SLOT bytes, written alternately, so a torn
write damages at most the one being written. A slot is
  MAGIC, counter u64, txnid u64, clean u8, psize u32, ident length u16,
  meta length u16, ident, meta page prefix, blake3 of all that.
The slot with the highest counter whose digest matches is the record.
"""
from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from typing import Any

import blake3

FILE_NAME = "synced"
DATA_NAME = "data.mdb"
SLOT = 4096
MAGIC = b"ockSYNC1"
_HEAD = struct.Struct("<8sQQBIHH")
_DIGEST = 32

# LMDB 0.9 on 64-bit: a 16-byte page header, then MDB_meta; mm_txnid ends it
PAGE_HEADER = 16
META_BYTES = 256  # the page header and MDB_meta (152 bytes), with room to spare
_TXNID_AT = PAGE_HEADER + 128
_MAGIC_AT = PAGE_HEADER
LMDB_MAGIC = 0xBEEFC0DE


@dataclass(frozen=True, slots=True)
class Record:
    counter: int
    txnid: int
    clean: bool  # written by a clean close: nothing after txnid
    psize: int
    ident: str   # the incarnation that wrote it
    meta: bytes  # the first META_BYTES of the meta page of txnid


def incarnation(store_dir: str) -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    path = os.path.join(store_dir, DATA_NAME)
    try:
        st = os.stat(path)
    except OSError:
        return boot
    return f"{boot}:{st.st_dev}:{st.st_ino}:{mount_id(path)}"


_STATX_MNT_ID, _STATX_MNT_ID_UNIQUE = 0x1000, 0x4000
_STX_MNT_ID_AT = 0x90  # in struct statx (256 bytes)
_statx: Any = None  # libc's statx (ctypes), False where libc has none, None before the first use


def mount_id(path: str) -> str:
    """The id of the mount path is reached through: "u" + the unique one (never given
    twice in a boot), "m" + the reusable one on older kernels, "" if statx is missing."""
    global _statx
    import ctypes
    if _statx is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).statx
        except (OSError, AttributeError):
            _statx = False
        else:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                           ctypes.c_void_p]
            _statx = fn
    if not _statx:
        return ""
    buf = ctypes.create_string_buffer(256)
    at_fdcwd = -100
    if _statx(at_fdcwd, os.fsencode(path), 0, _STATX_MNT_ID_UNIQUE | _STATX_MNT_ID, buf) != 0:
        return ""
    mask = struct.unpack_from("<I", buf.raw, 0)[0]
    value = struct.unpack_from("<Q", buf.raw, _STX_MNT_ID_AT)[0]
    if mask & _STATX_MNT_ID_UNIQUE:
        return f"u{value}"
    return f"m{value}" if mask & _STATX_MNT_ID else ""


def pack(rec: Record) -> bytes:
    ident = rec.ident.encode()
    body = _HEAD.pack(MAGIC, rec.counter, rec.txnid, rec.clean, rec.psize, len(ident),
                      len(rec.meta)) + ident + rec.meta
    return body + blake3.blake3(body).digest()


def unpack(raw: bytes) -> Record | None:
    if len(raw) < _HEAD.size + _DIGEST:
        return None
    magic, counter, txnid, clean, psize, ilen, mlen = _HEAD.unpack_from(raw)
    end = _HEAD.size + ilen + mlen
    if magic != MAGIC or end + _DIGEST > len(raw):
        return None
    if blake3.blake3(raw[:end]).digest() != raw[end:end + _DIGEST]:
        return None
    ident = raw[_HEAD.size:_HEAD.size + ilen].decode(errors="replace")
    return Record(counter, txnid, bool(clean), psize, ident, raw[_HEAD.size + ilen:end])


def load(store_dir: str) -> Record | None:
    """The newest intact record, or None (a store from before records, or both slots lost)."""
    try:
        with open(os.path.join(store_dir, FILE_NAME), "rb") as f:
            raw = f.read(2 * SLOT)
    except OSError:
        return None
    found = [r for r in (unpack(raw[:SLOT]), unpack(raw[SLOT:2 * SLOT])) if r is not None]
    return max(found, key=lambda r: r.counter) if found else None


def open_file(store_dir: str) -> int:
    """The record file, created durably (its directory entry fsync'd) if new."""
    path = os.path.join(store_dir, FILE_NAME)
    new = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    if new:
        os.fsync(fd)
        fsync_dir(store_dir)
    return fd


def save(fd: int, rec: Record) -> None:
    """Write rec into the slot its counter picks, durably."""
    data = pack(rec)
    assert len(data) <= SLOT
    pwrite_all(fd, data, (rec.counter % 2) * SLOT)
    os.fdatasync(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def meta_txnid(meta: bytes) -> int | None:
    """The txnid a meta page prefix holds, or None if it is no LMDB meta page."""
    if len(meta) < _TXNID_AT + 8 or struct.unpack_from("<I", meta, _MAGIC_AT)[0] != LMDB_MAGIC:
        return None
    return struct.unpack_from("<Q", meta, _TXNID_AT)[0]


def read_meta(fd: int, slot: int, psize: int) -> bytes:
    return os.pread(fd, META_BYTES, slot * psize)


def newest_txnid(store_dir: str, psize: int) -> int | None:
    """The txnid LMDB would open at (the higher of its two meta pages), None if unreadable."""
    try:
        fd = os.open(os.path.join(store_dir, DATA_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        ids = [meta_txnid(read_meta(fd, slot, psize)) for slot in (0, 1)]
    finally:
        os.close(fd)
    if None in ids:
        return None
    return max(ids)  # type: ignore[type-var]  # no None left: checked above


def roll_back(store_dir: str, rec: Record) -> None:
    """Make data.mdb open at rec's snapshot: its meta page in its own slot, and in the
    other slot the same roots under the txnid before it (LMDB opens the higher one, and
    txn N always writes slot N & 1, which the verifier checks too)."""
    own = rec.txnid & 1
    fd = os.open(os.path.join(store_dir, DATA_NAME), os.O_RDWR | os.O_CLOEXEC)
    try:
        for slot, txnid in ((own, rec.txnid), (own ^ 1, max(rec.txnid - 1, 0))):
            page = bytearray(rec.meta)
            struct.pack_into("<Q", page, 0, slot)  # mp_pgno
            struct.pack_into("<Q", page, _TXNID_AT, txnid)
            pwrite_all(fd, bytes(page), slot * rec.psize)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """pwrite until every byte is written: a write may be short (a signal, a nearly full disk)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n == 0:  # no progress and no error: never loop forever
            raise OSError(errno.EIO, "short write made no progress")
        view, offset = view[n:], offset + n
