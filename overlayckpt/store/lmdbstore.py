"""The LMDB environment of one session: open, commits, deferred writes, map growth, sync
points, block compression, and the stores a fork reads its parent's blocks from.

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
trust and verifies it (trust.py); a damaged store is refused (StoreDamaged), never
served. An older store is upgraded as it opens (format.py). Transactions and how
blocks are held: txn.py; a damaged store's salvage: salvage.py.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, overload

import lmdb
import lmdb.verify
import zstandard

from overlayckpt.errors import FsError, StoreDamaged, StoreLocked, UserError
from overlayckpt.records import (
    DEFAULT_BLOCK_SIZE,
    block_size_problem,
    from_u64,
    unpack_obj,
)
from overlayckpt.store import places, synced
from overlayckpt.store.format import open_tables, settle_format
from overlayckpt.store.trust import trust_snapshot
from overlayckpt.store.txn import RAW, ZSTD, ReadTxn, WriteTxn
from overlayckpt.tables import (
    BLOCK_SIZE_KEY,
    BLOCKS,
    FORK_KEY,
    META,
    PARENT_KEY,
    TABLES,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class Deferred(NamedTuple):
    """A deferred write (Store.defer: what each field is)."""
    fn: Callable[[WriteTxn], object]
    failed: Callable[[Exception], None]
    tags: tuple[int, ...]
    since: int
    announced: bool


INITIAL_MAP = 1 << 38  # address space only; the file grows as pages are used
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
# writes C has acknowledged and Python not yet taken (writebehind.py's LOG_SIZE)
MAX_DEFERRED_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class SyncPoint:
    txnid: int
    meta: bytes  # the meta page of txnid, as LMDB wrote it


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
    # called after a commit that wrote the tree, with the inodes (8-byte keys) whose records
    # it wrote and whether it wrote what no inode says (WriteTxn.touched): a server that
    # lets C answer from what it read (fuse/csrc/names.c) sets it, to drop those answers
    on_commit: Callable[[set[bytes], bool], None] | None = None

    def __init__(self, path: str, env: lmdb.Environment, lock_fd: int | None, *,
                 new: bool, cache_lost: bool, last: synced.Record | None) -> None:
        self.path = path
        self.env = env
        self.lock_fd = lock_fd
        # the page cache of the last daemon may be gone (power cut): what it kept only
        # there, such as the write-behind log, cannot be trusted (writebehind.py)
        self.cache_lost = cache_lost
        self.dbs = open_tables(env, path, new)
        self._zc = zstandard.ZstdCompressor(level=1)
        # a zstd context serves one thread at a time: reads also run in worker threads
        # (commands off the loop), so each thread decompresses with its own
        self._local = threading.local()
        try:
            with env.begin(write=True) as txn:  # (aborted if it raises)
                settle_format(WriteTxn(self, txn), new)
        except UserError:  # a damaged or newer store: refused
            env.close()
            raise
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
                env = lmdb.open(path, map_size=INITIAL_MAP, max_dbs=len(TABLES) + 2,
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
              tags: tuple[int, ...], size: int, since: int = 0, announced: bool = False) -> None:
        """Run fn before the next write transaction of this thread. failed(e): fn failed on
        its own. tags: what fn changes (inodes), for deferring; size: its bytes; since:
        when its request arrived (for on_deferred_stored); announced: what fn writes was
        reported to on_commit's reader as it was answered (core/answered.py), so that
        its commit reports nothing of it."""
        self._deferring_thread = threading.get_ident()
        self._deferred.append(Deferred(fn, failed, tags, since, announced))
        self._deferred_bytes += size
        if len(self._deferred) >= MAX_DEFERRED or self._deferred_bytes >= MAX_DEFERRED_BYTES:
            self.store_deferred()

    def deferring(self, tag: int) -> bool:
        """Whether a deferred write changes that inode."""
        return self.deferring_any({tag})

    def deferring_any(self, tags: set[int]) -> bool:
        """Whether a deferred write changes any of those inodes."""
        return any(not tags.isdisjoint(d.tags) for d in self._deferred)

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
            for d in taken:
                if d.announced:  # (what it touches is not reported: the others' is kept aside)
                    others, w.touched = w.touched, None
                    d.fn(w)
                    w.touched = others
                else:
                    d.fn(w)
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
                self._commit(one.fn)
            except Exception as e:  # the writer was answered: it is told later
                one.failed(e)
            else:
                self._stored([one])

    def _stored(self, taken: list[Deferred]) -> None:
        if self.on_deferred_stored is not None:
            self.on_deferred_stored([d.since for d in taken])

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
                if self.on_commit is not None and (w.touched or w.touched_all):
                    self.on_commit(w.touched or set(), w.touched_all)
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
        free = self.free_bytes()
        return free is not None and free < 4 << 20

    def free_bytes(self) -> int | None:
        """The bytes free for the store on its disk (None: unknown)."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

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
            return ZSTD + packed
        return RAW + data

    def decode_block(self, raw: bytes) -> bytes:
        """A block's content, never more than block_size bytes: a frame claiming more (a
        crafted bundle's 1 KB frame that says 1 GiB) is damage, refused before inflating."""
        if raw[:1] == ZSTD:
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

    def block_elsewhere(self, r: ReadTxn, digest: bytes) -> bytes | None:
        """A block this store does not hold: a fork's blocks stay in its parent's store."""
        return parent_block(r, digest)

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
            env = lmdb.open(path, map_size=INITIAL_MAP, max_dbs=len(TABLES) + 2, readonly=True,
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
