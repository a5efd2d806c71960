"""Agent hooks: Claude Code, Codex, qwen-code, Gemini CLI and Cursor hook events into
the conversation sidecar (Claude, Codex and qwen send the same snake_case fields; Gemini's
and Cursor's events are translated to theirs), written only into a live overlayckpt mount
the hook has verified.

The hook (the compiled overlayckpt/bin/overlayckpt-hook, or `overlayckpt hook` in
Python) appends the event as it came, wrapped as {"hook": AGENT, "event": EVENT}; the
daemon turns that into the conversation line (hook_line, event_to_line), so both hooks
log the same lines and the parsing lives in one place. Installing hooks and the MCP server: agents/settings.py;
the agents' transcripts cut back to a checkpoint: agents/transcripts.py.

The hook must never break the agent: whatever goes wrong, it prints at most
one line on stderr and exits 0, quickly.
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from typing import TextIO

# The hook process imports this module alone (see overlayckpt/__main__.py), compiled
# from source where no .pyc is written: keep it to what a hook needs, imports and code.
MAX_EVENT = 4 << 20
EVENTS = ("UserPromptSubmit", "PreToolUse", "PostToolUse", "PostToolUseFailure", "Stop")
TOOL_EVENTS = ("PreToolUse", "PostToolUse", "PostToolUseFailure")
AGENTS = ("claude-code", "codex", "gemini", "qwen", "cursor", "opencode")
TRANSCRIPT_AGENTS = ("claude-code", "codex", "gemini", "qwen")  # whose transcripts a restore cuts
# a wrapped event's line: the event itself may be MAX_EVENT long (the line made of it is
# then cut to what the conversation keeps)
MAX_HOOK_LINE = MAX_EVENT + 1024
# the events each agent's hook file may name (Codex refuses a file with one it lacks)
AGENT_EVENTS = {"claude-code": EVENTS, "qwen": EVENTS,
                "codex": ("UserPromptSubmit", "PreToolUse", "PostToolUse", "Stop"),
                "gemini": ("BeforeAgent", "BeforeTool", "AfterTool", "AfterAgent"),
                "cursor": ("beforeSubmitPrompt", "preToolUse", "postToolUse", "postToolUseFailure",
                           "afterAgentResponse")}
# Gemini's and Cursor's events as the Claude events the conversation keys on
# (PreToolUse starts a call's checkpoint, Stop ends a turn: core/conversation.py)
AS_CLAUDE = {"BeforeAgent": "UserPromptSubmit", "BeforeTool": "PreToolUse", "AfterTool": "PostToolUse",
             "AfterAgent": "Stop", "beforeSubmitPrompt": "UserPromptSubmit", "preToolUse": "PreToolUse",
             "postToolUse": "PostToolUse", "postToolUseFailure": "PostToolUseFailure",
             "afterAgentResponse": "Stop"}
MCP_NAME = "overlayckpt"  # our entry in the agents' mcpServers
HOOK_MARK = "overlayckpt hook"  # in every command we install: `... -P -m overlayckpt hook AGENT`
# Agents run hooks and MCP servers in the repo: without -P, `python -m overlayckpt` puts
# that directory first on sys.path, and a repo shipping overlayckpt/ would run its own code
MCP_ARGS = ["-P", "-m", "overlayckpt", "mcp"]
TURN_FINISHED = "(turn finished)"  # a Stop event without the assistant's last message


def _short(value: object, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def _patch_brief(command: str) -> str | None:
    """Codex's `apply_patch` (run through its shell tool) named by the files it touches."""
    if not command.lstrip().startswith("apply_patch"):
        return None
    files = [line.split(":", 1)[1].strip() for line in command.splitlines()
             if line.startswith(("*** Add File:", "*** Update File:", "*** Delete File:"))]
    return "apply_patch " + ", ".join(files) if files else None


def _tool_brief(tool: str, tool_input: object, cwd: object) -> str:
    if isinstance(tool_input, dict) and isinstance(tool_input.get("command"), str):
        patch = _patch_brief(tool_input["command"])
        if patch:
            return _short(patch, 100)
    if isinstance(tool_input, dict):
        for key in ("file_path", "command", "pattern", "path", "url", "description"):
            if key in tool_input:
                value = tool_input[key]
                if key in ("file_path", "path") and isinstance(value, str) and isinstance(cwd, str) \
                        and value.startswith(cwd.rstrip("/") + "/"):
                    value = value[len(cwd.rstrip("/")) + 1:]  # as the log names paths
                return f"{tool} {_short(value, 100)}"
    return tool


