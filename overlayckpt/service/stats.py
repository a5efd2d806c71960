"""The stats command: what the running daemon has measured since its mount.

- writes: reply latency of every write to a file of the live tree that reached the
  daemon, from its arrival off /dev/fuse to its reply, timed in C (fuse/csrc/stats.c)
  whether C answered it early (write-behind) or Python did;
- capture: from a write's arrival until it is committed to the store with the
  previous content of its blocks kept (core/latency.Captures, recorded by the adapter);
  for writes answered early this ends after their reply;
- reads: reply latency of reads of the live tree's files that reached the daemon (the
  kernel's page cache answers the others);
- fsyncs: reply latency of fsync requests on those files (an O_DSYNC write is a write
  and then an fsync: its writer waits for both);
- checkpoints and restores: the checkpoint and restore commands, from their arrival at
  the session to their answer, durability included (Session.command); automatic
  checkpoints are counted, not timed (they come out of writes);
- store: its size and blocks, and the bytes captured since the mount and what of them
  was new to the store.

The answer holds each group's summary, and under "histograms" the buckets behind them
(core/latency.py's layout) for the Prometheus output (cli/stats.py).
"""
from __future__ import annotations

import time

from overlayckpt.core.latency import Histogram
from overlayckpt.errors import UserError
from overlayckpt.messages import StatsReply, StatsRequest
from overlayckpt.records import iso_time
from overlayckpt.service.registry import command
from overlayckpt.service.session import Session
from overlayckpt.tables import BLOCK_BYTES_KEY, BLOCKS


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 3) if b else None


def stats(s: Session) -> StatsReply:
    # (first: a read commits the writes the store deferred, so their captures are in)
    blocks, block_bytes = s.store.read(lambda r: (r.count(BLOCKS), r.meta_int(BLOCK_BYTES_KEY, 0)))
    timed = s.request_stats()
    empty = Histogram()
    writes_late = timed["write"] if timed else empty
    writes_early = timed["write_early"] if timed else empty
    reads = Histogram.merged([timed["read"], timed["read_c"]]) if timed else empty
    fsyncs = timed["fsync"] if timed else empty
    writes = Histogram.merged([writes_late, writes_early])
    captures = Histogram.merged([s.captures.before_reply, s.captures.after_reply])
    checkpoints, restores = s.command_times["checkpoint"], s.command_times["restore"]
    tally = s.store.tally
    automatic = tally.get("checkpoints_auto", 0)
    return {
        "mountpoint": s.mountpoint,
        "since": iso_time(s.opened_ns),
        "uptime_s": round((time.monotonic_ns() - s.opened_mono_ns) / 1e9, 3),
        # False: the C library does not serve this mount, so reads and writes are not timed
        "requests_timed": timed is not None,
        "writes": {**writes.summary("p50", "p99"), "acknowledged_early": writes_early.count},
        "capture": {**captures.summary("p50", "p99"),
                    "after_reply": s.captures.after_reply.count},
        "reads": reads.summary("p50", "p99"),
        "fsyncs": fsyncs.summary("p50", "p99"),
        "checkpoints": {**checkpoints.summary("p50", "p99"), "automatic": automatic},
        "restores": restores.summary("p50", "p99"),
        "store": {
            "bytes": s.store.disk_bytes(),
            "blocks": blocks,
            "block_bytes": block_bytes,
            "logical_bytes": tally["captured_bytes"],
            "new_bytes": tally["new_bytes"],
            "stored_bytes": tally["stored_bytes"],
            "dedup_ratio": _ratio(tally["captured_bytes"], tally["new_bytes"]),
            "compression_ratio": _ratio(tally["new_bytes"], tally["stored_bytes"]),
        },
        "untimed": timed["untimed"] if timed else 0,
        "histograms": {name: {"buckets": h.sparse(), "sum_ns": h.sum_ns, "max_ns": h.max_ns}
                       for name, h in (("writes", writes), ("capture", captures), ("reads", reads), ("fsyncs", fsyncs),
                                       ("checkpoints", checkpoints), ("restores", restores))},
    }


@command(StatsRequest)
async def _stats(s: Session, cmd: StatsRequest) -> StatsReply:
    if s.mountpoint is None:
        raise UserError("stats are kept by a running daemon, since its mount, and this "
                        "session is not mounted: mount it ('overlayckpt mount REPO') first")
    return stats(s)
