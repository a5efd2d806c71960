"""`overlayckpt stats` on a real mount: exact counts for a scripted workload, the JSON
keys, the Prometheus text format, and latency never above what the client measured.

The mount has no writeback cache (fuse/ops.py), so each 4 KiB pwrite at a page offset
reaches the daemon as one write request, and an O_DSYNC one as a write and then an
fsync. Reads go through O_DIRECT, so that the page cache answers none of them: each
4 KiB pread is one read request.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import time
from pathlib import Path
from typing import Any

from conftest import Mount, run_cli

PAGE = 4096
N_WRITES = 40
N_DSYNC = 10
N_READS = 25
N_CHECKPOINTS = 3

KEYS = {
    "writes": ("count", "p50_us", "p99_us", "max_us"),
    "capture": ("count", "p50_us", "p99_us", "max_us"),
    "checkpoints": ("count", "p50_us", "p99_us"),
    "restores": ("count", "p50_us"),
    "reads": ("count", "p50_us", "p99_us"),
    "store": ("bytes", "blocks", "logical_bytes", "dedup_ratio"),
}


def stats(m: Mount) -> dict[str, Any]:
    return json.loads(m.cli("stats", "--json").stdout)


def timed_writes(path: Path, count: int, flags: int = 0) -> list[int]:
    """count 4 KiB pwrites at page offsets of a new file: each one's time, as the
    writing process sees it (ns)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | flags, 0o644)
    took = []
    try:
        for i in range(count):
            data = os.urandom(PAGE)
            start = time.perf_counter_ns()
            os.pwrite(fd, data, i * PAGE)
            took.append(time.perf_counter_ns() - start)
    finally:
        os.close(fd)
    return took


def direct_reads(path: Path, count: int) -> None:
    buf = mmap.mmap(-1, PAGE)  # (page-aligned, as O_DIRECT wants)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for i in range(count):
            assert os.preadv(fd, [buf], (i % N_WRITES) * PAGE) == PAGE
    finally:
        os.close(fd)


def test_counts_are_exact_and_latency_never_above_the_clients(mounted: Mount) -> None:
    m = mounted
    before = stats(m)
    assert before["requests_timed"], "the fast path library should serve the mount"
    for group in ("writes", "capture", "reads", "checkpoints", "restores"):
        assert before[group]["count"] == 0, (group, before[group])

    plain = timed_writes(m.mnt / "plain.bin", N_WRITES)
    after_plain = stats(m)
    assert after_plain["writes"]["count"] == N_WRITES
    assert after_plain["writes"]["max_us"] * 1000 <= max(plain)
    assert after_plain["writes"]["sum_us"] * 1000 <= sum(plain)

    dsync = timed_writes(m.mnt / "dsync.bin", N_DSYNC, os.O_DSYNC)
    after_dsync = stats(m)
    assert after_dsync["writes"]["count"] == N_WRITES + N_DSYNC
    assert after_dsync["fsyncs"]["count"] == N_DSYNC  # each O_DSYNC write: a write, an fsync
    assert after_dsync["writes"]["max_us"] * 1000 <= max(plain + dsync)
    # what the daemon took for the O_DSYNC writes, their fsyncs included, is part of
    # what their writer waited
    daemon_us = (after_dsync["writes"]["sum_us"] - after_plain["writes"]["sum_us"]
                 + after_dsync["fsyncs"]["sum_us"])
    assert daemon_us * 1000 <= sum(dsync)

    direct_reads(m.mnt / "plain.bin", N_READS)
    for i in range(N_CHECKPOINTS):
        m.cli("checkpoint", f"step-{i}")
    m.cli("restore", "step-0")

    s = stats(m)
    assert s["writes"]["count"] == N_WRITES + N_DSYNC
    assert s["writes"]["errors"] == 0
    assert s["capture"]["count"] == N_WRITES + N_DSYNC  # each write captured once
    assert s["capture"]["after_reply"] == s["writes"]["acknowledged_early"]
    assert s["reads"]["count"] == N_READS
    assert s["checkpoints"]["count"] == N_CHECKPOINTS
    assert s["restores"]["count"] == 1
    assert s["writes"]["max_us"] * 1000 <= max(plain + dsync)
    for group, keys in KEYS.items():
        for key in keys:
            assert key in s[group], f"{group}.{key} missing"
    for group in ("writes", "capture", "reads", "checkpoints"):
        g = s[group]
        assert 0 < g["p50_us"] <= g["p99_us"] <= g["max_us"], (group, g)
    assert 0 < s["restores"]["p50_us"]
    st = s["store"]
    # every block written, and the blocks they replaced (none here: new files)
    assert st["logical_bytes"] >= (N_WRITES + N_DSYNC) * PAGE
    assert st["new_bytes"] == (N_WRITES + N_DSYNC) * PAGE  # random pages: nothing shared
    assert st["dedup_ratio"] >= 1.0
    assert st["blocks"] >= N_WRITES + N_DSYNC and st["bytes"] > 0
    assert "histograms" not in s  # (the Prometheus output's, not the JSON's)

    prom = parse_prometheus(m.cli("stats", "--prometheus").stdout)
    later = stats(m)  # (nothing ran in between: the same counts)
    for group, metric in (("writes", "write_latency_seconds"), ("reads", "read_latency_seconds"),
                          ("capture", "capture_latency_seconds"),
                          ("checkpoints", "checkpoint_latency_seconds"),
                          ("restores", "restore_latency_seconds")):
        assert prom[f"overlayckpt_{metric}"]["count"] == later[group]["count"], group
    assert prom["overlayckpt_store_blocks"]["value"] == later["store"]["blocks"]