def _event_cwd(event: Mapping[str, object]) -> object:
    roots = event.get("workspace_roots")  # Cursor's, for events without a cwd
    if not event.get("cwd") and isinstance(roots, list) and roots:
        return roots[0]
    return event.get("cwd")


def _as_claude(event: Mapping[str, object], agent: str) -> dict[str, object]:
    """A Gemini CLI or Cursor hook event in Claude Code's fields (fields as their docs
    name them: Gemini's hooks reference, Cursor's hooks page)."""
    name = event.get("hook_event_name")
    out = dict(event, hook_event_name=AS_CLAUDE.get(str(name), name), agent_event=name)
    if agent == "cursor":
        out["session_id"] = event.get("conversation_id")
        out["cwd"] = _event_cwd(event)
        tool_input = event.get("tool_input")
        if isinstance(tool_input, str):  # MCP tools' input comes as JSON text
            try:
                out["tool_input"] = json.loads(tool_input)
            except ValueError:
                pass
        out["tool_response"] = event.get("tool_output")
        out["error"] = event.get("error_message") or event.get("error") or ""
        out["last_assistant_message"] = event.get("text")
    elif agent == "gemini":
        response = event.get("tool_response")
        if isinstance(response, dict):
            error = response.get("error")
            if error:
                out["hook_event_name"] = "PostToolUseFailure"
                out["error"] = error.get("message", error) if isinstance(error, dict) else error
            out["tool_response"] = response.get("llmContent", response.get("returnDisplay", response))
        out["last_assistant_message"] = event.get("prompt_response")
    return out


def event_to_line(event: Mapping[str, object], agent: str = "claude-code") -> dict[str, object] | None:
    """One conversation line for an agent's hook event (None: nothing to log)."""
    if agent in ("gemini", "cursor"):
        event = _as_claude(event, agent)
    elif agent == "opencode":  # our plugin's events (agents/opencode.py)
        from overlayckpt.agents.opencode import as_claude
        event = as_claude(event)
    name = event.get("hook_event_name")
    common: dict[str, object] = {"agent": agent, "event": name, "session_id": event.get("session_id"),
              "transcript_path": event.get("transcript_path")}
    if event.get("agent_event"):
        common["agent_event"] = event["agent_event"]
    if name == "UserPromptSubmit":
        return {"role": "user", "content": str(event.get("prompt", "")), **common}
    if name == "PreToolUse":
        tool = str(event.get("tool_name", "?"))
        return {"role": "assistant", "tool": tool, "content": _short(event.get("tool_input")),
                "summary": _tool_brief(tool, event.get("tool_input"), event.get("cwd")),
                "tool_use_id": event.get("tool_use_id"), **common}
    if name == "PostToolUse":
        tool = str(event.get("tool_name", "?"))
        return {"role": "tool", "tool": tool, "content": _short(event.get("tool_response")),
                "tool_use_id": event.get("tool_use_id"), **common}
    if name == "PostToolUseFailure":
        tool = str(event.get("tool_name", "?"))
        line: dict[str, object] = {"role": "tool", "tool": tool, "content": _short(event.get("error", "")),
                "failed": True, "tool_use_id": event.get("tool_use_id"), **common}
        if event.get("is_interrupt"):
            line["interrupted"] = True
        return line
    if name == "Stop":
        message = event.get("last_assistant_message")
        text = message if isinstance(message, str) and message.strip() else TURN_FINISHED
        return {"role": "assistant", "content": text, **common}
    return None


