"""What a checkpoint shows in the log and in an exported commit: its net file changes
and a one-line summary (from the conversation, the message, or the files)."""
from __future__ import annotations

import os
from typing import Any

from overlayckpt.core.conversation import summary_before
from overlayckpt.core.journal import records
from overlayckpt.records import Checkpoint, iso_time
from overlayckpt.store.lmdbstore import ReadTxn


def collapse(recs: list[Any]) -> list[dict[str, str]]:
    """Per path, the net change of a run of journal records (A M D R)."""
    net: dict[str, str] = {}
    for rec in recs:
        for path, change in zip(rec.paths, rec.changes):
            if change == "<":
                before = net.pop(path, None)
                net[path] = "D" if before != "A" else "gone"
                continue
            before = net.get(path)
            if before == "A" and change == "D":
                net[path] = "gone"
            elif before in ("A",) and change in ("M", "R"):
                pass
            elif before == "D" and change in ("A", "R"):
                net[path] = "M"
            elif before == "gone" and change == "A":
                net[path] = "A"
            else:
                net[path] = change if before is None or change != "M" else before
    return [{"path": p, "change": c} for p, c in sorted(net.items()) if c != "gone"]


def checkpoint_entry(r: ReadTxn, ck: Checkpoint) -> dict[str, Any]:
    recs = records(r, ck.start_seq, ck.seq)
    files = collapse(recs) if ck.kind != "restore" else [
        {"path": p, "change": "M"} for p in (recs[0].paths if recs else ())]
    summary = summary_before(r, ck.start_seq, ck.seq, ck.conv_head) if ck.kind != "restore" else None
    if ck.kind == "restore":
        summary = f"restored checkpoint {ck.restored_from}"
    if not summary:
        summary = ck.message or describe(files) or ("session start" if ck.id == 0 else "no net changes")
    return {
        "id": ck.id, "seq": ck.seq, "time": iso_time(ck.time_ns), "kind": ck.kind, "name": ck.name,
        "message": ck.message, "summary": summary, "files": files,
        "process": {"pid": ck.pid, "comm": ck.comm}, "restored_from": ck.restored_from,
    }


def describe(files: list[dict[str, str]]) -> str:
    words = {"A": "added", "M": "modified", "D": "deleted", "R": "renamed"}
    by: dict[str, list[str]] = {}
    for f in files:
        by.setdefault(words.get(f["change"], "changed"), []).append(os.path.basename(f["path"]))
    parts = []
    for verb, names in by.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{verb} {shown}")
    return "; ".join(parts)
