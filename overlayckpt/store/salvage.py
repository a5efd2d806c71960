"""Salvage of a damaged store (`recover`): every entry LMDB can still read copied into a
new store, then every block any leaf page of data.mdb holds, each kept only if its
blake3 matches its key. recover runs it in a child process: reading damaged pages
through LMDB may crash it.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import blake3
import lmdb

from overlayckpt.store import synced
from overlayckpt.store.lmdbstore import INITIAL_MAP, Store
from overlayckpt.store.txn import DIGEST, PAGE_HEADER, WriteTxn, whole
from overlayckpt.tables import BLOCKS, DERIVED_KEYS, DERIVED_TABLES, META, TABLES


def salvage(src: str, dst: str) -> Iterator[tuple[str, int, str | None]]:
    """Copy every entry LMDB can still read from the damaged store at src into a new
    store at dst, table by table, committing as it goes (so that if the damage crashes
    the reader, what was copied before stays). Yields each table's name, entries
    copied and the error that stopped it."""
    env = lmdb.open(src, readonly=True, lock=False, max_dbs=len(TABLES) + 2,
                    map_size=INITIAL_MAP, readahead=False)
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
        if pgno != pno or flags & 0x3F != 0x02 or not PAGE_HEADER <= lower <= upper <= psize:
            continue  # not a leaf page (or not at its place)
        for i in range((lower - PAGE_HEADER) // 2):
            off = struct.unpack_from("<H", data, base + PAGE_HEADER + 2 * i)[0]
            if not upper <= off <= psize - 8:
                break
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, base + off)
            dsize = lo | hi << 16
            kstart = base + off + 8
            if not DIGEST <= ksize <= DIGEST + 64 or nflags & ~0x01 \
                    or kstart + ksize > base + psize:
                continue
            key = data[kstart:kstart + ksize]
            if nflags & 0x01:  # F_BIGDATA: the value is in overflow pages
                opg = struct.unpack_from("<Q", data, kstart + ksize)[0]
                vstart = opg * psize + PAGE_HEADER
                if not 2 <= opg < npages or vstart + dsize > len(data):
                    continue
                value = data[vstart:vstart + dsize]
            else:
                value = data[kstart + ksize:kstart + ksize + dsize]
            digest, raw = whole(key, value)
            try:
                content = store.decode_block(raw)
            except Exception:  # not a block, or a damaged one
                continue
            if blake3.blake3(content).digest() == digest:
                yield digest, raw
