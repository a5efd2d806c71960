"""Writes that cover whole blocks (stored as one run: Overlay._set_whole_blocks) capture
what they replace and restore exactly, in process over a real store."""
from __future__ import annotations

import random
import stat
from pathlib import Path

from overlayckpt.core.timeline import Timeline
from overlayckpt.records import ROOT_INO, u64
from overlayckpt.service.session import Session
from overlayckpt.store.txn import PROBE_EVERY, RAW_RUN, ZSTD
from overlayckpt.tables import BLOCKS, BMAP

from .helpers_core import ME, content, ino, make_small_repo, names

BS = 4096


async def test_big_writes_over_repo_and_stored_blocks_restore_exactly(session: Session, repo: Path) -> None:
    ov, tl = session.overlay, Timeline(session.ctx)
    path = "docs/guide.txt"
    i = ino(ov, path)
    model = bytearray((repo / path).read_bytes())  # 7 blocks, the last one partial
    assert len(model) > 6 * BS
    states = {tl.checkpoint("repo", None, ME).id: bytes(model)}

    def write(off: int, data: bytes) -> None:
        ov.write(ME, i, off, data)
        model[len(model):off + len(data)] = bytes(max(0, off + len(data) - len(model)))
        model[off:off + len(data)] = data
        assert content(ov, path) == model

    write(2 * BS + 8, b"EDIT")  # a block stored, the others still the repo's
    states[tl.checkpoint("edited", None, ME).id] = bytes(model)
    rng = random.Random(7)
    one, zeros = rng.randbytes(BS), bytes(BS)
    # from inside block 0 to inside block 5: blocks 1-4 whole, among them the edited
    # one, a zero block and the same content twice
    write(100, rng.randbytes(BS - 100) + one + rng.randbytes(BS) + zeros + one + b"tail")
    states[tl.checkpoint("rewritten", None, ME).id] = bytes(model)
    # a new file's blocks: none has a version yet (history.record looks once for all)
    new, _ = ov.create(ME, ino(ov, "docs"), b"new.bin", stat.S_IFREG | 0o644, 0, 0)
    made = rng.randbytes(12 * BS)
    ov.write(ME, new, 0, made)
    write(BS, rng.randbytes(8 * BS))  # stored blocks again, and past the repo's end
    grown = tl.checkpoint("grown", None, ME).id
    states[grown] = bytes(model)
    for ck in [*states, *reversed(states)]:
        await tl.restore(ck, ME)
        assert content(ov, path) == states[ck], ck
        assert ("new.bin" in names(ov, "docs")) == (ck == grown), ck
        if ck == grown:
            assert content(ov, "docs/new.bin") == made


async def test_truncating_a_repo_file_captures_every_block_it_drops(open_session, tmp_path: Path) -> None:
    repo = make_small_repo(tmp_path / "repo")
    rng = random.Random(11)
    # repo blocks of text, of zeros (nothing to keep) and of noise, the last one partial
    original = b"".join([b"x" * BS, bytes(2 * BS), rng.randbytes(5 * BS), b"y" * 100])
    (repo / "blob.bin").write_bytes(original)
    session = open_session(repo)
    ov, tl = session.overlay, Timeline(session.ctx)
    i = ino(ov, "blob.bin")
    ov.write(ME, i, 4 * BS, b"EDIT")  # a block stored
    ov.write(ME, i, 5 * BS, bytes(BS))  # a block stored as zeros, over the repo's noise
    edited = content(ov, "blob.bin")
    before = tl.checkpoint("before", None, ME).id
    ov.setattr(ME, i, size=BS + 10)  # drops blocks 2-8, cuts block 1 (zeros in the repo)
    assert content(ov, "blob.bin") == original[:BS + 10]
    after = tl.checkpoint("after", None, ME).id
    # the repo's blocks of noise the truncate dropped change meanwhile: what was
    # captured counts (its zeros were not captured: they read through, as untouched)
    (repo / "blob.bin").write_bytes(original[:3 * BS] + rng.randbytes(len(original) - 3 * BS))
    await tl.restore(before, ME)
    assert content(ov, "blob.bin") == edited
    await tl.restore(after, ME)
    assert content(ov, "blob.bin") == original[:BS + 10]


def test_compressible_blocks_after_incompressible_ones_are_compressed_again(session: Session) -> None:
    assert RAW_RUN + PROBE_EVERY < 40  # (the run below is long enough to be skipped)
    ov = session.overlay
    i, _ = ov.create(ME, ROOT_INO, b"mixed.bin", stat.S_IFREG | 0o644, 0, 0)
    rng = random.Random(3)
    noise = rng.randbytes(40 * BS)
    text = b"".join(b"".join(b"block %d line %d\n" % (b, n) for n in range(300))[:BS] for b in range(40))
    ov.write(ME, i, 0, noise + text)
    assert content(ov, "mixed.bin") == noise + text

    def codecs(r):  # each block's codec, in block order
        return [r.get(BLOCKS, digest)[:1] for _, digest in r.prefix(BMAP, u64(i))]
    coded = ov.live(codecs)
    assert ZSTD not in coded[:40]
    # raw after RAW_RUN misses, then tried every PROBE_EVERY-th: the text is found
    assert coded[40 + PROBE_EVERY:] == [ZSTD] * (40 - PROBE_EVERY)
