"""`overlayckpt stats`: what the running daemon has measured since its mount, as a
table, as JSON (--json: nested objects, so `jq .writes.p99_us` reads one figure) or in
the Prometheus text format (--prometheus: for a node-exporter textfile collector).

What each figure means is said once, in service/stats.py; this module only shows it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from overlayckpt.messages import StatsReply

# (name in the reply, metric, help) of each latency histogram
HISTOGRAMS = (
    ("writes", "write_latency_seconds",
     "Writes to the mount's files, from their arrival at the daemon to its reply."),
    ("capture", "capture_latency_seconds",
     "Writes, from their arrival until their blocks' previous content is kept in the store."),
    ("reads", "read_latency_seconds",
     "Reads of the mount's files that reached the daemon, from arrival to reply."),
    ("fsyncs", "fsync_latency_seconds",
     "Fsyncs of the mount's files (O_DSYNC writes too), from arrival at the daemon to reply."),
    ("checkpoints", "checkpoint_latency_seconds",
     "Checkpoint commands, from their arrival at the daemon to its answer."),
    ("restores", "restore_latency_seconds",
     "Restore commands, from their arrival at the daemon to its answer."),
)
# (metric, help, where in the reply) of the counters
COUNTERS = (
    ("write_errors_total", "Writes answered with an error.", ("writes", "errors")),
    ("writes_acknowledged_early_total",
     "Writes answered before their capture was committed (write-behind).",
     ("writes", "acknowledged_early")),
    ("read_errors_total", "Reads answered with an error.", ("reads", "errors")),
    ("automatic_checkpoints_total", "Automatic checkpoints made.", ("checkpoints", "automatic")),
    ("captured_bytes_total", "Bytes of blocks captured into the store, duplicates included.",
     ("store", "logical_bytes")),
    ("captured_new_bytes_total", "Bytes of captured blocks that were new to the store.",
     ("store", "new_bytes")),
)
GAUGES = (
    ("store_bytes", "Bytes the store takes on disk.", ("store", "bytes")),
    ("store_blocks", "Blocks in the store.", ("store", "blocks")),
    ("store_block_bytes", "Bytes the store's blocks take (compressed).", ("store", "block_bytes")),
    ("store_dedup_ratio", "Bytes captured per byte new to the store, since the mount.",
     ("store", "dedup_ratio")),
)
PREFIX = "overlayckpt_"


def cmd_stats(args: argparse.Namespace) -> int:
    from overlayckpt.cli.target import Target
    if args.json and args.prometheus:
        print("overlayckpt stats: choose one of --json and --prometheus", file=sys.stderr)
        return 2
    from overlayckpt.messages import StatsRequest
    result = Target(args).call(StatsRequest())
    if args.prometheus:
        sys.stdout.write(prometheus(result))
    elif args.json:
        result.pop("histograms", None)
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(text(result))
    return 0


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 10_000:
        return f"{value / 1000:,.1f} ms"
    return f"{value:,.1f} µs" if value < 100 else f"{value:,.0f} µs"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def text(r: StatsReply) -> str:
    from overlayckpt.names import quote_path
    lines = [f"since {r['since']} ({r['uptime_s']:,.1f} s) at {quote_path(r['mountpoint'] or '')}"]
    if not r["requests_timed"]:
        lines.append("(reads and writes are not timed: the C fast path does not serve this mount)")
    lines.append(f"{'':<12}{'count':>9}{'p50':>12}{'p99':>12}{'max':>12}")
    notes = {"writes": f"{r['writes']['acknowledged_early']:,} answered before their capture",
             "capture": f"{r['capture']['after_reply']:,} after their reply",
             "checkpoints": f"and {r['checkpoints']['automatic']:,} automatic"}
    for name in ("writes", "capture", "reads", "fsyncs", "checkpoints", "restores"):
        g = r[name]
        note = notes.get(name, "")
        if g.get("errors"):
            note = f"{note}, {g['errors']:,} failed".lstrip(", ")
        lines.append(f"{name:<12}{g['count']:>9,}{_us(g.get('p50_us')):>12}{_us(g.get('p99_us')):>12}"
                     f"{_us(g.get('max_us')):>12}" + (f"   ({note})" if note else ""))
    st = r["store"]
    dedup = f", dedup {st['dedup_ratio']:.2f}x" if st["dedup_ratio"] else ""
    lines.append(f"store: {_bytes(st['bytes'])} on disk, {st['blocks']:,} blocks; "
                 f"{_bytes(st['logical_bytes'])} captured since mount, "
                 f"{_bytes(st['new_bytes'])} of it new{dedup}")
    return "\n".join(lines)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _num(x: object) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _figure(r: Mapping[str, object], group: str, key: str) -> object:
    """One figure of the reply's group (COUNTERS, GAUGES)."""
    section = r[group]
    return section.get(key) if isinstance(section, Mapping) else None


def prometheus(r: StatsReply) -> str:
    """The text exposition format (version 0.0.4): every metric with HELP and TYPE, each
    histogram with the same buckets at every scrape (powers of two from 1.024 µs to 137 s:
    each counts the values below it exactly), labelled with the mountpoint."""
    from overlayckpt.core.latency import Histogram, power_bounds
    labels = f'mount="{_label(r["mountpoint"] or "")}"'
    out: list[str] = []

    def head(metric: str, kind: str, help_text: str) -> str:
        out.append(f"# HELP {PREFIX}{metric} {help_text}")
        out.append(f"# TYPE {PREFIX}{metric} {kind}")
        return PREFIX + metric

    for name, metric, help_text in HISTOGRAMS:
        raw = r.get("histograms", {})[name]
        h = Histogram.from_sparse(raw["buckets"], raw["sum_ns"], raw["max_ns"])
        full = head(metric, "histogram", help_text)
        below = 0
        counted = 0
        for bound, first_above in power_bounds():
            below += sum(h.counts[counted:first_above])
            counted = first_above
            out.append(f'{full}_bucket{{{labels},le="{_num(bound / 1e9)}"}} {below}')
        out.append(f'{full}_bucket{{{labels},le="+Inf"}} {h.count}')
        out.append(f"{full}_sum{{{labels}}} {_num(h.sum_ns / 1e9)}")
        out.append(f"{full}_count{{{labels}}} {h.count}")
    for metric, help_text, (group, key) in COUNTERS:
        full = head(metric, "counter", help_text)
        out.append(f"{full}{{{labels}}} {_figure(r, group, key)}")
    for metric, help_text, (group, key) in GAUGES:
        value = _figure(r, group, key)
        if value is None:
            continue  # (nothing captured yet: no ratio)
        full = head(metric, "gauge", help_text)
        out.append(f"{full}{{{labels}}} {_num(value)}")
    full = head("uptime_seconds", "gauge", "Seconds since the daemon opened the session.")
    out.append(f"{full}{{{labels}}} {_num(float(r['uptime_s']))}")
    return "\n".join(out) + "\n"
