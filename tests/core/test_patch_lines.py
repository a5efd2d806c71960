"""Line matching for diffs and line counts: correct on any input, near-linear on big ones."""
from __future__ import annotations

import random

import pytest

from overlayckpt.core.patch import _opcodes

OPS = ("equal", "replace", "delete", "insert")


def _rebuild(a: list[bytes], b: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    i = j = 0
    for tag, a1, a2, b1, b2 in _opcodes(a, b):
        assert tag in OPS and (a1, b1) == (i, j)
        if tag == "equal":
            assert a[a1:a2] == b[b1:b2]
        out += b[b1:b2]
        i, j = a2, b2
    assert (i, j) == (len(a), len(b))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_opcodes_turn_a_into_b(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([0, 5, 60, 3000])  # 3000: past the direct budget, anchors used
    a = [rng.choice([b"x\n", b"y\n", b"%d\n" % rng.randrange(size or 1)]) for _ in range(size)]
    b = list(a)
    for _ in range(rng.randrange(0, 40)):
        k = rng.random()
        if k < 0.3 and b:
            del b[rng.randrange(len(b))]
        elif k < 0.6:
            b.insert(rng.randrange(len(b) + 1), b"new %d\n" % rng.randrange(50))
        elif b:
            b[rng.randrange(len(b))] = b"z\n"
    assert _rebuild(a, b) == b


def _counts(a: list[bytes], b: list[bytes]) -> tuple[int, int]:
    ops = [op for op in _opcodes(a, b) if op[0] != "equal"]
    return sum(b2 - b1 for _, _, _, b1, b2 in ops), sum(a2 - a1 for _, a1, a2, _, _ in ops)


def test_one_change_among_many_identical_lines_is_one_line() -> None:
    # difflib alone took ~25 s on this (issue 16)
    a = [b"line\n"] * 8000
    b = a[:3999] + [b"changed\n"] + a[4000:]
    assert _counts(a, b) == (1, 1)


def test_big_files_with_scattered_changes_count_exactly() -> None:
    a = [b'  "k%d": %d,\n' % (i, i) for i in range(20000)]  # a lockfile
    b = list(a)
    for i in range(0, 20000, 997):
        b[i] = b"changed %d\n" % i
    assert _counts(a, b) == (21, 21)
    assert _rebuild(a, b) == b
