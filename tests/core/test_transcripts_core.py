"""Gemini CLI's and qwen-code's own sessions cut back to a checkpoint (issue 34): their
hooks name no call the transcript knows, so the cut goes by position, the order of the
calls in a batch and the times of the hook lines and of the results.

The transcripts are shaped as the 0.61.0 and 0.15.10 CLIs write them (records as their
chat recording services append them); the conversation lines as our hooks log them.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest

from overlayckpt.agents.transcripts import resume_command

T0 = datetime.datetime(2026, 12, 1, 10, 0, 0, tzinfo=datetime.UTC)


def at(seconds: float) -> str:
    """A time the agent writes (ISO 8601, Z) seconds after T0."""
    return (T0 + datetime.timedelta(seconds=seconds)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def logged(seconds: float) -> str:
    """A time as the daemon stamps a conversation line."""
    return (T0 + datetime.timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


def hook_lines(agent: str, path: str) -> list[dict[str, Any]]:
    """Prompt at 1 s; a batch of two calls A (2-3 s) and B (4-5 s), recorded done at 6 s;
    a call C alone (8-9 s), done at 10 s; the turn's end at 12 s."""
    base: dict[str, Any] = {"agent": agent, "session_id": "s", "transcript_path": path}
    out = [dict(base, role="user", event="UserPromptSubmit", content="fix the greeting", time=logged(1))]
    for name, start in (("A", 2), ("B", 4), ("C", 8)):
        out.append(dict(base, role="assistant", event="PreToolUse", tool="replace", content=name,
                        summary=f"replace {name}", tool_use_id=None if agent == "gemini" else f"toolu_{start}",
                        time=logged(start)))
        out.append(dict(base, role="tool", event="PostToolUse", tool="replace", content="ok",
                        tool_use_id=None if agent == "gemini" else f"toolu_{start}", time=logged(start + 1)))
    out.append(dict(base, role="assistant", event="Stop", content="Done.", time=logged(12)))
    return out


def gemini_call(name: str, done: float) -> dict[str, Any]:
    return {"id": f"call-{name}", "name": "replace", "args": {"file_path": f"/m/{name}"},
            "result": [{"functionResponse": {"id": f"call-{name}", "name": "replace",
                                             "response": {"output": "ok"}}}],
            "status": "success", "timestamp": at(done), "displayName": "Edit"}


def gemini_session(merged: bool) -> list[dict[str, Any]]:
    """merged: the model's second turn has no text, so Gemini adds call C to the first
    turn's message (recordToolCalls merges into the last gemini message)."""
    records: list[dict[str, Any]] = [
        {"sessionId": "g-1", "projectHash": "h", "startTime": at(0), "lastUpdated": at(0), "kind": "main"},
        {"id": "u1", "timestamp": at(0.5), "type": "user", "content": [{"text": "fix the greeting"}]},
        {"$set": {"lastUpdated": at(0.5)}},
        {"id": "m1", "timestamp": at(1.5), "type": "gemini", "content": "I will edit.", "thoughts": [],
         "tokens": None, "model": "x"},
        {"id": "m1", "timestamp": at(1.5), "type": "gemini", "content": "I will edit.", "model": "x",
         "toolCalls": [gemini_call("A", 6), gemini_call("B", 6)]},
        {"$set": {"lastUpdated": at(6)}},
    ]
    if merged:
        records.append({"id": "m1", "timestamp": at(1.5), "type": "gemini", "content": "I will edit.",
                        "model": "x", "toolCalls": [gemini_call("A", 6), gemini_call("B", 6), gemini_call("C", 10)]})
    else:
        records += [{"id": "m2", "timestamp": at(7), "type": "gemini", "content": "Now C.", "model": "x"},
                    {"id": "m2", "timestamp": at(7), "type": "gemini", "content": "Now C.", "model": "x",
                     "toolCalls": [gemini_call("C", 10)]}]
    records += [{"$set": {"lastUpdated": at(10)}},
                {"id": "m3", "timestamp": at(11), "type": "gemini", "content": "Done.", "model": "x"}]
    return records


