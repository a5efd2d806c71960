"""The LMDB environment of one session: the only module that imports lmdb.

Concurrency rules: one writer. A write transaction belongs to the thread that
opened it and is opened and committed inside one synchronous call
(`Store.write`), so it can never span an `await`. Commits do not fsync (the
OS page cache keeps them across a daemon crash); `sync()` makes them durable
against power loss and is what the filesystem's fsync maps to.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import blake3
import lmdb
import zstandard

from .errors import FsError, StoreLocked, UserError
from .records import DEFAULT_BLOCK_SIZE, FORMAT_VERSION, ZERO_BLOCK, from_u64, u64

log = logging.getLogger(__name__)

T = TypeVar("T")

TABLES = (b"meta", b"blocks", b"nodes", b"dirents", b"bmap", b"xattrs", b"journal",
          b"ckpts", b"names", b"pinned", b"conv", b"seen")

# Block values start with one byte saying how the rest is encoded.
_RAW, _ZSTD = b"\0", b"\1"
_INITIAL_MAP = 1 << 36  # address space only; the file grows as pages are used


class ReadTxn:
    """A read view of every table, consistent for its lifetime."""

    def __init__(self, store: "Store", txn: "lmdb.Transaction") -> None:
        self.store = store
        self.txn = txn

    def get(self, table: bytes, key: bytes) -> bytes | None:
        return self.txn.get(key, db=self.store.dbs[table])

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cur = self.txn.cursor(db=self.store.dbs[table])
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                return
            yield k, v

    def range_from(self, table: bytes, start: bytes = b"", reverse: bool = False
                   ) -> Iterator[tuple[bytes, bytes]]:
        """Entries with key >= start ascending, or key <= start descending."""
        cur = self.txn.cursor(db=self.store.dbs[table])
        if reverse:
            if start:
                if cur.set_range(start):
                    if cur.key() != start and not cur.prev():
                        return
                elif not cur.last():
                    return
            elif not cur.last():
                return
            yield from cur.iterprev()
        else:
            if start:
                if not cur.set_range(start):
                    return
            elif not cur.first():
                return
            yield from cur.iternext()

    def block(self, digest: bytes) -> bytes:
        if digest == ZERO_BLOCK:
            return bytes(self.store.block_size)
        raw = self.txn.get(digest, db=self.store.dbs[b"blocks"])
        if raw is None:
            raise FsError(errno.EIO, f"block {digest.hex()} missing from store")
        return self.store.decode_block(raw)

    def meta_int(self, name: bytes, default: int = 0) -> int:
        raw = self.get(b"meta", name)
        return default if raw is None else from_u64(raw)

    def count(self, table: bytes) -> int:
        return self.txn.stat(self.store.dbs[table])["entries"]


class WriteTxn(ReadTxn):
    def put(self, table: bytes, key: bytes, value: bytes, append: bool = False) -> None:
        self.txn.put(key, value, db=self.store.dbs[table], append=append)

    def delete(self, table: bytes, key: bytes) -> None:
        self.txn.delete(key, db=self.store.dbs[table])

    def put_block(self, data: bytes) -> bytes:
        """Store one block once, keyed by its blake3 digest; zeros are not stored."""
        if data == bytes(len(data)):  # (a memcmp; strip(b"\0") walks it byte by byte)
            return ZERO_BLOCK
        digest = blake3.blake3(data).digest()
        db = self.store.dbs[b"blocks"]
        if self.txn.get(digest, db=db) is None:
            raw = self.store.encode_block(data)
            self.txn.put(digest, raw, db=db)
            self.set_meta_int(b"block_bytes", self.meta_int(b"block_bytes") + len(raw))
        return digest

    def set_meta_int(self, name: bytes, value: int) -> None:
        self.put(b"meta", name, u64(value))

    def next_counter(self, name: bytes, first: int) -> int:
        value = self.meta_int(name, first)
        self.set_meta_int(name, value + 1)
        return value


class Store:
    """One session's LMDB environment plus the lock that makes its daemon unique."""

    def __init__(self, path: str, env: "lmdb.Environment", lock_fd: int | None) -> None:
        self.path = path
        self.env = env
        self.lock_fd = lock_fd
        self.dbs = {name: env.open_db(name) for name in TABLES}
        self._zc = zstandard.ZstdCompressor(level=1)
        self._zd = zstandard.ZstdDecompressor()
        with env.begin(write=True) as txn:
            w = WriteTxn(self, txn)
            version = w.meta_int(b"format", 0)
            if version == 0:
                w.set_meta_int(b"format", FORMAT_VERSION)
            elif version > FORMAT_VERSION:
                raise UserError(f"store {path} has format {version}, newer than this "
                                f"overlayckpt understands ({FORMAT_VERSION}): upgrade overlayckpt")
        self.block_size = self.read(lambda r: r.meta_int(b"block_size", DEFAULT_BLOCK_SIZE))

    @classmethod
    def open(cls, path: str, *, create: bool = True, block_size: int | None = None,
             lock: bool = True) -> "Store":
        if not os.path.isdir(path):
            if not create:
                raise UserError(f"no session store at {path}: mount the repo first or check --store")
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as e:
                raise UserError(f"cannot create store {path}: {e.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"store {path} is not writable: fix its permissions or pick --store")
        lock_fd = None
        if lock:
            lock_fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                raise StoreLocked(
                    f"store {path} is in use by another overlayckpt daemon: unmount it first") from None
        try:
            env = lmdb.open(path, map_size=_INITIAL_MAP, max_dbs=len(TABLES) + 2,
                            sync=False, metasync=False, readahead=False, max_readers=256,
                            readonly=False)
        except lmdb.Error as e:
            if lock_fd is not None:
                os.close(lock_fd)
            raise UserError(f"cannot open store {path}: {e}") from None
        env.reader_check()
        store = cls(path, env, lock_fd)
        if block_size is not None:
            def init_bs(w: WriteTxn) -> None:
                if w.get(b"meta", b"block_size") is None:
                    w.set_meta_int(b"block_size", block_size)
            store.write(init_bs)
            store.block_size = store.read(lambda r: r.meta_int(b"block_size"))
        return store

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def read(self, fn: Callable[[ReadTxn], T]) -> T:
        with self.env.begin(buffers=False) as txn:
            return fn(ReadTxn(self, txn))

    def begin_read(self) -> ReadTxn:
        """A long-lived read view (caller must call .txn.abort())."""
        return ReadTxn(self, self.env.begin(buffers=False))

    def write(self, fn: Callable[[WriteTxn], T]) -> T:
        """Run fn in one write transaction; grow the map once if it is full.

        fn must have no effect outside the transaction, since it may run twice.
        """
        for attempt in range(2):
            try:
                with self.env.begin(write=True, buffers=False) as txn:
                    return fn(WriteTxn(self, txn))
            except lmdb.MapFullError:
                if attempt:
                    raise FsError(errno.ENOSPC, "store map full") from None
                self._grow()
            except lmdb.Error as e:
                # a full disk shows up as ENOSPC, or as EIO from a short write at commit
                if isinstance(e, lmdb.DiskError) or "No space left" in str(e) or self._disk_full():
                    raise FsError(errno.ENOSPC, "no space left for the store") from None
                raise
        raise AssertionError("unreachable")

    def _disk_full(self) -> bool:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 4 << 20

    def _grow(self) -> None:
        new = self.env.info()["map_size"] * 2
        log.info("growing store map to %d bytes", new)
        self.env.set_mapsize(new)

    def sync(self) -> None:
        self.env.sync(True)

    def encode_block(self, data: bytes) -> bytes:
        packed = self._zc.compress(data)
        if len(packed) < len(data) - len(data) // 8:
            return _ZSTD + packed
        return _RAW + data

    def decode_block(self, raw: bytes) -> bytes:
        if raw[:1] == _ZSTD:
            return self._zd.decompress(raw[1:])
        return raw[1:]

    def disk_bytes(self) -> int:
        try:
            return os.stat(os.path.join(self.path, "data.mdb")).st_blocks * 512
        except OSError:
            return 0