def test_writes_python_answers_are_counted_and_timed_too(mounted: Mount) -> None:
    """Page writeback (a shared mapping's pages) is never answered early: Python stores
    each such write before its reply, and C times it until then."""
    m = mounted
    pages = 3
    path = m.mnt / "mapped.bin"
    path.write_bytes(bytes(pages * PAGE))  # (one write, answered early)
    before = stats(m)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, pages * PAGE) as mapped:
            for i in range(pages):
                mapped[i * PAGE:(i + 1) * PAGE] = os.urandom(PAGE)
                mapped.flush(i * PAGE, PAGE)  # msync: this page alone, one write request
    finally:
        os.close(fd)
    after = stats(m)
    assert after["writes"]["count"] - before["writes"]["count"] == pages
    assert after["writes"]["acknowledged_early"] == before["writes"]["acknowledged_early"]
    assert after["capture"]["count"] - before["capture"]["count"] == pages
    assert after["capture"]["after_reply"] == before["capture"]["after_reply"]
    assert after["writes"]["sum_us"] > before["writes"]["sum_us"]


def test_text_output_names_every_group(mounted: Mount) -> None:
    out = mounted.cli("stats").stdout
    for word in ("writes", "capture", "reads", "fsyncs", "checkpoints", "restores", "store:"):
        assert re.search(rf"^{word}", out, re.MULTILINE), word


def test_outside_a_mount_one_line(tmp_path: Path, mounted: Mount) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OVERLAYCKPT_MOUNT"}
    for args in (("stats",), ("stats", "--json"), ("--store", str(tmp_path / "none"), "stats"),
                 ("--mount", str(tmp_path), "stats", "--prometheus")):
        proc = run_cli(*args, check=False, cwd=str(tmp_path), env=env)
        assert proc.returncode == 1, (args, proc)
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("overlayckpt: "), (args, proc.stderr)
    both = mounted.cli("stats", "--json", "--prometheus", check=False)
    assert both.returncode == 2 and len(both.stderr.strip().splitlines()) == 1


def test_an_unmounted_session_says_mount_it(mounted: Mount) -> None:
    run_cli("unmount", str(mounted.mnt))
    proc = run_cli("--store", str(mounted.store), "stats", check=False)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "mount" in proc.stderr


