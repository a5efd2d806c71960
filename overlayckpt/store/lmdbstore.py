"""The LMDB environment of one session: the only module that imports lmdb.

Concurrency rules: one writer. A write transaction belongs to the thread that
opened it and is opened and committed inside one synchronous call
(`Store.write`), so it can never span an `await`. Commits do not fsync (the
OS page cache keeps them across a daemon crash). A sync point makes them
durable against a power cut and is what the filesystem's fsync and a checkpoint
wait for (a restore starts one without waiting): `sync_begin` on the writer's thread pins the newest
snapshot, `sync_flush` (any thread, serialized) fdatasyncs and records it
(synced.py), `sync_end` on the writer's thread drops the older pins.
A writer that gets AHEAD_PAGES ahead of the sync point under way waits for it:
in write itself, or, in the daemon (writes_wait off), in the request that writes,
off the request loop (overlay.keep_up).

Opening a store that was not closed cleanly first decides which snapshot to
trust (synced.py), then verifies it with lmdb's offline verifier; a damaged
store is refused (StoreDamaged), never served.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar, overload

import blake3
import lmdb
import lmdb.verify
import zstandard

from overlayckpt.errors import FsError, StoreDamaged, StoreLocked, UserError
from overlayckpt.records import (
    DEFAULT_BLOCK_SIZE,
    FIRST_UPPER_INO,
    FORMAT_VERSION,
    ZERO_BLOCK,
    Checkpoint,
    block_size_problem,
    from_u64,
    u64,
    unpack_obj,
)
from overlayckpt.store import places, synced
from overlayckpt.tables import (
    BLOCK_BYTES_KEY,
    BLOCK_SIZE_KEY,
    BLOCKS,
    CKPTS,
    DERIVED_KEYS,
    DERIVED_TABLES,
    FORK_KEY,
    FORMAT_KEY,
    GROUPFILES_KEY,
    HISTORY_BORN,
    HISTORY_KEY,
    META,
    NEXT_INO_KEY,
    PARENT_KEY,
    TABLES,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# a deferred write (Store.defer): fn, failed, tag, since
Deferred = tuple[Callable[["WriteTxn"], object], Callable[[Exception], None], int, int]


# Block values start with one byte saying how the rest is encoded.
_RAW, _ZSTD, _SPLIT = b"\0", b"\1", b"\2"
# A value over half a page goes to a run of overflow pages, which holds n * psize - 16
# bytes: a raw 4 KiB block (4097 bytes) would take two pages. So a raw block's last
# bytes ride in its key instead (digest + tail -> _SPLIT + the rest, format 3): the
# value fills its pages exactly. ReadTxn and WriteTxn take and give the digest and
# _RAW + the whole block, so no caller and no decode_block ever sees a split one.
_PAGE_HEADER = 16
_DIGEST = 32
_INITIAL_MAP = 1 << 38  # address space only; the file grows as pages are used
# A pin keeps LMDB from reusing any page freed after it, so a burst of commits (a package
# install) would write every commit to fresh pages until the next sync point: one starts,
# off the writer's thread, after this many commits since the last.
AUTO_POINT_COMMITS = 100
# or once the file has grown by this many pages: no page a commit frees (each copies the
# pages it changes: about one leaf of BLOCKS per new block, its keys being random) is
# reused while the pin holds, so without this a big file or a long burst left as much
# garbage as it had data (a git gc: 2.4x the pack's size)
AUTO_POINT_PAGES = 512
# A writer that has grown the file by this many pages while a sync point is under way
# waits for it (rather than growing the store with pages it cannot reuse yet)
AHEAD_PAGES = 4 * AUTO_POINT_PAGES
MAX_DEFERRED = 64  # deferred writes committed together at most (see Store.defer)
# and their bytes: the write-behind log holds them until they are stored, beside the
# writes C has acknowledged and Python not yet taken (behind.py's LOG_SIZE)
MAX_DEFERRED_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class SyncPoint:
    txnid: int
    meta: bytes  # the meta page of txnid, as LMDB wrote it


class ReadTxn:
    """A read view of every table, consistent for its lifetime."""

    def __init__(self, store: Store, txn: lmdb.Transaction[bytes]) -> None:
        self.store = store
        self.txn = txn
        self._cursors: dict[bytes, lmdb.Cursor[bytes]] = {}  # seek's and seek_before's, one per table

    def get(self, table: bytes, key: bytes) -> bytes | None:
        if table == BLOCKS:
            found = self._block_entry(key)
            return None if found is None else _whole(*found)[1]
        return self.txn.get(key, db=self.store.dbs[table])

    def _block_entry(self, digest: bytes) -> tuple[bytes, bytes] | None:
        """The BLOCKS entry of digest as stored (its key may carry a split block's tail)."""
        cur = self._cursor(BLOCKS)
        if cur.set_range(digest) and cur.key()[:_DIGEST] == digest:
            return cur.item()
        return None

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        cur = self.txn.cursor(db=self.store.dbs[table])
        if not cur.set_range(prefix):
            return
        for k, v in _wholes(table, cur):
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
            yield from _wholes(table, cur.iterprev())
        else:
            if start:
                if not cur.set_range(start):
                    return
            elif not cur.first():
                return
            yield from _wholes(table, cur.iternext())

    def keys_from(self, table: bytes, start: bytes) -> Iterator[bytes]:
        """Keys >= start ascending, without their values (not of BLOCKS: split keys)."""
        cur = self.txn.cursor(db=self.store.dbs[table])
        return cur.iternext(values=False) if cur.set_range(start) else iter(())

    def items_from(self, table: bytes, start: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Entries with keys >= start ascending, iterated in C (not of BLOCKS: split keys)."""
        cur = self.txn.cursor(db=self.store.dbs[table])
        return cur.iternext() if cur.set_range(start) else iter(())

    def seek(self, table: bytes, key: bytes) -> tuple[bytes, bytes] | None:
        """The first entry with a key >= key, or None."""
        cur = self._cursor(table)
        return _whole_in(table, cur.item()) if cur.set_range(key) else None

    def seek_before(self, table: bytes, key: bytes) -> tuple[bytes, bytes] | None:
        """The last entry with a key < key, or None."""
        cur = self._cursor(table)
        found = cur.prev() if cur.set_range(key) else cur.last()
        return _whole_in(table, cur.item()) if found else None

    def _cursor(self, table: bytes) -> lmdb.Cursor[bytes]:
        cur = self._cursors.get(table)
        if cur is None:  # (each seek places it anew, whatever was written since)
            cur = self._cursors[table] = self.txn.cursor(db=self.store.dbs[table])
        return cur

    def block(self, digest: bytes) -> bytes:
        if digest == ZERO_BLOCK:
            return bytes(self.store.block_size)
        raw = self.get(BLOCKS, digest)
        if raw is None:
            raw = parent_block(self, digest)  # a fork's blocks stay in its parent's store
        if raw is None:
            raise FsError(errno.EIO, f"block {digest.hex()} missing from store")
        return self.store.decode_block(raw)

    def meta_int(self, name: bytes, default: int = 0) -> int:
        raw = self.get(META, name)
        return default if raw is None else from_u64(raw)

    def count(self, table: bytes) -> int:
        return self.txn.stat(self.store.dbs[table])["entries"]


def _count_inodes(w: WriteTxn) -> None:
    """Give every checkpoint of an older format the inode counter now: no inode numbered
    from it on existed at any of them (numbers are never given twice), so a restore to one
    skips by number those the session makes from now on."""
    now = w.meta_int(NEXT_INO_KEY, FIRST_UPPER_INO)
    rows = [(k, Checkpoint.unpack(from_u64(k), v)) for k, v in w.range_from(CKPTS)]
    w.put_many(CKPTS, [(k, replace(ck, next_ino=ck.next_ino or now).pack())
                       for k, ck in rows])


def _whole(key: bytes, value: bytes) -> tuple[bytes, bytes]:
    """A BLOCKS entry as callers see it: a split block's tail back after its value."""
    if value[:1] == _SPLIT:
        return key[:_DIGEST], _RAW + value[1:] + key[_DIGEST:]
    return key, value


def _whole_in(table: bytes, item: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
    return _whole(*item) if table == BLOCKS else item


def _wholes(table: bytes, items: Iterable[tuple[bytes, bytes]]) -> Iterable[tuple[bytes, bytes]]:
    return (_whole(k, v) for k, v in items) if table == BLOCKS else items


class WriteTxn(ReadTxn):
    # what this transaction captured and made, added to Store.tally once it commits
    captured = 0  # bytes of the blocks put_block took, zeros and duplicates too
    added = 0  # of those, the bytes of blocks new to the store
    stored = 0  # what the new ones take in BLOCKS (compressed)
    made: dict[str, int] | None = None  # checkpoints made, by kind

    def made_checkpoint(self, kind: str) -> None:
        if self.made is None:
            self.made = {}
        self.made[kind] = self.made.get(kind, 0) + 1

    def put(self, table: bytes, key: bytes, value: bytes, append: bool = False) -> None:
        if table == BLOCKS and len(key) == _DIGEST:  # (an import's, a salvage's)
            self.delete(BLOCKS, key)  # one entry per digest, split or whole
            self._put_block(key, value)
            return
        self.txn.put(key, value, db=self.store.dbs[table], append=append)

    def _put_block(self, digest: bytes, value: bytes) -> None:
        if value[:1] == _RAW:
            digest, value = self._split(digest, value)
        self.txn.put(digest, value, db=self.store.dbs[BLOCKS])

    def _split(self, digest: bytes, value: bytes) -> tuple[bytes, bytes]:
        """_RAW + a block as BLOCKS holds it: split when that saves a page."""
        psize = self.store.psize
        keep = (len(value) + _PAGE_HEADER) // psize * psize - _PAGE_HEADER - 1
        tail = len(value) - 1 - keep
        if len(value) <= psize // 2 or not 0 < tail <= 64:
            return digest, value  # in a leaf page, fills its pages, or too long a tail
        return digest + value[1 + keep:], _SPLIT + value[1:1 + keep]

    def delete(self, table: bytes, key: bytes) -> None:
        if table == BLOCKS:
            found = self._block_entry(key)
            key = key if found is None else found[0]
        self.txn.delete(key, db=self.store.dbs[table])

    def pop(self, table: bytes, key: bytes) -> bytes | None:
        """Delete the entry and return its value (None: there was none); not of BLOCKS."""
        return self.txn.pop(key, db=self.store.dbs[table])

    def put_many(self, table: bytes, items: list[tuple[bytes, bytes]], append: bool = False) -> None:
        """Puts in one call: py-lmdb's putmulti loops in C (a put from Python costs 0.4 us,
        one of putmulti's, in key order, 0.1)."""
        if table == BLOCKS:  # (blocks may be split: one at a time)
            for key, value in items:
                self.put(table, key, value)
            return
        self.txn.cursor(db=self.store.dbs[table]).putmulti(items, append=append)

    def delete_many(self, table: bytes, keys: list[bytes]) -> None:
        if table == BLOCKS:
            for key in keys:
                self.delete(table, key)
            return
        delete, db = self.txn.delete, self.store.dbs[table]  # (no Python call per key of ours)
        for key in keys:
            delete(key, db=db)

    def clear(self, table: bytes) -> None:
        """Empty the table (it stays)."""
        self.txn.drop(self.store.dbs[table], delete=False)

    def put_block(self, data: bytes) -> bytes:
        """Store one block once, keyed by its blake3 digest; zeros are not stored."""
        self.captured += len(data)
        if data == bytes(len(data)):  # (a memcmp; strip(b"\0") walks it byte by byte)
            return ZERO_BLOCK
        digest = blake3.blake3(data).digest()
        if self._block_entry(digest) is None:
            raw = self.store.encode_block(data)
            self._put_block(digest, raw)
            self.set_meta_int(BLOCK_BYTES_KEY, self.meta_int(BLOCK_BYTES_KEY) + len(raw))
            self.added += len(data)
            self.stored += len(raw)
        return digest

    def set_meta_int(self, name: bytes, value: int) -> None:
        self.put(META, name, u64(value))

    def next_counter(self, name: bytes, first: int) -> int:
        value = self.meta_int(name, first)
        self.set_meta_int(name, value + 1)
        return value


class Store:
    """One session's LMDB environment plus the lock that makes its daemon unique."""

    # whether write itself waits for a sync point it has got too far ahead of (AHEAD_PAGES);
    # a server that answers many requests on one thread turns this off and waits, off that
    # thread, in the request that writes (overlay.keep_up)
    writes_wait = True
    _deferring_thread: int | None = None  # (none in a ReaderStore: it never defers)
    # called with the arrival times (defer's since) of deferred writes once committed: a
    # server that defers sets it, to time their capture (overlayckpt stats)
    on_deferred_stored: Callable[[list[int]], None] | None = None

    def __init__(self, path: str, env: lmdb.Environment, lock_fd: int | None, *,
                 new: bool, cache_lost: bool, last: synced.Record | None) -> None:
        self.path = path
        self.env = env
        self.lock_fd = lock_fd
        # the page cache of the last daemon may be gone (power cut): what it kept only
        # there, such as the write-behind log, cannot be trusted (behind.py)
        self.cache_lost = cache_lost
        try:
            # an existing store never gets a missing table made anew (empty): that is damage;
            # only an older store gets the derived tables it never had (an upgrade)
            self.dbs = {META: env.open_db(META, create=new)}
            with env.begin() as txn:
                version = from_u64(txn.get(FORMAT_KEY, db=self.dbs[META]) or u64(0))
            for name in TABLES[1:]:
                upgrade = 0 < version < FORMAT_VERSION and name in DERIVED_TABLES
                self.dbs[name] = env.open_db(name, create=new or upgrade)
        except lmdb.NotFoundError:
            env.close()
            raise StoreDamaged(f"store {path} is damaged (a table is missing): nothing was "
                               f"served; {_WAY_OUT.format(path=path)}") from None
        self._zc = zstandard.ZstdCompressor(level=1)
        # a zstd context serves one thread at a time: reads also run in worker threads
        # (commands off the loop), so each thread decompresses with its own
        self._local = threading.local()
        with env.begin(write=True) as txn:
            w = WriteTxn(self, txn)
            version = w.meta_int(FORMAT_KEY, 0)
            if version == 0 and new:
                w.set_meta_int(FORMAT_KEY, FORMAT_VERSION)
                for key in DERIVED_KEYS:  # an empty journal: empty derived tables match it
                    w.set_meta_int(key, HISTORY_BORN if key == HISTORY_KEY else 1)
            elif 0 < version < FORMAT_VERSION:
                # the new tables are there, empty: open fills them; from 2 only blocks
                # stored from now on are split
                w.set_meta_int(FORMAT_KEY, FORMAT_VERSION)
                if version < 4:
                    _count_inodes(w)
                if version < 5:  # each group's counts row (groupfiles.py): rebuilt at open
                    w.delete(META, GROUPFILES_KEY)
            if version == 0 and not new or version > FORMAT_VERSION:
                txn.abort()
                env.close()
                if version == 0:
                    raise StoreDamaged(f"store {path} is damaged (no format record): nothing "
                                       f"was served; {_WAY_OUT.format(path=path)}")
                raise UserError(f"store {path} has format {version}, newer than this "
                                f"overlayckpt understands ({FORMAT_VERSION}): upgrade overlayckpt")
        self.block_size = self.read(lambda r: r.meta_int(BLOCK_SIZE_KEY, DEFAULT_BLOCK_SIZE))
        self._psize = self.psize = env.stat()["psize"]
        self._data_fd = os.open(os.path.join(path, synced.DATA_NAME), os.O_RDONLY | os.O_CLOEXEC)
        self._synced_fd = synced.open_file(path)
        self._ident = synced.incarnation(path)
        self._counter = last.counter if last else 0
        self._flush_lock = threading.Lock()
        self._durable = 0  # txnid of the newest recorded snapshot
        self._pins: list[tuple[SyncPoint, lmdb.Transaction[bytes]]] = []  # oldest first
        self._long_reads = 0  # begin_read views open (map growth must wait for none)
        self._since_point = 0  # commits since the last sync point began
        self._point_pages = 0  # the file's pages when the last sync point began
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="store-sync")
        self._auto: Future[None] | None = None  # the automatic sync point under way
        # writes stored with the next write transaction (defer), and the thread of that writer
        self._deferred: list[Deferred] = []
        self._deferred_bytes = 0
        # since open, of commits (WriteTxn's counters; overlayckpt stats): captured_bytes,
        # new_bytes, stored_bytes, and checkpoints_KIND
        self.tally: dict[str, int] = {"captured_bytes": 0, "new_bytes": 0, "stored_bytes": 0}
        if new:
            synced.fsync_dir(path)  # data.mdb and lock.mdb themselves
        self.sync()  # this incarnation's baseline: a crash from now on rolls back no further

    @classmethod
    def open(cls, path: str, *, create: bool = True, block_size: int | None = None,
             lock: bool = True) -> Store:
        if block_size is not None and (why := block_size_problem(block_size)) is not None:
            raise UserError(f"{why}: pick one such as {DEFAULT_BLOCK_SIZE} (--block-size)")
        if not os.path.isdir(path):
            if not create:
                raise UserError(f"no session store at {path}: mount the repo first or check --store")
            try:
                _make_dirs_durably(path)
            except OSError as e:
                raise UserError(f"cannot create store {path}: {e.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"store {path} is not writable: fix its permissions or pick --store")
        places.secure(path)  # (a directory made with mkdir is 0755: it is a store now)
        lock_fd = None
        if lock:
            lock_fd = places.open_private(os.path.join(path, "lock"), os.O_RDWR)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                raise StoreLocked(
                    f"store {path} is in use by another overlayckpt daemon: unmount it first") from None
        drop_reader(path)
        try:
            new = not os.path.exists(os.path.join(path, synced.DATA_NAME))
            if new and not create:
                raise UserError(f"no session store at {path}: mount the repo first or check --store")
            last = None if new else synced.load(path)
            cache_lost = False if new else trust_snapshot(path, last)
            try:
                env = lmdb.open(path, map_size=_INITIAL_MAP, max_dbs=len(TABLES) + 2,
                                sync=False, metasync=False, readahead=False, max_readers=256,
                                readonly=False, mode=places.FILE_MODE)
            except lmdb.Error as e:
                raise UserError(f"cannot open store {path}: {e}") from None
            env.reader_check()
            store = cls(path, env, lock_fd, new=new, cache_lost=cache_lost, last=last)
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        if block_size is not None:
            def init_bs(w: WriteTxn) -> None:
                if w.get(META, BLOCK_SIZE_KEY) is None:
                    w.set_meta_int(BLOCK_SIZE_KEY, block_size)
            store.write(init_bs)
            store.block_size = store.read(lambda r: r.meta_int(BLOCK_SIZE_KEY))
            store.sync()
        if (why := block_size_problem(store.block_size)) is not None:
            store.close()  # (every block offset would divide by it or overflow)
            raise StoreDamaged(f"store {path} is damaged (its {why}): nothing was served")
        _opened(store)
        return store

    def close(self) -> None:
        _OPEN.pop(os.path.realpath(self.path), None)
        self.store_deferred()
        self._finish_auto(wait=True)
        self._flusher.shutdown()
        point = self.sync_begin()
        if point is None:
            point = SyncPoint(self._durable, self._meta_of(self._durable))
        self.sync_flush(point, clean=True)
        self._drop_pins(keep=0)
        self.env.close()
        os.close(self._data_fd)
        os.close(self._synced_fd)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def read(self, fn: Callable[[ReadTxn], T]) -> T:
        """fn on the newest state, deferred writes included when read on their writer's thread."""
        self._store_deferred_here()
        return self.peek(fn)

    def peek(self, fn: Callable[[ReadTxn], T]) -> T:
        """fn on the committed state, without the deferred writes: only for a read that
        touches none of their tags (see deferring)."""
        with self.env.begin(buffers=False) as txn:
            return fn(ReadTxn(self, txn))

    def begin_read(self) -> ReadTxn:
        """A long-lived read view (caller must call end_read)."""
        self._store_deferred_here()
        self._long_reads += 1
        return ReadTxn(self, self.env.begin(buffers=False))

    def end_read(self, r: ReadTxn) -> None:
        r.txn.abort()
        self._long_reads -= 1

    def write(self, fn: Callable[[WriteTxn], T]) -> T:
        """Run fn in one write transaction; grow the map once if it is full.

        fn must have no effect outside the transaction, since it may run twice.
        """
        result = self._commit_with_deferred(fn) if self._deferred_here() else self._commit(fn)
        self._since_point += 1
        grown = self._grown()
        # a writer faster than the disk waits for it, rather than growing the store
        self._finish_auto(wait=self.writes_wait and grown >= AHEAD_PAGES)
        if self._auto is None and (self._since_point >= AUTO_POINT_COMMITS
                                   or grown >= AUTO_POINT_PAGES):
            point = self.sync_begin()
            if point is not None:
                self._auto = self._flusher.submit(self.sync_flush, point)
        return result

    # -- deferred writes -------------------------------------------------------------
    #
    # A write whose writer was told it is done already (write-behind, fuse/csrc/behind.c)
    # need not commit on its own: it is in the write-behind log, which a restart replays.
    # Deferred, it commits with the next write transaction of its thread, before what
    # that does, or when that thread reads, syncs or stores them (store_deferred): one
    # commit for several writes, or for a write and the create or rename after it.

    def defer(self, fn: Callable[[WriteTxn], object], failed: Callable[[Exception], None],
              tag: int, size: int, since: int = 0) -> None:
        """Run fn before the next write transaction of this thread. failed(e): fn failed on
        its own. tag: what fn changes (an inode), for deferring; size: its bytes; since:
        when its request arrived (for on_deferred_stored)."""
        self._deferring_thread = threading.get_ident()
        self._deferred.append((fn, failed, tag, since))
        self._deferred_bytes += size
        if len(self._deferred) >= MAX_DEFERRED or self._deferred_bytes >= MAX_DEFERRED_BYTES:
            self.store_deferred()

    def deferring(self, tag: int) -> bool:
        """Whether a deferred write has that tag."""
        return any(t == tag for _, _, t, _ in self._deferred)

    def deferred(self) -> int:
        return len(self._deferred)

    def deferred_bytes(self) -> int:
        return self._deferred_bytes

    def store_deferred(self) -> None:
        """Commit the deferred writes now: together, or each on its own if that fails."""
        if self._deferred:
            self._commit_with_deferred(None)
            self._since_point += 1

    def _deferred_here(self) -> bool:
        return self._deferring_thread == threading.get_ident() and bool(self._deferred)

    def _store_deferred_here(self) -> None:
        if self._deferred_here():
            self.store_deferred()

    @overload
    def _commit_with_deferred(self, fn: Callable[[WriteTxn], T]) -> T: ...
    @overload
    def _commit_with_deferred(self, fn: None) -> None: ...

    def _commit_with_deferred(self, fn: Callable[[WriteTxn], T] | None) -> T | None:
        """The deferred writes, then fn (if any), in one transaction; if that fails, each
        deferred write on its own (so that only what failed fails), then fn alone."""
        taken, self._deferred, self._deferred_bytes = self._deferred, [], 0

        def both(w: WriteTxn) -> T | None:
            for deferred_fn, _, _, _ in taken:
                deferred_fn(w)
            return fn(w) if fn is not None else None
        try:
            result = self._commit(both)
        except Exception:  # then each on its own: only what failed fails
            self._commit_each(taken)
            return self._commit(fn) if fn is not None else None
        self._stored(taken)
        return result

    def _commit_each(self, taken: list[Deferred]) -> None:
        for one in taken:
            try:
                self._commit(one[0])
            except Exception as e:  # the writer was answered: it is told later
                one[1](e)
            else:
                self._stored([one])

    def _stored(self, taken: list[Deferred]) -> None:
        if self.on_deferred_stored is not None:
            self.on_deferred_stored([since for _, _, _, since in taken])

    def _grown(self) -> int:
        return self.env.info()["last_pgno"] - self._point_pages

    def too_far_ahead(self) -> bool:
        """Whether the next write should first wait for the sync point under way."""
        return self._auto is not None and self._grown() >= AHEAD_PAGES

    def wait_flush(self) -> None:
        """Block until the sync point under way is durable (any thread); then
        finish_flush, on the writer's thread, drops what it held."""
        auto = self._auto
        if auto is not None:
            futures.wait([auto])

    def finish_flush(self) -> None:
        """Drop the pins of a sync point that has become durable (writer's thread)."""
        self._finish_auto(wait=False)

    def _finish_auto(self, wait: bool) -> None:
        if self._auto is None or not (wait or self._auto.done()):
            return
        error = self._auto.exception()
        self._auto = None
        if error is not None:  # the next sync point tries again, and an fsync reports it
            log.warning("automatic sync of the store failed: %s", error)
        self.sync_end()

    def _commit(self, fn: Callable[[WriteTxn], T]) -> T:
        for attempt in range(2):
            try:
                with self.env.begin(write=True, buffers=False) as txn:
                    w = WriteTxn(self, txn)
                    result = fn(w)
                if w.captured or w.made:
                    self._tally(w)
                return result
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

    def _tally(self, w: WriteTxn) -> None:
        tally = self.tally
        tally["captured_bytes"] += w.captured
        tally["new_bytes"] += w.added
        tally["stored_bytes"] += w.stored
        for kind, n in (w.made or {}).items():
            tally["checkpoints_" + kind] = tally.get("checkpoints_" + kind, 0) + n

    def _disk_full(self) -> bool:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 4 << 20

    def _grow(self) -> None:
        # LMDB forbids set_mapsize with any transaction of this process open: make the
        # newest snapshot durable, so that no pin is needed while none is held
        if self._long_reads:
            raise FsError(errno.ENOSPC, "store map full while a long read (an export or "
                                        "apply) is open: retry when it has finished")
        self._finish_auto(wait=True)  # its flush relies on its pin
        self.sync()
        self._drop_pins(keep=0)
        new = self.env.info()["map_size"] * 2
        log.info("growing store map to %d bytes", new)
        self.env.set_mapsize(new)
        self.sync_pin()

    # -- durability (see the module docstring and synced.py) --------------------

    def sync(self) -> None:
        """A whole sync point, on the writer's thread (offline commands, open, close)."""
        point = self.sync_begin()
        if point is not None:
            self.sync_flush(point)
        self.sync_end()

    def sync_begin(self) -> SyncPoint | None:
        """Pin the newest snapshot (writer's thread); None if it is already durable."""
        self._store_deferred_here()
        self._since_point = 0
        self._point_pages = self.env.info()["last_pgno"]
        txn = self.env.begin(buffers=False)
        txnid = txn.id()
        if txnid <= self._durable or (self._pins and self._pins[-1][0].txnid == txnid):
            txn.abort()  # durable already, or pinned by a sync point still under way
            return self._pins[-1][0] if txnid > self._durable else None
        point = SyncPoint(txnid, self._meta_of(txnid))
        self._pins.append((point, txn))
        return point

    def sync_pin(self) -> None:
        """Pin the durable snapshot again after every pin was dropped (map growth)."""
        txn = self.env.begin(buffers=False)
        self._pins.append((SyncPoint(txn.id(), self._meta_of(txn.id())), txn))

    def sync_flush(self, point: SyncPoint, clean: bool = False) -> None:
        """Make point's snapshot durable and record it (any thread; may block for long)."""
        with self._flush_lock:
            if point.txnid < self._durable or (point.txnid == self._durable and not clean):
                return
            self.env.sync(True)
            self._counter += 1
            synced.save(self._synced_fd, synced.Record(self._counter, point.txnid, clean,
                                                       self._psize, self._ident, point.meta))
            self._durable = point.txnid

    def sync_end(self) -> None:
        """Drop the pins older than the recorded snapshot (writer's thread)."""
        self._drop_pins(keep=self._durable)

    def _drop_pins(self, keep: int) -> None:
        while self._pins and (self._pins[0][0].txnid < keep or not keep):
            self._pins.pop(0)[1].abort()

    def _meta_of(self, txnid: int) -> bytes:
        # txn N writes meta slot N & 1, and only N + 2 overwrites it: on the writer's
        # thread, with N the newest, it is there
        meta = synced.read_meta(self._data_fd, txnid & 1, self._psize)
        if synced.meta_txnid(meta) != txnid:
            raise FsError(errno.EIO, f"store meta page of transaction {txnid} not found")
        return meta

    def encode_block(self, data: bytes) -> bytes:
        packed = self._zc.compress(data)
        if len(packed) < len(data) - len(data) // 8:
            return _ZSTD + packed
        return _RAW + data

    def decode_block(self, raw: bytes) -> bytes:
        """A block's content, never more than block_size bytes: a frame claiming more (a
        crafted bundle's 1 KB frame that says 1 GiB) is damage, refused before inflating."""
        if raw[:1] == _ZSTD:
            zd = getattr(self._local, "zd", None)
            if zd is None:
                zd = self._local.zd = zstandard.ZstdDecompressor()
            frame = raw[1:]
            # one-shot decompress ignores max_output_size when the frame states its size
            if zstandard.frame_content_size(frame) > self.block_size:
                raise FsError(errno.EIO, "a stored block inflates beyond the block size")
            return zd.decompress(frame, max_output_size=self.block_size)
        if len(raw) > self.block_size + 1:
            raise FsError(errno.EIO, "a stored block is longer than the block size")
        return raw[1:]

    def disk_bytes(self) -> int:
        try:
            return os.stat(os.path.join(self.path, "data.mdb")).st_blocks * 512
        except OSError:
            return 0


class ReaderStore(Store):
    """A store as another process reads it beside its daemon (service/reader.py): no
    lock, no writes, no sync points. LMDB serves readers in other processes from the
    same map, each read seeing the newest commit."""

    def __init__(self, path: str) -> None:  # (none of Store's writer state)
        try:
            env = lmdb.open(path, map_size=_INITIAL_MAP, max_dbs=len(TABLES) + 2, readonly=True,
                            readahead=False, max_readers=256, create=False)
            self.dbs = {name: env.open_db(name, create=False) for name in TABLES}
        except lmdb.Error as e:
            raise UserError(f"cannot read store {path}: {e}") from None
        self.path, self.env, self.lock_fd, self.cache_lost = path, env, None, False
        self._deferred = []  # (never any: store_deferred is a no-op)
        self._local = threading.local()
        self.block_size = self.read(lambda r: r.meta_int(BLOCK_SIZE_KEY, DEFAULT_BLOCK_SIZE))

    def read(self, fn: Callable[[ReadTxn], T]) -> T:
        try:
            return super().read(fn)
        except lmdb.MapResizedError:  # the daemon grew the map: take its new size
            self.env.set_mapsize(0)
            return super().read(fn)

    def write(self, fn: Callable[[WriteTxn], T]) -> T:
        raise FsError(errno.EROFS, "a reader of the store does not write")

    def close(self) -> None:
        self.env.close()


# -- forks: a fork's store reads the blocks it does not hold from its parent's ----------
#
# A fork (core/fork.py) holds the parent's tables at the fork point, not its blocks: a
# block missing here is looked up in the parent's store (META PARENT_KEY), and so on up
# the chain. LMDB must not open one file twice in a process (closing the second copy
# drops the first's locks): a store this process has open is read as it is, any other
# through a ReaderStore kept for the process's life.

_OPEN: dict[str, Store] = {}  # realpath -> a Store this process has open
_READERS: dict[str, Store] = {}  # realpath -> a ReaderStore opened for a fork's reads
_chain_lock = threading.Lock()


def _opened(store: Store) -> None:
    with _chain_lock:
        _OPEN[os.path.realpath(store.path)] = store


def drop_reader(path: str) -> None:
    """Before this process opens the store at path itself: close the reader it kept."""
    with _chain_lock:
        reader = _READERS.pop(os.path.realpath(path), None)
    if reader is not None:
        reader.close()


def store_at(path: str) -> Store:
    """The store at path for reading: the one this process has open, else a reader."""
    found = _OPEN.get(path) or _READERS.get(path)  # (paths recorded are real already)
    if found is not None:
        return found
    real = os.path.realpath(path)
    with _chain_lock:
        found = _OPEN.get(real) or _READERS.get(real)
        if found is None:
            found = _READERS[real] = ReaderStore(real)
    return found


def parent_of(r: ReadTxn) -> tuple[str, int] | None:
    """(the parent's store path, the checkpoint forked from) of a fork, else None."""
    raw = r.get(META, PARENT_KEY)
    if raw is None:
        return None
    path, cid = unpack_obj(raw)
    return path, cid


# a store's path -> its parent's store path, or "" (a store's parent never changes; and a
# block is found by its digest, so even a store made anew at the same path reads right)
_PARENT_PATHS: dict[str, str] = {}


MAX_FORK_DEPTH = 64  # parents up a fork chain: more is a loop (a store its own parent)


def parent_block(r: ReadTxn, digest: bytes, depth: int = 0) -> bytes | None:
    """The raw block from the parent chain of r's store (None: nowhere)."""
    if depth >= MAX_FORK_DEPTH:
        log.warning("the fork chain of %s loops or is too deep: a block is not read", r.store.path)
        return None
    path = _PARENT_PATHS.get(r.store.path)
    if path is None:
        parent = parent_of(r)
        path = _PARENT_PATHS[r.store.path] = parent[0] if parent else ""
    if not path:
        return None
    try:
        store = store_at(path)
    except UserError:
        log.warning("the parent store %s of %s cannot be read", path, r.store.path)
        return None
    return store.read(lambda p: p.get(BLOCKS, digest) or parent_block(p, digest, depth + 1))


def forks_of(r: ReadTxn) -> dict[str, int]:
    """The forks a store knows of: store path -> the checkpoint each forked from."""
    return {k[len(FORK_KEY):].decode(errors="surrogateescape"): from_u64(v)
            for k, v in r.prefix(META, FORK_KEY)}


_WAY_OUT = ("run 'overlayckpt --store {path} recover' to salvage what can be read into a "
            "new store (the damaged one is kept beside it)")


def _make_dirs_durably(path: str) -> None:
    """makedirs, with each new directory's entry fsync'd in its parent (else a power cut
    may take the whole store, and a store that vanished would look like a new one)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        _make_dirs_durably(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    synced.fsync_dir(parent)


def _verify(path: str) -> list[str]:
    """lmdb's offline verifier on the snapshot LMDB would open: every page it reaches."""
    try:
        return lmdb.verify.verify(path)
    except (lmdb.verify.VerifyError, OSError) as e:
        return [str(e)]


def trust_snapshot(path: str, rec: synced.Record | None) -> bool:
    """Before LMDB opens an existing store: pick the snapshot to trust, and verify it.

    Returns whether the last daemon's page cache may be gone (then the store was rolled
    back to its last recorded sync point). The newest snapshot is kept only if the page
    cache survived (same incarnation) and everything it reaches verifies; else the
    recorded one. Raises StoreDamaged if that fails verification too.
    """
    newest = synced.newest_txnid(path, rec.psize if rec else 4096)
    if rec is not None and rec.clean and newest == rec.txnid:
        return False  # closed cleanly: nothing after the record
    cache_lost = rec is not None and (rec.ident != synced.incarnation(path)
                                      or newest is None or newest < rec.txnid)
    if cache_lost and newest != rec.txnid:  # type: ignore[union-attr]  # cache_lost: rec is set
        log.warning("store %s was not closed and its page cache is gone (power cut?): "
                    "rolling back to its last sync point (transaction %d, was %s)",
                    path, rec.txnid, newest)  # type: ignore[union-attr]  # cache_lost: rec is set
        try:
            synced.roll_back(path, rec)  # type: ignore[arg-type]  # cache_lost: rec is set
        except OSError as e:
            raise StoreDamaged(f"store {path} cannot be rolled back to its last sync point "
                               f"({e.strerror}): {_WAY_OUT.format(path=path)}") from None
    problems = _verify(path)
    if problems and not cache_lost and rec is not None and newest is not None \
            and newest > rec.txnid:
        # the incarnation said the page cache survived, yet what the newest meta page
        # reaches is damaged: it did not (a cut the incarnation cannot tell). The
        # recorded snapshot's pages were pinned since it was recorded: never rewritten
        log.warning("store %s: its newest snapshot (transaction %d) is damaged (%s): "
                    "rolling back to its last sync point (transaction %d)",
                    path, newest, problems[0], rec.txnid)
        try:
            synced.roll_back(path, rec)
        except OSError as e:
            raise StoreDamaged(f"store {path} cannot be rolled back to its last sync point "
                               f"({e.strerror}): {_WAY_OUT.format(path=path)}") from None
        cache_lost = True
        problems = _verify(path)
    if problems:
        raise StoreDamaged(f"store {path} is damaged ({problems[0]}; {len(problems)} "
                           f"problem(s)): nothing was served; {_WAY_OUT.format(path=path)}")
    return cache_lost


def salvage(src: str, dst: str) -> Iterator[tuple[str, int, str | None]]:
    """Copy every entry LMDB can still read from the damaged store at src into a new
    store at dst, table by table, committing as it goes (so that if the damage crashes
    the reader, what was copied before stays). Yields each table's name, entries
    copied and the error that stopped it."""
    env = lmdb.open(src, readonly=True, lock=False, max_dbs=len(TABLES) + 2,
                    map_size=_INITIAL_MAP, readahead=False)
    out = Store.open(dst, create=True, lock=False)
    try:
        for name in TABLES:
            if name in DERIVED_TABLES:
                continue  # derived from the journal: rebuilt at the next open (no DERIVED_KEYS)
            copied, error = 0, None
            batch: list[tuple[bytes, bytes]] = []

            def copy(w: WriteTxn, name: bytes = name, batch: list[tuple[bytes, bytes]] = batch) -> None:
                for k, v in batch:
                    if name != META or k not in DERIVED_KEYS:
                        w.put(name, k, v)

            def flush(batch: list[tuple[bytes, bytes]] = batch) -> None:
                out.write(copy)
                batch.clear()
            try:
                db = env.open_db(name, create=False)
                with env.begin(db=db, buffers=False) as txn:
                    for k, v in txn.cursor():
                        batch.append((k, v))
                        copied += 1
                        if len(batch) >= 4096:
                            flush()
            except lmdb.Error as e:
                error = str(e)
            flush()
            yield name.decode(), copied, error
        found = 0
        for digest, raw in scan_blocks(os.path.join(src, synced.DATA_NAME), out):
            def put_new(w: WriteTxn, d: bytes = digest, v: bytes = raw) -> bool:
                if w.get(BLOCKS, d) is not None:
                    return False
                w.put(BLOCKS, d, v)
                return True
            found += out.write(put_new)
        yield "blocks (scan)", found, None

        def drop_derived(w: WriteTxn) -> None:
            for key in DERIVED_KEYS:
                w.delete(META, key)
        out.write(drop_derived)  # rebuilt at open
    finally:
        env.close()
        out.close()


def scan_blocks(data_path: str, store: Store) -> Iterator[tuple[bytes, bytes]]:
    """Every block any leaf page of the file holds, whatever reaches it (a scan, not a walk
    from a meta page): a block's key is the blake3 of its content, so each found is
    checked and kept only if it matches. Yields (digest, the value as BLOCKS holds it)."""
    import struct
    psize = store.psize
    with open(data_path, "rb") as f:
        data = f.read()
    npages = len(data) // psize
    for pno in range(2, npages):
        base = pno * psize
        pgno, _pad, flags, lower, upper = struct.unpack_from("<QHHHH", data, base)
        if pgno != pno or flags & 0x3F != 0x02 or not _PAGE_HEADER <= lower <= upper <= psize:
            continue  # not a leaf page (or not at its place)
        for i in range((lower - _PAGE_HEADER) // 2):
            off = struct.unpack_from("<H", data, base + _PAGE_HEADER + 2 * i)[0]
            if not upper <= off <= psize - 8:
                break
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, base + off)
            dsize = lo | hi << 16
            kstart = base + off + 8
            if not _DIGEST <= ksize <= _DIGEST + 64 or nflags & ~0x01 \
                    or kstart + ksize > base + psize:
                continue
            key = data[kstart:kstart + ksize]
            if nflags & 0x01:  # F_BIGDATA: the value is in overflow pages
                opg = struct.unpack_from("<Q", data, kstart + ksize)[0]
                vstart = opg * psize + _PAGE_HEADER
                if not 2 <= opg < npages or vstart + dsize > len(data):
                    continue
                value = data[vstart:vstart + dsize]
            else:
                value = data[kstart + ksize:kstart + ksize + dsize]
            digest, raw = _whole(key, value)
            try:
                content = store.decode_block(raw)
            except Exception:  # not a block, or a damaged one
                continue
            if blake3.blake3(content).digest() == digest:
                yield digest, raw
