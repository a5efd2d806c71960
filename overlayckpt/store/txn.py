"""Transactions on a store's tables (ReadTxn, WriteTxn), and how BLOCKS holds a block.

A transaction sees every table of its store by name (tables.py). Blocks are keyed by
their blake3 digest; a raw block may be split between its key and its value (format 3,
below), which ReadTxn and WriteTxn hide: callers always give and get the digest and
the whole value. The store itself (lmdbstore.Store: the environment, commits, sync
points) opens the transactions; what a transaction needs of it is TxnStore.
"""
from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol, TypeVar

import blake3
import lmdb

from overlayckpt.errors import FsError
from overlayckpt.records import ZERO_BLOCK, from_u64, u64
from overlayckpt.tables import BLOCK_BYTES_KEY, BLOCKS, LIVE_TABLES, META, PINNED

T = TypeVar("T")

# Block values start with one byte saying how the rest is encoded.
RAW, ZSTD, SPLIT = b"\0", b"\1", b"\2"
# A value over half a page goes to a run of overflow pages, which holds n * psize - 16
# bytes: a raw 4 KiB block (4097 bytes) would take two pages. So a raw block's last
# bytes ride in its key instead (digest + tail -> SPLIT + the rest, format 3): the
# value fills its pages exactly. ReadTxn and WriteTxn take and give the digest and
# RAW + the whole block, so no caller and no decode_block ever sees a split one.
PAGE_HEADER = 16
DIGEST = 32

class TxnStore(Protocol):
    """What a transaction needs of its store (lmdbstore.Store and ReaderStore are one)."""

    @property
    def path(self) -> str: ...
    @property
    def dbs(self) -> Mapping[bytes, lmdb._Database]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def psize(self) -> int: ...

    def read(self, fn: Callable[[ReadTxn], T]) -> T: ...
    def encode_block(self, data: bytes) -> bytes: ...
    def decode_block(self, raw: bytes) -> bytes: ...

    def block_elsewhere(self, r: ReadTxn, digest: bytes) -> bytes | None:
        """A block this store does not hold (a fork's: from its parent's store), or None."""
        ...


class ReadTxn:
    """A read view of every table, consistent for its lifetime."""

    def __init__(self, store: TxnStore, txn: lmdb.Transaction[bytes]) -> None:
        self.store = store
        self.txn = txn
        self._cursors: dict[bytes, lmdb.Cursor[bytes]] = {}  # seek's and seek_before's, one per table

    def get(self, table: bytes, key: bytes) -> bytes | None:
        if table == BLOCKS:
            found = self._block_entry(key)
            return None if found is None else whole(*found)[1]
        return self.txn.get(key, db=self.store.dbs[table])

    def _block_entry(self, digest: bytes) -> tuple[bytes, bytes] | None:
        """The BLOCKS entry of digest as stored (its key may carry a split block's tail)."""
        return self._cursor(BLOCKS).item() if self._has_block(digest) else None

    def _has_block(self, digest: bytes) -> bool:
        """Whether BLOCKS holds digest (its value is not copied out of the map)."""
        cur = self._cursor(BLOCKS)
        return cur.set_range(digest) and cur.key()[:DIGEST] == digest

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

    def items_between(self, table: bytes, first: bytes, last: bytes) -> list[tuple[bytes, bytes]]:
        """Entries with first <= key <= last (not of BLOCKS: split keys)."""
        out = []
        for item in self.items_from(table, first):
            if item[0] > last:
                break
            out.append(item)
        return out

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
            raw = self.store.block_elsewhere(self, digest)  # a fork's: in its parent's store
        if raw is None:
            raise FsError(errno.EIO, f"block {digest.hex()} missing from store")
        return self.store.decode_block(raw)

    def meta_int(self, name: bytes, default: int = 0) -> int:
        raw = self.get(META, name)
        return default if raw is None else from_u64(raw)

    def count(self, table: bytes) -> int:
        return self.txn.stat(self.store.dbs[table])["entries"]


def whole(key: bytes, value: bytes) -> tuple[bytes, bytes]:
    """A BLOCKS entry as callers see it: a split block's tail back after its value."""
    if value[:1] == SPLIT:
        return key[:DIGEST], RAW + value[1:] + key[DIGEST:]
    return key, value


