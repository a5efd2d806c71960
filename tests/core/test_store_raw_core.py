"""Incompressible data is stored raw and costs about its own size (issue 18).

A raw 4 KiB block as one LMDB value (4097 bytes) took two overflow pages, and the
pages each commit copies were not reused until the next sync point: random data
cost ~2-3x its size. Real LMDB, real random bytes, the store's file measured.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import blake3

from overlayckpt.core.maintenance import fsck, gc
from overlayckpt.service.session import Session
from overlayckpt.store.lmdbstore import AUTO_POINT_PAGES, Store
from overlayckpt.store.salvage import salvage
from overlayckpt.store.txn import WriteTxn
from overlayckpt.tables import BLOCKS

from .helpers_core import ME, content, ino

REG = stat.S_IFREG | 0o644
MB = 1 << 20


def test_random_data_grows_the_store_by_at_most_1_1x_its_size(
        open_session: Callable[..., Session], repo: Path) -> None:
    s = open_session(repo)
    ov = s.overlay
    size = 128 * MB  # (a few MB of the store's own pages are there whatever the size)
    written = blake3.blake3()
    before = s.store.disk_bytes()
    i, _ = ov.create(ME, ino(ov, ""), b"pack.bin", REG, 0, 0)
    for off in range(0, size, MB):  # as the kernel hands them over: up to 1 MiB a write
        chunk = os.urandom(MB)
        written.update(chunk)
        ov.write(ME, i, off, chunk)
    s.store.sync()
    growth = s.store.disk_bytes() - before
    # at most 1.1x, plus the pages freed while a sync point was under way (reused by later
    # commits: a writer that far ahead of the disk waits for it)
    held = 4 * AUTO_POINT_PAGES * s.store.psize
    assert growth <= 1.1 * size + held, f"{growth / size:.3f}x"
    # one page per block: its value fills one overflow page exactly
    assert s.store.read(lambda r: r.txn.stat(s.store.dbs[BLOCKS])["overflow_pages"]) == size // 4096
    assert blake3.blake3(content(ov, "pack.bin")).digest() == written.digest()


def test_split_blocks_read_whole_survive_reopen_gc_and_fsck(
        open_session: Callable[..., Session], repo: Path, tmp_path: Path) -> None:
    store = tmp_path / "raw"
    s = open_session(repo, store=store)
    ov = s.overlay
    data = os.urandom(64 * 4096)
    i, _ = ov.create(ME, ino(ov, ""), b"random.bin", REG, 0, 0)
    ov.write(ME, i, 0, data)
    loose = [os.urandom(4096) for _ in range(8)]  # blocks nothing refers to
    loose_digests = s.store.write(lambda w: [w.put_block(b) for b in loose])
    # every block reads back whole, by its digest, through get, block and a scan
    blocks = s.store.read(lambda r: dict(r.range_from(BLOCKS)))
    for d, b in zip(loose_digests, loose):
        assert len(d) == 32 and blocks[d] == b"\0" + b
        assert s.store.read(lambda r: r.block(d)) == b
    assert fsck(s.store)["clean"]
    s = open_session(repo, store=store)  # a reopen reads them the same
    assert content(s.overlay, "random.bin") == data
    assert gc(s.store)["removed_blocks"] == len(loose)
    assert s.store.read(lambda r: [r.get(BLOCKS, d) for d in loose_digests]) == [None] * 8
    # dropped whole: no entry is left that still carries a block's end in its key
    stored = s.store.read(lambda r: [k for k, _ in r.txn.cursor(db=s.store.dbs[BLOCKS])])
    assert len(stored) >= 64 and max(map(len, stored)) > 32  # (the file's blocks are split)
    assert not [k for k in stored if k[:32] in loose_digests]
    assert content(s.overlay, "random.bin") == data


def test_a_raw_block_stored_whole_by_an_older_version_still_reads(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "old"))
    try:
        data = os.urandom(4096)
        digest = blake3.blake3(data).digest()
        # format 2 put raw blocks as one value: _RAW and the block
        store.write(lambda w: w.txn.put(digest, b"\0" + data, db=store.dbs[BLOCKS]))
        assert store.read(lambda r: r.block(digest)) == data
        assert store.write(lambda w: w.put_block(data)) == digest  # found, not stored twice
        assert fsck(store)["clean"]
    finally:
        store.close()


def test_split_blocks_survive_a_salvage_and_an_import_s_put(tmp_path: Path) -> None:
    src = Store.open(str(tmp_path / "src"))
    data = [os.urandom(4096) for _ in range(4)]
    digests = src.write(lambda w: [w.put_block(b) for b in data])
    whole = src.read(lambda r: [r.get(BLOCKS, d) for d in digests])
    src.close()
    assert list(salvage(str(tmp_path / "src"), str(tmp_path / "dst")))  # (recover's copy)
    dst = Store.open(str(tmp_path / "dst"))
    try:
        assert dst.read(lambda r: [r.block(d) for d in digests]) == data
        # a bundle's import puts each block as it reads it: whole; it is stored split, once
        def put_whole(w: WriteTxn) -> None:
            for d, v in zip(digests, whole):
                assert v is not None  # (read from src above, where each is stored)
                w.put(BLOCKS, d, v)
        dst.write(put_whole)
        assert dst.read(lambda r: r.count(BLOCKS)) == 4
        assert dst.read(lambda r: [r.block(d) for d in digests]) == data
        assert fsck(dst)["clean"]
    finally:
        dst.close()
