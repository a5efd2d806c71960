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

from .helpers_core import ME, content, ino, names

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