def _whole_in(table: bytes, item: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
    return whole(*item) if table == BLOCKS else item


def _wholes(table: bytes, items: Iterable[tuple[bytes, bytes]]) -> Iterable[tuple[bytes, bytes]]:
    return (whole(k, v) for k, v in items) if table == BLOCKS else items


# put_blocks: zstd takes 4 us to find a 4 KiB block incompressible, twice the hash
RAW_RUN = 4
PROBE_EVERY = 16
_BY_INODE = frozenset(LIVE_TABLES)  # (a key's first 8 bytes: its inode)
_TOUCHING = _BY_INODE | {PINNED}  # the tables whose writes Store.on_commit reports


class WriteTxn(ReadTxn):
    # what this transaction wrote of the tree, for Store.on_commit: the inodes (8-byte keys)
    # whose records it wrote, and whether it wrote what no inode says (the repo's pins)
    touched: set[bytes] | None = None
    touched_all = False
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
        if table == BLOCKS and len(key) == DIGEST:  # (an import's, a salvage's)
            self.delete(BLOCKS, key)  # one entry per digest, split or whole
            self._put_block(key, value)
            return
        self._touch(table, key)
        self.txn.put(key, value, db=self.store.dbs[table], append=append)

    def _touch(self, table: bytes, key: bytes) -> None:
        if table in _BY_INODE:
            if self.touched is None:
                self.touched = set()
            self.touched.add(key[:8])
        elif table == PINNED:
            self.touched_all = True

    def _touch_keys(self, table: bytes, keys: Iterable[bytes]) -> None:
        if table in _TOUCHING:  # (else not one call per key)
            for key in keys:
                self._touch(table, key)

    def _put_block(self, digest: bytes, value: bytes) -> None:
        if value[:1] == RAW:
            digest, value = self._split(digest, value)
        self.txn.put(digest, value, db=self.store.dbs[BLOCKS])

    def _split(self, digest: bytes, value: bytes) -> tuple[bytes, bytes]:
        """RAW + a block as BLOCKS holds it: split when that saves a page."""
        psize = self.store.psize
        keep = (len(value) + PAGE_HEADER) // psize * psize - PAGE_HEADER - 1
        tail = len(value) - 1 - keep
        if len(value) <= psize // 2 or not 0 < tail <= 64:
            return digest, value  # in a leaf page, fills its pages, or too long a tail
        return digest + value[1 + keep:], SPLIT + value[1:1 + keep]

    def delete(self, table: bytes, key: bytes) -> None:
        if table == BLOCKS and self._has_block(key):
            key = self._cursor(BLOCKS).key()  # (it may carry a split block's tail)
        self._touch(table, key)
        self.txn.delete(key, db=self.store.dbs[table])

    def pop(self, table: bytes, key: bytes) -> bytes | None:
        """Delete the entry and return its value (None: there was none); not of BLOCKS."""
        self._touch(table, key)
        return self.txn.pop(key, db=self.store.dbs[table])

    def put_many(self, table: bytes, items: list[tuple[bytes, bytes]], append: bool = False) -> None:
        """Puts in one call: py-lmdb's putmulti loops in C (a put from Python costs 0.4 us,
        one of putmulti's, in key order, 0.1)."""
        if table == BLOCKS:  # (blocks may be split: one at a time)
            for key, value in items:
                self.put(table, key, value)
            return
        self._touch_keys(table, (key for key, _ in items))
        self.txn.cursor(db=self.store.dbs[table]).putmulti(items, append=append)

    def delete_many(self, table: bytes, keys: list[bytes]) -> None:
        if table == BLOCKS:
            for key in keys:
                self.delete(table, key)
            return
        self._touch_keys(table, keys)
        delete, db = self.txn.delete, self.store.dbs[table]  # (no Python call per key of ours)
        for key in keys:
            delete(key, db=db)

    def clear(self, table: bytes) -> None:
        """Empty the table (it stays)."""
        if table in _TOUCHING:
            self.touched_all = True
        self.txn.drop(self.store.dbs[table], delete=False)

    def put_block(self, data: bytes) -> bytes:
        """Store one block once, keyed by its blake3 digest; zeros are not stored."""
        return self.put_blocks((data,))[0]

    def put_blocks(self, blocks: Iterable[bytes]) -> list[bytes]:
        """put_block for each, the count of bytes held updated once."""
        digests, stored, raw_run = [], 0, 0
        for data in blocks:
            self.captured += len(data)
            if data == bytes(len(data)):  # (a memcmp; strip(b"\0") walks it byte by byte)
                digests.append(ZERO_BLOCK)
                continue
            digest = blake3.blake3(data).digest()
            if not self._has_block(digest):
                # after RAW_RUN blocks in a row that did not compress (random data, a
                # pack, an image), only every PROBE_EVERY-th is tried: the others go raw
                if raw_run < RAW_RUN or raw_run % PROBE_EVERY == 0:
                    raw = self.store.encode_block(data)
                else:
                    raw = RAW + data
                raw_run = raw_run + 1 if raw[:1] == RAW else 0
                self._put_block(digest, raw)
                self.added += len(data)
                stored += len(raw)
            digests.append(digest)
        if stored:
            self.set_meta_int(BLOCK_BYTES_KEY, self.meta_int(BLOCK_BYTES_KEY) + stored)
            self.stored += stored
        return digests

    def set_meta_int(self, name: bytes, value: int) -> None:
        self.put(META, name, u64(value))

    def next_counter(self, name: bytes, first: int) -> int:
        value = self.meta_int(name, first)
        self.set_meta_int(name, value + 1)
        return value
