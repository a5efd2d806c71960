"""An agent's hooked tool calls and the automatic checkpoints: each call is one, and
the conversation at it ends with that call (in process, no FUSE)."""
from __future__ import annotations

import json
from typing import Any

from overlayckpt.core.conversation import live_lines
from overlayckpt.core.timeline import Timeline
from overlayckpt.messages import FileChange
from overlayckpt.service.session import Session

from .helpers_core import ME, OTHER, ino


def call(s: Session, tool: str, call_id: str) -> None:
    s.conversation_append(json.dumps({"role": "assistant", "tool": tool, "content": "{}", "event": "PreToolUse",
                                      "tool_use_id": call_id}).encode())


def result(s: Session, call_id: str) -> None:
    s.conversation_append(json.dumps({"role": "tool", "content": "ok", "event": "PostToolUse",
                                      "tool_use_id": call_id}).encode())


def autos(s: Session) -> list[Any]:
    Timeline(s.ctx).seal()
    return [c for c in s.store.read(Timeline(s.ctx).all) if c.id > 0]


def conversation_at(s: Session, ck: Any) -> list[str]:
    return [f"{x['event']} {x['tool_use_id']}" for x in s.store.read(lambda r: live_lines(r, ck.conv_head))]


def test_each_call_is_one_checkpoint_whatever_writes_in_it(session: Session) -> None:
    ov = session.overlay
    call(session, "Edit", "t1")
    ov.write(ME, ino(ov, "README.md"), 0, b"1")
    result(session, "t1")
    call(session, "Edit", "t2")  # the same process at once: still a checkpoint of its own
    ov.write(ME, ino(ov, "README.md"), 0, b"2")
    result(session, "t2")
    call(session, "Bash", "t3")  # two processes in one call: one checkpoint
    ov.write(OTHER, ino(ov, "README.md"), 0, b"3")
    ov.write(ME, ino(ov, "run.sh"), 0, b"3")
    result(session, "t3")
    ov.write(OTHER, ino(ov, "run.sh"), 0, b"4")  # after the call, another process: its own
    cks = autos(session)
    assert len(cks) == 4
    # the conversation at each ends with its call: not its result, not the next call
    assert [conversation_at(session, c)[-1] for c in cks] == [
        "PreToolUse t1", "PreToolUse t2", "PreToolUse t3", "PostToolUse t3"]
    assert conversation_at(session, cks[0]) == ["PreToolUse t1"]


def test_without_hooks_a_process_switch_still_ends_a_group(session: Session) -> None:
    ov = session.overlay
    ov.write(ME, ino(ov, "README.md"), 0, b"1")
    ov.write(OTHER, ino(ov, "README.md"), 0, b"2")
    assert len(autos(session)) == 2


def test_commands_writing_at_once_are_a_checkpoint_each(session: Session) -> None:
    """Issue 34: a group another command's write finds open stays open while its command
    runs (and neither runs under the other); it closes where it is found done. Each
    checkpoint's state is the tree at its close, the history index exact at every one
    (fsck at teardown checks the index and the file rows against the journal)."""
    from overlayckpt.core.history import AtCheckpoint
    from overlayckpt.core.journal import Caller

    from .helpers_core import content, put
    running = {5001, 5002}
    a = Caller(5001, "a", (1,), running.__contains__)
    b = Caller(5002, "b", (1,), running.__contains__)
    ov = session.overlay
    put(ov, a, "f.txt", b"a1")
    put(ov, b, "g.txt", b"b1")
    put(ov, a, "f.txt", b"a2")
    running.discard(5001)  # a is done: b's next write closes its group
    put(ov, b, "g.txt", b"b2")
    put(ov, b, "f.txt", b"b3")
    cks = autos(session)
    assert [(c.comm, sorted(f["path"] for f in files(session, c))) for c in cks] == [
        ("a", ["f.txt"]), ("b", ["f.txt", "g.txt"])]

    def at(ck: Any, path: str) -> bytes:
        # (store.read: what live does, with the ReadTxn its fn gets typed as one)
        return ov.store.read(lambda r: ov.read_all(AtCheckpoint(r, ck.seq),
                                                   ov.resolve(AtCheckpoint(r, ck.seq), path)))
    assert (at(cks[0], "f.txt"), at(cks[0], "g.txt")) == (b"a2", b"b1")
    assert (at(cks[1], "f.txt"), at(cks[1], "g.txt")) == (b"b3", b"b2")
    assert content(ov, "g.txt") == b"b2"


def files(s: Session, ck: Any) -> list[FileChange]:
    from overlayckpt.core import groupfiles
    return s.store.read(lambda r: groupfiles.files(r, ck))