# -- a parser of the Prometheus text exposition format (0.0.4), as strict as we need ------

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
SAMPLE = re.compile(rf"^({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? (\S+)$")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


def _labels(text: str | None) -> dict[str, str]:
    out = {}
    for match in re.finditer(rf"({NAME})=\"((?:[^\"\\\n]|\\\\|\\\"|\\n)*)\"", text or ""):
        out[match.group(1)] = match.group(2)
    return out


def _family(name: str, types: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and types.get(name[:-len(suffix)]) == "histogram":
            return name[:-len(suffix)]
    return name


def parse_prometheus(text: str) -> dict[str, dict[str, Any]]:
    """Each metric family: for histograms its buckets, sum and count (checked: le rising,
    cumulative counts never falling, the last +Inf and equal to _count); else its value.
    Fails on anything outside the grammar."""
    assert text.endswith("\n")
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    families: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            match = re.match(rf"^# (HELP|TYPE) ({NAME}) (.+)$", line)
            assert match, f"bad comment line: {line!r}"
            kind, name, rest = match.groups()
            assert name not in families, f"{kind} of {name} after its samples"
            if kind == "HELP":
                assert name not in helps, f"second HELP of {name}"
                helps[name] = rest
            else:
                assert rest in TYPES and name not in types, line
                types[name] = rest
            continue
        match = SAMPLE.match(line)
        assert match, f"bad sample line: {line!r}"
        name, labels, value = match.groups()
        family = _family(name, types)
        assert family in types and family in helps, f"{name} without HELP and TYPE before it"
        assert family.startswith("overlayckpt_"), family
        number = float(value)  # (raises on anything but a number, +Inf, -Inf, NaN)
        lab = _labels(labels)
        assert "mount" in lab
        f = families.setdefault(family, {"type": types[family], "buckets": []})
        if types[family] == "counter":
            assert family.endswith("_total") and number >= 0, line
        if types[family] == "histogram":
            if name.endswith("_bucket"):
                f["buckets"].append((float(lab["le"]), number))
            else:
                f[name[len(family) + 1:]] = number
        else:
            f["value"] = number
    for family, f in families.items():
        if f["type"] != "histogram":
            continue
        les = [le for le, _ in f["buckets"]]
        counts = [c for _, c in f["buckets"]]
        assert les == sorted(les) and len(set(les)) == len(les), family
        assert math.isinf(les[-1]), f"{family}: no +Inf bucket"
        assert all(a <= b for a, b in zip(counts, counts[1:])), f"{family}: buckets fall"
        assert counts[-1] == f["count"], f"{family}: +Inf bucket is not _count"
        assert f["sum"] >= 0
    for name, kind in types.items():
        assert name in families or kind == "gauge", f"{name} declared, no samples"
    return families


def test_the_parser_refuses_what_a_scraper_would() -> None:
    good = ('# HELP overlayckpt_x_seconds x\n# TYPE overlayckpt_x_seconds histogram\n'
            'overlayckpt_x_seconds_bucket{mount="/m",le="1.0"} 1\n'
            'overlayckpt_x_seconds_bucket{mount="/m",le="+Inf"} 2\n'
            'overlayckpt_x_seconds_sum{mount="/m"} 3.5\noverlayckpt_x_seconds_count{mount="/m"} 2\n')
    assert parse_prometheus(good)["overlayckpt_x_seconds"]["count"] == 2
    for bad in (good.replace('le="+Inf"} 2', 'le="+Inf"} 3'),  # +Inf is not _count
                good.replace('le="1.0"} 1', 'le="1.0"} 5'),  # buckets fall
                good.replace("# TYPE overlayckpt_x_seconds histogram\n", ""),  # no TYPE
                good.replace('mount="/m"}', 'mount=/m}', 1)):  # bad label
        try:
            parse_prometheus(bad)
        except (AssertionError, ValueError):
            continue
        raise AssertionError(f"accepted:\n{bad}")
