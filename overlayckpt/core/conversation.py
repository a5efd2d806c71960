"""The conversation sidecar: an append-only log of what the agent was told and did.

Lines live in the `conv` table under increasing keys; each stores the key of
the line before it on its branch (`prev`), so the live branch is the chain
ending at `meta.conv_head`. Every checkpoint records the head at its time;
restoring the conversation to a checkpoint moves the head back to it. Later
lines stay in the table as an abandoned branch, never deleted. What is written to
conversation.jsonl becomes a line in agents/lines.py.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from overlayckpt.core.journal import close_open_group, hold_for_call, next_seq, now_ns
from overlayckpt.messages import ConversationLine as Line
from overlayckpt.records import from_u64, iso_time, pack_obj, u64, unpack_obj
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import CONV, CONV_HEAD_KEY, CONV_NEXT_KEY


def append(w: WriteTxn, obj: Line) -> int:
    if starts_a_call(obj):  # what was written before the call is not the call's checkpoint
        close_open_group(w)
    hold_for_call(w, starts_a_call(obj))  # any other line: the call has ended
    key = w.next_counter(CONV_NEXT_KEY, 1)
    head = w.meta_int(CONV_HEAD_KEY, 0)
    entry = dict(obj)
    entry["_seq"] = next_seq(w)
    entry["_time"] = now_ns()
    entry["_prev"] = head
    w.put(CONV, u64(key), pack_obj(entry), append=True)
    w.set_meta_int(CONV_HEAD_KEY, key)
    return key


def starts_a_call(obj: Line) -> bool:
    """An agent's tool call, logged by its hook before it runs. (Lines written by hand
    may come before or after their changes: they never split or hold a group.)"""
    return obj.get("event") == "PreToolUse"


def append_line(store: Store, obj: Line) -> None:
    """Store a line as agents.lines.parse_line made it of what was written to the sidecar."""
    store.write(lambda w: append(w, obj))


def stamp(entry: Line, key: str) -> int:
    """One of the stamps append gives every stored line (_seq, _time, _prev)."""
    value = entry.get(key)
    return value if isinstance(value, int) else 0


def _public(key: int, entry: Line, live: bool | None = None) -> Line:
    out = {k: v for k, v in entry.items() if not k.startswith("_")}
    out["line"] = key
    out["seq"] = entry["_seq"]
    out["time"] = iso_time(stamp(entry, "_time"))
    if live is not None:
        out["live"] = live
    return out


def chain(r: ReadTxn, head: int) -> list[tuple[int, Line]]:
    """The branch ending at head, oldest first."""
    out = list(_back_from(r, head))
    out.reverse()
    return out


def live_lines(r: ReadTxn, head: int | None = None) -> list[Line]:
    if head is None:
        head = r.meta_int(CONV_HEAD_KEY, 0)
    return [_public(k, e) for k, e in chain(r, head)]


def all_lines(r: ReadTxn) -> list[Line]:
    live = {k for k, _ in chain(r, r.meta_int(CONV_HEAD_KEY, 0))}
    return [_public(from_u64(k), unpack_obj(v), from_u64(k) in live)
            for k, v in r.range_from(CONV)]


def live_text(store: Store) -> bytes:
    lines = store.read(live_lines)
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def live_text_after(store: Store, known: tuple[int, bytes] | None) -> tuple[int, bytes]:
    """(head, live_text) from known, an earlier (head, text): lines are never changed, so
    when the live branch grew from known's head only the lines since are read (a hook's
    append, then the kernel's getattr of the file: O(1), not a pass over the history);
    after a restore moved the head elsewhere, the branch is read whole."""
    def read(r: ReadTxn) -> tuple[int, bytes]:
        head = r.meta_int(CONV_HEAD_KEY, 0)
        if known is not None and known[0] == head:
            return known
        new: list[tuple[int, Line]] = []
        base = b""
        for key, entry in _back_from(r, head):
            if known is not None and key == known[0]:
                base = known[1]
                break
            new.append((key, entry))
        new.reverse()
        return head, base + "".join(json.dumps(_public(k, e)) + "\n" for k, e in new).encode()
    return store.read(read)


def move_head(w: WriteTxn, head: int) -> None:
    w.set_meta_int(CONV_HEAD_KEY, head)


def summary_before(r: ReadTxn, start_seq: int, seq: int, head: int) -> str | None:
    """A checkpoint's summary from the conversation: the latest tool call or assistant
    message that arrived while its changes were made (start_seq <= line < seq).

    A tool's result never is one (its call names the step). A turn's final message
    (Stop) looks back: it sums up the changes before it (start_seq < line <= seq),
    so it is the summary of the checkpoint its turn ended in when no tool call is,
    never of whatever changes next.
    """
    last_word = _last_word_after(r, head, start_seq, seq)
    for _key, entry in _back_from(r, head):
        line_seq = stamp(entry, "_seq")
        if line_seq > seq:
            continue
        if line_seq < start_seq:
            break
        if entry.get("role") == "tool":
            continue
        if entry.get("event") == "Stop":
            if line_seq > start_seq and last_word is None:
                last_word = _first_line(entry.get("content"))[:120] or None
            continue
        if line_seq == seq:  # arrived after these changes: it belongs to the next step
            continue
        if entry.get("summary"):
            return str(entry["summary"])[:120]
        if entry.get("tool"):
            return f"{entry['tool']}: {_first_line(entry.get('content'))}"[:120]
        if entry.get("role") == "assistant":
            return _first_line(entry.get("content"))[:120]
    return last_word


def _back_from(r: ReadTxn, head: int) -> Iterator[tuple[int, Line]]:
    """The branch ending at head as (key, line), newest first, read only as far as the
    caller goes (a log row looks at the lines of its own group, not the whole conversation)."""
    key = head
    while key:
        raw = r.get(CONV, u64(key))
        if raw is None:
            return
        entry: Line = unpack_obj(raw)
        yield key, entry
        key = stamp(entry, "_prev")


def _last_word_after(r: ReadTxn, head: int, start_seq: int, seq: int) -> str | None:
    """A turn's final message logged after a checkpoint's last change (so past its
    conversation head) but before the checkpoint closed: the lines that follow head on
    its branch with start_seq < _seq <= seq. Lines from before the group began are not
    its own: after a restore --both they are the abandoned branch, which chains from the
    very head the restore moved back to (issue 34)."""
    word = None
    tip = head
    for k, v in r.range_from(CONV, u64(head + 1)):
        entry: Line = unpack_obj(v)
        if stamp(entry, "_seq") > seq:
            break  # keys and seqs grow together: no later line is earlier
        if stamp(entry, "_seq") <= start_seq:
            continue  # logged before this group's first change: another branch's
        if stamp(entry, "_prev") != tip:
            continue  # another branch
        tip = from_u64(k)
        if entry.get("event") == "Stop":
            word = _first_line(entry.get("content"))[:120] or None
    return word


def _first_line(content: Any) -> str:
    text = content if isinstance(content, str) else json.dumps(content)
    return text.strip().splitlines()[0] if text.strip() else ""
