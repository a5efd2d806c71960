"""fuse/forgotten.py: which inodes a GETATTR of a forgotten one publishes to C."""
from __future__ import annotations

from overlayckpt.fuse.forgotten import MOST, RUN, Forgotten


def test_a_run_starts_at_the_inode_asked_and_is_taken_once() -> None:
    f = Forgotten()
    f.add([9, 3, 5])
    f.add(range(100, 100 + 2 * RUN))
    assert f.take(4) == []  # (not forgotten: Python answers it alone)
    assert f.take(5) == [5, 9] + list(range(100, 100 + RUN - 2))
    assert f.take(5) == [] and f.take(100) == []
    rest = list(range(100 + RUN - 2, 100 + 2 * RUN))
    assert f.inodes == [3] + rest
    assert f.take(rest[1]) == rest[1:RUN + 1]  # (RUN at most)
    assert f.take(3) == [3, rest[0], rest[-1]]
    assert f.inodes == []


def test_it_keeps_a_bounded_number() -> None:
    f = Forgotten()
    f.add(range(MOST + 1000))
    f.add([MOST + 5000])
    assert len(f.inodes) == MOST
