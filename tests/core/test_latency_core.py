"""The latency histogram of `overlayckpt stats` (core/latency.py), in process: its buckets,
its percentiles and merging; and the store's capture tallies."""
from __future__ import annotations

import random
import stat
from collections.abc import Callable
from pathlib import Path

from overlayckpt.core.latency import (
    BUCKETS,
    Histogram,
    bucket_high,
    bucket_low,
    bucket_of,
    power_bounds,
)
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session
from overlayckpt.store.txn import WriteTxn

from .helpers_core import ME, ino


def test_every_value_lands_in_a_bucket_that_holds_it() -> None:
    rng = random.Random(7)
    values = list(range(300)) + [rng.randrange(1, 10**11) for _ in range(5000)]
    values += [(1 << k) + d for k in range(4, 37) for d in (-1, 0, 1)]
    for v in values:
        i = bucket_of(v)
        assert 0 <= i < BUCKETS
        assert bucket_low(i) <= v < bucket_high(i), v
        # 8 buckets per power of two: a bucket's values are within 12.5% of each other
        assert bucket_high(i) - bucket_low(i) <= max(1, bucket_low(i) // 8)


def test_buckets_tile_the_range_in_order() -> None:
    for i in range(BUCKETS - 1):
        assert bucket_high(i) == bucket_low(i + 1) > bucket_low(i)
        assert bucket_of(bucket_low(i)) == i
    assert bucket_low(BUCKETS - 1) < 2**37 <= bucket_low(BUCKETS - 1) * 16 // 15
    assert bucket_of(10**13) == BUCKETS - 1  # beyond the range: the last bucket


def test_power_bounds_split_no_bucket() -> None:
    bounds = list(power_bounds())
    assert bounds[0][0] == 1024 and bounds[-1][0] == 2**36
    for bound, below in bounds:
        assert bucket_low(below) == bound  # the buckets below hold exactly the values < bound


def test_counts_sum_max_and_errors_are_exact() -> None:
    h = Histogram()
    values = [5, 1_000, 1_001, 250_000, 3_000_000, 3_000_001, 99_000_000_000]
    for v in values:
        h.record(v)
    assert h.count == len(values)
    assert h.sum_ns == sum(values)
    assert h.max_ns == max(values)
    s = h.summary("p50", "p99")
    assert s["count"] == 7 and s["max_us"] == 99_000_000.0 and s["errors"] == 0


def test_percentiles_within_a_bucket_of_the_exact_ones() -> None:
    rng = random.Random(3)
    values = sorted(int(rng.lognormvariate(11, 1.5)) for _ in range(20_000))
    h = Histogram()
    for v in values:
        h.record(v)
    for q in (0.5, 0.9, 0.99, 0.999, 1.0):
        exact = values[max(0, -(-int(q * len(values)) // 1) - 1)]
        got = h.percentile(q)
        assert got is not None
        assert abs(got - exact) <= exact / 8 + 1, (q, got, exact)
        assert got <= h.max_ns  # never above what was seen


def test_empty_and_single() -> None:
    h = Histogram()
    assert h.percentile(0.5) is None
    assert h.summary("p50")["p50_us"] is None and h.summary("p50")["max_us"] is None
    h.record(1234)
    p50, p99 = h.percentile(0.5), h.percentile(0.99)
    assert p50 is not None and p99 is not None
    assert p50 == p99 <= 1234
    assert p50 >= bucket_low(bucket_of(1234))


def test_merged_and_sparse_round_trip() -> None:
    a, b = Histogram(), Histogram()
    for v in range(0, 100_000, 7):
        a.record(v)
    for v in range(50, 2_000_000, 13):
        b.record(v)
    b.errors = 3
    m = Histogram.merged([a, b])
    assert m.count == a.count + b.count and m.sum_ns == a.sum_ns + b.sum_ns
    assert m.max_ns == b.max_ns and m.errors == 3
    back = Histogram.from_sparse(m.sparse(), m.sum_ns, m.max_ns, m.errors)
    assert back.counts == m.counts


def test_store_tallies_what_it_captured(repo: Path, open_session: Callable[..., Session]) -> None:
    s = open_session(repo)
    ov = s.overlay
    bs = ov.bs
    # a new file: a write to a repo file also keeps the repo's block it replaces
    target = ov.create(ME, ROOT_INO, b"new.bin", stat.S_IFREG | 0o644, 0, 0)[0]
    before = dict(s.store.tally)
    block = bytes(range(256)) * (bs // 256)
    ov.write(ME, target, 0, block)
    ov.write(ME, target, bs, block)  # the same content again: no new block
    ov.write(ME, target, 2 * bs, bytes(bs))  # zeros are never stored
    t = s.store.tally
    assert t["captured_bytes"] - before["captured_bytes"] == 3 * bs
    assert t["new_bytes"] - before["new_bytes"] == bs
    assert 0 < t["stored_bytes"] - before["stored_bytes"] < bs  # (compressible)


def test_the_repo_block_a_write_replaces_is_captured(repo: Path,
                                                     open_session: Callable[..., Session]) -> None:
    s = open_session(repo)
    ov = s.overlay
    before = s.store.tally["captured_bytes"]
    ov.write(ME, ino(ov, "docs/guide.txt"), 0, b"x" * ov.bs)
    assert s.store.tally["captured_bytes"] - before == 2 * ov.bs  # the old block and the new


def test_a_failed_transaction_tallies_nothing(repo: Path, open_session: Callable[..., Session]) -> None:
    s = open_session(repo)
    before = dict(s.store.tally)

    def fail(w: WriteTxn) -> None:
        w.put_block(b"x" * 4096)
        raise RuntimeError("rolled back")
    try:
        s.store.write(fail)
    except RuntimeError:
        pass
    assert s.store.tally == before


def test_checkpoints_made_are_tallied_by_kind(repo: Path, open_session: Callable[..., Session]) -> None:
    from overlayckpt.core.timeline import Timeline
    s = open_session(repo)
    ov = s.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"changed")
    Timeline(s.ctx).checkpoint("one", None, ME)  # seals the open group first: one automatic
    Timeline(s.ctx).checkpoint(None, None, ME)
    assert s.store.tally.get("checkpoints_named") == 2
    assert s.store.tally.get("checkpoints_auto") == 1


def test_record_since_is_record() -> None:
    a, b = Histogram(), Histogram()
    now = 10**12
    starts = [now - v for v in (0, 3, 17, 5000, 7 * 10**9, 10**12 - 1)] + [0]
    b.record_since(now, starts)
    for s in starts:
        if s:
            a.record(now - s)
    assert (a.counts, a.sum_ns, a.max_ns) == (b.counts, b.sum_ns, b.max_ns)