def qwen_session() -> list[dict[str, Any]]:
    def rec(uuid: str, parent: str | None, kind: str, t: float, **extra: Any) -> dict[str, Any]:
        return {"uuid": uuid, "parentUuid": parent, "sessionId": "q-1", "timestamp": at(t), "type": kind,
                "cwd": "/m", "version": "0.15.10", **extra}

    def call(name: str) -> dict[str, Any]:
        return {"functionCall": {"id": f"call_{name}", "name": "edit", "args": {"file_path": f"/m/{name}"}}}

    def result(uuid: str, parent: str, name: str, t: float) -> dict[str, Any]:
        return rec(uuid, parent, "tool_result", t,
                   message={"role": "user", "parts": [{"functionResponse": {"id": f"call_{name}", "name": "edit",
                                                                            "response": {"output": "ok"}}}]},
                   toolCallResult={"callId": f"call_{name}", "status": "success"})
    return [
        rec("r1", None, "user", 0.5, message={"role": "user", "parts": [{"text": "fix the greeting"}]}),
        rec("r2", "r1", "assistant", 1.5, model="x",
            message={"role": "model", "parts": [{"text": "I will edit."}, call("A"), call("B")]}),
        result("r3", "r2", "A", 6), result("r4", "r3", "B", 6.01),
        rec("r5", "r4", "assistant", 7, model="x", message={"role": "model", "parts": [call("C")]}),
        result("r6", "r5", "C", 10),
        rec("r7", "r6", "assistant", 11, model="x", message={"role": "model", "parts": [{"text": "Done."}]}),
    ]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    path.chmod(0o600)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


# (the lines of the checkpoint: up to and with this many hook lines) -> what the cut keeps
CUTS = {"A": 3, "B": 5, "C": 7, "end": 8}


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("point", list(CUTS))
def test_a_gemini_session_is_cut_at_the_checkpoints_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         point: str, merged: bool) -> None:
    monkeypatch.setenv("GEMINI_CLI_HOME", str(tmp_path))
    session = tmp_path / ".gemini" / "tmp" / "proj" / "chats" / "session-2026-12-01T10-00-g1.jsonl"
    records = gemini_session(merged)
    write_jsonl(session, records)
    before = session.read_bytes()
    found = resume_command(hook_lines("gemini", str(session))[:CUTS[point]])
    assert found is not None
    command, copy = found
    assert command == f"gemini --session-file {copy}"
    assert Path(copy).parent == session.parent and not Path(copy).name.startswith("session-")
    assert os.stat(copy).st_mode & 0o777 == 0o600 and session.read_bytes() == before
    cut = read_jsonl(copy)
    assert cut[0] == records[0]  # the metadata Gemini imports from
    messages = {r["id"]: r for r in cut if "id" in r}  # (later snapshots replace earlier ones)
    calls = [c["id"] for m in messages.values() for c in m.get("toolCalls", [])]
    assert calls == {"A": ["call-A"], "B": ["call-A", "call-B"], "C": ["call-A", "call-B", "call-C"],
                     "end": ["call-A", "call-B", "call-C"]}[point]
    assert ("m3" in messages) == (point == "end")
    assert all(c["result"] for m in messages.values() for c in m.get("toolCalls", []))


@pytest.mark.parametrize("point", list(CUTS))
def test_a_qwen_session_is_cut_at_the_checkpoints_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       point: str) -> None:
    monkeypatch.setenv("QWEN_HOME", str(tmp_path / ".qwen"))
    monkeypatch.delenv("QWEN_RUNTIME_DIR", raising=False)
    session = tmp_path / ".qwen" / "projects" / "-m" / "chats" / "q-1.jsonl"
    write_jsonl(session, qwen_session())
    found = resume_command(hook_lines("qwen", str(session))[:CUTS[point]])
    assert found is not None
    command, copy = found
    new_id = Path(copy).name.removesuffix(".jsonl")
    assert command == f"qwen --resume {new_id}" and Path(copy).parent == session.parent
    cut = read_jsonl(copy)
    assert {r["sessionId"] for r in cut} == {new_id}
    assert [r["uuid"] for r in cut] == {"A": ["r1", "r2", "r3"], "B": ["r1", "r2", "r3", "r4"],
                                        "C": ["r1", "r2", "r3", "r4", "r5", "r6"],
                                        "end": ["r1", "r2", "r3", "r4", "r5", "r6", "r7"]}[point]
    # every call the model made has its result: the resumed turn is well formed
    called = [p["functionCall"]["id"] for r in cut for p in r["message"]["parts"] if "functionCall" in p]
    answered = [r["toolCallResult"]["callId"] for r in cut if r["type"] == "tool_result"]
    assert called == answered
    assert all(r["parentUuid"] in (None, *[x["uuid"] for x in cut]) for r in cut)


def test_a_session_outside_the_agents_directory_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_CLI_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".gemini" / "tmp" / "p").mkdir(parents=True)
    outside = tmp_path / "session-x.jsonl"
    write_jsonl(outside, gemini_session(False))
    (tmp_path / "home" / ".gemini" / "tmp" / "p" / "link.jsonl").symlink_to(outside)
    for path in (str(outside), str(tmp_path / "home" / ".gemini" / "tmp" / "p" / "link.jsonl")):
        with pytest.raises(ValueError):
            resume_command(hook_lines("gemini", path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "session-x.jsonl"]