# Where the hook may write: a live overlayckpt mount of this user (mount.py mounts with
# subtype=overlayckpt, which /proc/self/mountinfo shows as this filesystem type)
FS_TYPE = "fuse.overlayckpt"
CONTROL_DIR = ".overlayckpt"
CONVERSATION = "conversation.jsonl"


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as \\ooo."""
    if "\\" not in field:
        return field
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def our_mounts() -> dict[str, int]:
    """Mountpoint -> device of every overlayckpt mount this uid made, as this process sees
    them (the FUSE super options carry the mounting uid as user_id=N). Of two at one place
    the later (on top) is kept; anything else mounted over one fails open_conversation's
    device check."""
    uid_opt = f"user_id={os.getuid()}"
    out: dict[str, int] = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if FS_TYPE not in line:
                continue
            mine, _, sb = line.rstrip("\n").partition(" - ")
            fields, sb_fields = mine.split(" "), sb.split(" ")
            # a bind mount of a subdirectory has another root: its .overlayckpt is the repo's
            if len(fields) < 5 or len(sb_fields) < 3 or sb_fields[0] != FS_TYPE or fields[3] != "/" \
                    or uid_opt not in sb_fields[2].split(","):
                continue
            major, _, minor = fields[2].partition(":")
            out[_unescape(fields[4])] = os.makedev(int(major), int(minor))
    return out


def find_mount_for(cwd: object, mounts: dict[str, int] | None = None) -> str | None:
    """The innermost of this user's overlayckpt mountpoints that holds cwd, or None."""
    mounts = our_mounts() if mounts is None else mounts
    if not mounts:
        return None
    d = os.path.abspath(cwd if isinstance(cwd, str) and cwd else os.getcwd())
    while True:
        if d in mounts:
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def open_conversation(mount: str | None, cwd: object) -> int | None:
    """An fd appending to the conversation of a verified live mount: mount (--mount or
    OVERLAYCKPT_MOUNT) if given, else the one holding cwd; None if there is none.

    Nothing found by name is trusted (a repo may ship .overlayckpt/conversation.jsonl,
    as a symlink or planted by another user): the directory must be a mountpoint of our
    filesystem type mounted by this uid, every step below it is opened from the one
    before without following symlinks and without creating anything, and each must be
    on that mount's device."""
    mounts = our_mounts()
    where: str | None
    if mount is not None:
        where = os.path.abspath(mount)
        if where not in mounts:
            where = os.path.realpath(where)  # the user's own spelling of it
            if where not in mounts:
                raise ValueError(f"{mount} is not an overlayckpt mount of this user: nothing logged")
    else:
        where = find_mount_for(cwd, mounts)
        if where is None:
            return None  # not inside an overlayckpt mount: nothing to record
    dev = mounts[where]
    root = os.open(where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if os.fstat(root).st_dev != dev:  # something else mounted over it, or a swapped path
            return None
        ctl = os.open(CONTROL_DIR, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    finally:
        os.close(root)
    try:
        if os.fstat(ctl).st_dev != dev:
            return None
        # no O_CREAT: the daemon serves the file; O_NONBLOCK: never wait on a fifo
        fd = os.open(CONVERSATION, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=ctl)
    finally:
        os.close(ctl)
    st = os.fstat(fd)
    if st.st_dev != dev or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd


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
    return run_hook(sys.stdin, mount, rest[0])


def hook_line(wrapped: Mapping[str, object]) -> dict[str, object] | None:
    """The conversation line of a wrapped hook event {"hook": AGENT, "event": EVENT}, as
    the hooks write it (None: an event we do not log). The daemon runs this on whatever
    is written to the conversation (the agent can write anything there): ValueError
    for anything but a wrapped event of a known agent."""
    agent, event = wrapped.get("hook"), wrapped.get("event")
    if agent not in AGENTS or not isinstance(event, dict) or len(wrapped) != 2:
        raise ValueError('a hook event is {"hook": AGENT, "event": {...}} with AGENT one of ' + ", ".join(AGENTS))
    try:
        return event_to_line(event, str(agent))
    except RecursionError:  # (Cursor's tool_input is JSON text, parsed here)
        raise ValueError("the hook event is nested too deeply") from None


def run_hook(stdin: TextIO, mount: str | None, agent: str = "claude-code") -> int:
    try:
        raw = stdin.read(MAX_EVENT + 1)
        if len(raw) > MAX_EVENT:
            raise ValueError("event larger than 4 MiB")
        event: object = json.loads(raw)
        if not isinstance(event, dict):
            raise ValueError("event is not a JSON object")
        if agent in ("gemini", "cursor"):
            print("{}")  # both read a JSON answer on stdout; an empty one allows everything
        if event_to_line(event, agent) is None:
            return 0
        fd = open_conversation(mount or os.environ.get("OVERLAYCKPT_MOUNT") or None, _event_cwd(event))
        if fd is None:
            return 0
        try:  # the daemon makes the line (hook_line), as for the compiled hook
            data = (json.dumps({"hook": agent, "event": event}) + "\n").encode()
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
    except Exception as e:  # never break the agent
        print(f"overlayckpt hook: {e}", file=sys.stderr)
    return 0
