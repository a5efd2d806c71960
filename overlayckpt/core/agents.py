"""Agent integration: Claude Code hook events into the conversation sidecar,
hook installation, and Claude Code transcripts cut back to a checkpoint.

The hook must never break the agent: whatever goes wrong, it prints at most
one line on stderr and exits 0, quickly.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

# The hook process imports this module alone (see overlayckpt/__main__.py): keep its
# imports to what a hook needs; cut_transcript and install_hooks import the rest.
MAX_EVENT = 4 << 20
EVENTS = ("UserPromptSubmit", "PreToolUse", "PostToolUse", "PostToolUseFailure", "Stop")
TOOL_EVENTS = ("PreToolUse", "PostToolUse", "PostToolUseFailure")
HOOK_MARK = "overlayckpt hook claude-code"
AGENTS = ("claude-code",)
TURN_FINISHED = "(turn finished)"  # a Stop event without the assistant's last message


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def _tool_brief(tool: str, tool_input: Any) -> str:
    if isinstance(tool_input, dict):
        for key in ("file_path", "command", "pattern", "path", "url", "description"):
            if key in tool_input:
                return f"{tool} {_short(tool_input[key], 100)}"
    return tool


def event_to_line(event: dict[str, Any]) -> dict[str, Any] | None:
    """One conversation line for a Claude Code hook event (None: nothing to log)."""
    name = event.get("hook_event_name")
    common = {"agent": "claude-code", "event": name, "session_id": event.get("session_id"),
              "transcript_path": event.get("transcript_path")}
    if name == "UserPromptSubmit":
        return {"role": "user", "content": str(event.get("prompt", "")), **common}
    if name == "PreToolUse":
        tool = str(event.get("tool_name", "?"))
        return {"role": "assistant", "tool": tool, "content": _short(event.get("tool_input")),
                "summary": _tool_brief(tool, event.get("tool_input")),
                "tool_use_id": event.get("tool_use_id"), **common}
    if name == "PostToolUse":
        tool = str(event.get("tool_name", "?"))
        return {"role": "tool", "tool": tool, "content": _short(event.get("tool_response")),
                "tool_use_id": event.get("tool_use_id"), **common}
    if name == "PostToolUseFailure":
        tool = str(event.get("tool_name", "?"))
        line = {"role": "tool", "tool": tool, "content": _short(event.get("error", "")),
                "failed": True, "tool_use_id": event.get("tool_use_id"), **common}
        if event.get("is_interrupt"):
            line["interrupted"] = True
        return line
    if name == "Stop":
        message = event.get("last_assistant_message")
        text = message if isinstance(message, str) and message.strip() else TURN_FINISHED
        return {"role": "assistant", "content": text, **common}
    return None


def find_mount_for(cwd: str | None) -> str | None:
    start = cwd or os.getcwd()
    d = os.path.abspath(start)
    while True:
        try:
            if os.path.exists(os.path.join(d, ".overlayckpt", "conversation.jsonl")):
                return d
        except OSError:
            return None
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def hook_main(argv: list[str]) -> int | None:
    """`overlayckpt hook AGENT [--mount M]` without the CLI's imports; None: another
    form of the command, which the full CLI parses (and explains)."""
    mount = None
    rest = list(argv)
    if len(rest) == 3 and rest[1] == "--mount":
        mount = rest.pop()
        rest.pop()
    elif len(rest) == 2 and rest[1].startswith("--mount="):
        mount = rest.pop()[len("--mount="):]
    if len(rest) != 1 or rest[0] not in AGENTS:
        return None
    return run_hook(sys.stdin, mount)


def run_hook(stdin: Any, mount: str | None) -> int:
    try:
        raw = stdin.read(MAX_EVENT + 1)
        if len(raw) > MAX_EVENT:
            raise ValueError("event larger than 4 MiB")
        event = json.loads(raw)
        if not isinstance(event, dict):
            raise ValueError("event is not a JSON object")
        line = event_to_line(event)
        if line is None:
            return 0
        target = mount or os.environ.get("OVERLAYCKPT_MOUNT") or find_mount_for(event.get("cwd"))
        if target is None:
            return 0  # not inside an overlayckpt mount: nothing to record
        path = os.path.join(target, ".overlayckpt", "conversation.jsonl")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (json.dumps(line, ensure_ascii=False) + "\n").encode())
        finally:
            os.close(fd)
    except Exception as e:  # never break the agent
        print(f"overlayckpt hook: {e}", file=sys.stderr)
    return 0


def install_hooks(project: str, command: str) -> str:
    """Add our hook to .claude/settings.local.json, keeping everything already there."""
    path = os.path.join(project, ".claude", "settings.local.json")
    settings: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            try:
                settings = json.load(f)
            except ValueError as e:
                from overlayckpt.errors import UserError
                raise UserError(f"{path} is not valid JSON ({e}): fix it first") from None
    hooks = settings.setdefault("hooks", {})
    # Every hook stays synchronous (no "async": true): the conversation is kept in the
    # order its lines arrive, and a call's line must land before its changes, its result
    # before the next call (parallel tool calls are milliseconds apart), a prompt before
    # the first call it causes; `claude -p` may exit before a background Stop hook ends.
    # The hook answers in about 10 ms more than Python's own start (bench/hook.py).
    for event in EVENTS:
        entries = hooks.setdefault(event, [])
        present = any(HOOK_MARK in h.get("command", "") for e in entries for h in e.get("hooks", []))
        if not present:
            entry: dict[str, Any] = {"hooks": [{"type": "command", "command": command, "timeout": 10}]}
            if event in TOOL_EVENTS:
                entry["matcher"] = "*"
            entries.append(entry)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def cut_transcript(transcript: str, until_iso: str) -> tuple[str, str]:
    """Copy a Claude Code transcript up to a time as a new session; returns (id, path).

    `claude --resume ID` (run in the project directory) continues from there.
    """
    import datetime
    import uuid
    until = datetime.datetime.fromisoformat(until_iso.replace("Z", "+00:00"))
    new_id = str(uuid.uuid4())
    out_path = os.path.join(os.path.dirname(transcript), new_id + ".jsonl")
    kept = 0
    with open(transcript) as src, open(out_path, "w") as dst:
        for line in src:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            stamp = entry.get("timestamp")
            if stamp:
                t = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
                if t > until:
                    break
            if "sessionId" in entry:
                entry["sessionId"] = new_id
            dst.write(json.dumps(entry) + "\n")
            kept += 1
    return new_id, out_path
