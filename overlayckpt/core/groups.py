"""The open automatic groups, as META GROUP_KEY keeps them (journal.append owns them).

{"b": the history index's boundary (the newest checkpoint's position), "g": the open
groups, each [start seq, command pid, last write ns, conversation head, the pids above
the command]}; a store from before concurrent groups keeps one group as
[start, pid, last write ns, head].
"""
from __future__ import annotations

from typing import Any

from overlayckpt.records import pack_obj, unpack_obj
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import GROUP_KEY, META


def open_groups(r: ReadTxn) -> tuple[int, list[list[Any]]]:
    """(the history index's boundary: the newest checkpoint's position, the open groups:
    [start, pid, last write ns, conversation head, the pids above the command])."""
    raw = r.get(META, GROUP_KEY)
    if raw is None:
        return 0, []
    value = unpack_obj(raw)
    if isinstance(value, dict):
        return value["b"], value["g"]
    start, pid, last, *head = value  # (one group, as stores kept it before)
    return start, [[start, pid, last, head[0] if head else None, []]]


def put_groups(w: WriteTxn, boundary: int, groups: list[list[Any]]) -> None:
    if groups:
        w.put(META, GROUP_KEY, pack_obj({"b": boundary, "g": groups}))
    elif w.get(META, GROUP_KEY) is not None:
        w.delete(META, GROUP_KEY)


def open_group_spans(r: ReadTxn) -> list[tuple[int, int]]:
    """(start, pid) of each open group (groupfiles tells their records apart by them)."""
    return [(g[0], g[1]) for g in open_groups(r)[1]]
