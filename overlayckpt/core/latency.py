"""Latency histograms for `overlayckpt stats`: log buckets in a fixed array of counters.

The layout is the C library's (fuse/csrc/fastpath.h, struct hist), so that histograms
recorded in C (writes and reads, stats.c) and here (captures, checkpoints, restores)
are read, merged and printed alike. A value of v ns goes to bucket v below 16, else,
with s = v.bit_length() - 4, to bucket s * 8 + (v >> s): 8 buckets per power of two,
each holding values within 12.5% of each other, up to 2^37 ns (137 s; anything longer
goes to the last bucket, and max_ns stays exact). Recording is a few integer
operations, whatever has been recorded before; percentiles are read off the buckets.

Single-threaded: each histogram is recorded by one thread (the request loop's here).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypedDict

SUB_BITS = 3  # fastpath.h HIST_SUB_BITS: 2^SUB_BITS buckets per power of two
BUCKETS = 280  # fastpath.h HIST_BUCKETS: up to 2^37 ns
_SMALL = 2 << SUB_BITS  # values below this have a bucket each
_TOP = BUCKETS - 1


def bucket_of(ns: int) -> int:
    if ns < _SMALL:
        return max(ns, 0)
    shift = ns.bit_length() - (SUB_BITS + 1)
    return min((shift << SUB_BITS) + (ns >> shift), _TOP)


def bucket_low(i: int) -> int:
    """The least value (ns) bucket i holds."""
    if i < _SMALL:
        return i
    shift = (i >> SUB_BITS) - 1
    return (i - (shift << SUB_BITS)) << shift


def bucket_high(i: int) -> int:
    """The first value (ns) above bucket i (the last bucket has no bound: its own)."""
    return bucket_low(i + 1) if i < _TOP else 1 << 62


def power_bounds() -> Iterator[tuple[int, int]]:
    """(2^k ns, the number of buckets below it) for the powers of two from 1.024 µs to
    68.7 s: no bucket straddles one of them, so the counts below each are exact (the
    last bucket also holds every value above its own range)."""
    for k in range(10, 37):
        yield 1 << k, bucket_of(1 << k)


class Histogram:
    """Counts of values in log buckets, their sum, their maximum and how many failed."""

    __slots__ = ("counts", "errors", "max_ns", "sum_ns")

    def __init__(self, counts: list[int] | None = None, sum_ns: int = 0, max_ns: int = 0,
                 errors: int = 0) -> None:
        self.counts = counts if counts is not None else [0] * BUCKETS
        self.sum_ns = sum_ns
        self.max_ns = max_ns
        self.errors = errors

    def record(self, ns: int) -> None:
        # (bucket_of inline, and ifs rather than min/max calls: this runs for every write)
        if ns < _SMALL:
            i = ns if ns > 0 else 0
        else:
            shift = ns.bit_length() - (SUB_BITS + 1)
            i = (shift << SUB_BITS) + (ns >> shift)
            if i > _TOP:
                i = _TOP
        self.counts[i] += 1
        self.sum_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def record_since(self, now: int, starts: Iterable[int]) -> None:
        """record(now - start) for each start that is not 0 (unknown), in one call."""
        record = self.record
        for start in starts:
            if start:
                record(now - start)

    @property
    def count(self) -> int:
        return sum(self.counts)

    @classmethod
    def merged(cls, parts: Iterable[Histogram]) -> Histogram:
        out = cls()
        for h in parts:
            out.counts = [a + b for a, b in zip(out.counts, h.counts)]
            out.sum_ns += h.sum_ns
            out.max_ns = max(out.max_ns, h.max_ns)
            out.errors += h.errors
        return out

    def percentile(self, q: float) -> float | None:
        """The value (ns) at quantile q (0 < q <= 1): the middle of its bucket, within
        the values seen (never above the maximum); None without values."""
        total = self.count
        if not total:
            return None
        rank = max(1, -(-int(q * total * 1_000_000) // 1_000_000))  # ceil, without float dust
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                low, high = bucket_low(i), min(bucket_high(i), self.max_ns + 1)
                return float(min((low + high - 1) / 2, self.max_ns))
        return float(self.max_ns)

    def summary(self, *quantiles: str) -> dict[str, float | int | None]:
        """count, each of quantiles ("p50", "p99") in µs, max_us, sum_us, errors."""
        out: dict[str, float | int | None] = {"count": self.count}
        for name in quantiles:
            ns = self.percentile(int(name[1:]) / 100)
            out[f"{name}_us"] = None if ns is None else round(ns / 1000, 1)
        out["max_us"] = round(self.max_ns / 1000, 3) if out["count"] else None
        out["sum_us"] = round(self.sum_ns / 1000, 3)
        out["errors"] = self.errors
        return out

    def sparse(self) -> list[list[int]]:
        """[bucket, count] of each bucket that holds anything (for a reply)."""
        return [[i, c] for i, c in enumerate(self.counts) if c]

    @classmethod
    def from_sparse(cls, pairs: list[list[int]], sum_ns: int, max_ns: int, errors: int = 0
                    ) -> Histogram:
        counts = [0] * BUCKETS
        for i, c in pairs:
            if not (isinstance(i, int) and isinstance(c, int) and 0 <= i < BUCKETS and c >= 0):
                raise ValueError(f"not a histogram bucket: {i!r}")
            counts[i] += c
        return cls(counts, sum_ns, max_ns, errors)


class RequestLatency(TypedDict):
    """The reply latency of the requests the fast path library times (fuse/fastpath.py
    request_latency), by kind, and how many it could not time."""
    write: Histogram  # stored before their reply
    write_early: Histogram  # acknowledged before they were stored (write-behind)
    read: Histogram
    fsync: Histogram
    read_c: Histogram  # reads of repo files nothing changed, answered from the repo in C
    untimed: int


@dataclass(frozen=True, slots=True)
class Captures:
    """The capture latency of writes, from their arrival until their previous content is
    in the store (committed with them): of those captured before their reply, and of
    those captured after it (acknowledged early: write-behind)."""
    before_reply: Histogram = field(default_factory=Histogram)
    after_reply: Histogram = field(default_factory=Histogram)


class Phases:
    """Milliseconds each phase of a command took, in order (a restore's reply shows them:
    which part of a slow one was the kernel's)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def end(self, phase: str) -> None:
        t = time.perf_counter()
        self.ms[phase] = round((t - self._t) * 1e3, 1)
        self._t = t
