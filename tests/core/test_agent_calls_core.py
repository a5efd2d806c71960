"""An agent's hooked tool calls and the automatic checkpoints: each call is one, and
the conversation at it ends with that call (in process, no FUSE)."""
from __future__ import annotations

import json
from typing import Any

from overlayckpt.core.conversation import live_lines
from overlayckpt.core.timeline import Timeline
from overlayckpt.service.session import Session

from .helpers_core import ME, OTHER, ino


def call(s: Session, tool: str, call_id: str) -> None:
    s.conversation_append(json.dumps({"role": "assistant", "tool": tool, "content": "{}", "event": "PreToolUse",
                                      "tool_use_id": call_id}).encode())


def result(s: Session, call_id: str) -> None:
    s.conversation_append(json.dumps({"role": "tool", "content": "ok", "event": "PostToolUse",
                                      "tool_use_id": call_id}).encode())


def autos(s: Session) -> list[Any]:
    Timeline(s).seal()
    return [c for c in s.store.read(Timeline(s).all) if c.id > 0]


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
