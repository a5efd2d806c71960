"""Agent integration: Claude Code, Codex, Gemini CLI and Cursor hook events into the
conversation sidecar (Claude and Codex send the same snake_case fields; Gemini's and
Cursor's events are translated to theirs), hook and MCP server installation, and
Claude Code / Codex transcripts cut back to a checkpoint.

The hook must never break the agent: whatever goes wrong, it prints at most
one line on stderr and exits 0, quickly.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from typing import Any

# The hook process imports this module alone (see overlayckpt/__main__.py): keep its
# imports to what a hook needs; cut_transcript and install_hooks import the rest.
MAX_EVENT = 4 << 20
EVENTS = ("UserPromptSubmit", "PreToolUse", "PostToolUse", "PostToolUseFailure", "Stop")
TOOL_EVENTS = ("PreToolUse", "PostToolUse", "PostToolUseFailure")
AGENTS = ("claude-code", "codex", "gemini", "cursor")
TRANSCRIPT_AGENTS = ("claude-code", "codex")  # whose transcripts a restore cuts
# the events each agent's hook file may name (Codex refuses a file with one it lacks)
AGENT_EVENTS = {"claude-code": EVENTS, "codex": ("UserPromptSubmit", "PreToolUse", "PostToolUse", "Stop"),
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


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def _patch_brief(command: str) -> str | None:
    """Codex's `apply_patch` (run through its shell tool) named by the files it touches."""
    if not command.lstrip().startswith("apply_patch"):
        return None
    files = [line.split(":", 1)[1].strip() for line in command.splitlines()
             if line.startswith(("*** Add File:", "*** Update File:", "*** Delete File:"))]
    return "apply_patch " + ", ".join(files) if files else None


def _tool_brief(tool: str, tool_input: Any, cwd: Any) -> str:
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


def _event_cwd(event: dict[str, Any]) -> Any:
    roots = event.get("workspace_roots")  # Cursor's, for events without a cwd
    if not event.get("cwd") and isinstance(roots, list) and roots:
        return roots[0]
    return event.get("cwd")


def _as_claude(event: dict[str, Any], agent: str) -> dict[str, Any]:
    """A Gemini CLI or Cursor hook event in Claude Code's fields (fields as their docs
    name them: Gemini's hooks reference, Cursor's hooks page)."""
    name = event.get("hook_event_name")
    out = dict(event, hook_event_name=AS_CLAUDE.get(str(name), name), agent_event=name)
    if agent == "cursor":
        out["session_id"] = event.get("conversation_id")
        out["cwd"] = _event_cwd(event)
        if isinstance(event.get("tool_input"), str):  # MCP tools' input comes as JSON text
            try:
                out["tool_input"] = json.loads(event["tool_input"])
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


def event_to_line(event: dict[str, Any], agent: str = "claude-code") -> dict[str, Any] | None:
    """One conversation line for an agent's hook event (None: nothing to log)."""
    if agent in ("gemini", "cursor"):
        event = _as_claude(event, agent)
    name = event.get("hook_event_name")
    common = {"agent": agent, "event": name, "session_id": event.get("session_id"),
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
    them (the FUSE super options carry the mounting uid as user_id=N). A mount shadowed by
    another at the same place keeps the later one's line: the fd check then refuses it."""
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


def find_mount_for(cwd: str | None, mounts: dict[str, int] | None = None) -> str | None:
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


def open_conversation(mount: str | None, cwd: Any) -> int | None:
    """An fd appending to the conversation of a verified live mount: mount (--mount or
    OVERLAYCKPT_MOUNT) if given, else the one holding cwd; None if there is none.

    Nothing found by name is trusted (a repo may ship .overlayckpt/conversation.jsonl,
    as a symlink or planted by another user): the directory must be a mountpoint of our
    filesystem type mounted by this uid, every step below it is opened from the one
    before without following symlinks and without creating anything, and each must be
    on that mount's device."""
    mounts = our_mounts()
    if mount is not None:
        where: str | None = os.path.abspath(mount)
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


def run_hook(stdin: Any, mount: str | None, agent: str = "claude-code") -> int:
    try:
        raw = stdin.read(MAX_EVENT + 1)
        if len(raw) > MAX_EVENT:
            raise ValueError("event larger than 4 MiB")
        event = json.loads(raw)
        if not isinstance(event, dict):
            raise ValueError("event is not a JSON object")
        if agent in ("gemini", "cursor"):
            print("{}")  # both read a JSON answer on stdout; an empty one allows everything
        line = event_to_line(event, agent)
        if line is None:
            return 0
        fd = open_conversation(mount or os.environ.get("OVERLAYCKPT_MOUNT") or None, _event_cwd(event))
        if fd is None:
            return 0
        try:
            os.write(fd, (json.dumps(line, ensure_ascii=False) + "\n").encode())
        finally:
            os.close(fd)
    except Exception as e:  # never break the agent
        print(f"overlayckpt hook: {e}", file=sys.stderr)
    return 0


def user_settings_path(agent: str = "claude-code") -> str:
    """The agent's user-level hooks file: read for every project, outside every captured tree."""
    home = os.path.expanduser("~")
    if agent == "codex":
        return os.path.join(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"), "hooks.json")
    if agent == "gemini":
        return os.path.join(home, ".gemini", "settings.json")
    if agent == "cursor":
        return os.path.join(home, ".cursor", "hooks.json")
    base = os.environ.get("CLAUDE_CONFIG_DIR") or os.path.join(home, ".claude")
    return os.path.join(base, "settings.json")


def mcp_config_path(agent: str, hooks_path: str) -> str | None:
    """The agent's user-level file naming its MCP servers."""
    if agent == "claude-code":  # user scope, as `claude mcp add --scope user` writes it
        return os.path.join(os.environ.get("CLAUDE_CONFIG_DIR") or os.path.expanduser("~"), ".claude.json")
    if agent == "gemini":
        return hooks_path  # one settings.json holds both
    if agent == "cursor":
        return os.path.join(os.path.dirname(hooks_path), "mcp.json")
    if agent == "codex":  # [mcp_servers.NAME] tables beside hooks.json
        return os.path.join(os.path.dirname(hooks_path), "config.toml")
    return None


def _is_ours(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    if HOOK_MARK in str(entry.get("command", "")):  # Cursor's entries are the commands
        return True
    hooks = entry.get("hooks")
    return isinstance(hooks, list) and any(isinstance(h, dict) and HOOK_MARK in str(h.get("command", ""))
                                           for h in hooks)


def _read_settings(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            settings = json.load(f)
        except ValueError as e:
            from overlayckpt.errors import UserError
            raise UserError(f"{path} is not valid JSON ({e}): fix it first") from None
    if not isinstance(settings, dict):
        from overlayckpt.errors import UserError
        raise UserError(f"{path} is not a JSON object: fix it first")
    return settings


def settings_dir(path: str, create: bool) -> None:
    """Make sure the directory of an agent's settings file is there before anything is
    written: create=True (the agent's own default, e.g. ~/.codex) makes that one
    directory 0700 if its parent exists; a tree is never made, and a path the user gave
    (--settings) must lie in an existing directory. UserError otherwise."""
    from overlayckpt.errors import UserError
    from overlayckpt.names import quote_path
    d = os.path.dirname(path)
    if os.path.isdir(d):
        return
    if create and os.path.isdir(os.path.dirname(d)):
        try:
            os.mkdir(d, 0o700)
            return
        except FileExistsError:
            if os.path.isdir(d):
                return
    raise UserError(f"{quote_path(d)} is not a directory: create it first (nothing was written)")


def _replace_file(path: str, text: str) -> None:
    """path's new content, written to a new temp file beside it (O_EXCL, no symlink
    followed) and renamed over it: 0600 when new, its mode kept when not. A symlink at
    path is replaced by the file, not written through."""
    import tempfile
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o600  # settings may hold keys and tokens: the user's alone
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_settings(path: str, settings: dict[str, Any]) -> None:
    _replace_file(path, json.dumps(settings, indent=2) + "\n")


def _member(obj: dict[str, Any], key: str, kind: type, path: str) -> Any:
    """obj[key], made empty if missing; a value of another type is the user's to fix."""
    value = obj.setdefault(key, kind())
    if not isinstance(value, kind):
        from overlayckpt.errors import UserError
        raise UserError(f"{path}: {key!r} is not a JSON {'object' if kind is dict else 'array'}: fix it first")
    return value


def _hook_entry(agent: str, event: str, command: str) -> dict[str, Any]:
    if agent == "cursor":
        return {"command": command}  # (its timeout's unit is not documented clearly: its default)
    hook: dict[str, Any] = {"type": "command", "command": command, "timeout": 10}
    if agent == "gemini":
        hook.update(name="overlayckpt", timeout=10_000)  # milliseconds; no matcher: every tool
    entry: dict[str, Any] = {"hooks": [hook]}
    if agent in ("claude-code", "codex") and event in TOOL_EVENTS:
        entry["matcher"] = "*"
    return entry


def install_hooks(path: str, command: str, agent: str = "claude-code") -> str:
    """Add our hooks to the agent's settings (hooks) file at path, keeping everything there.

    Installed in the user's settings (user_settings_path), not the project's: a file in
    the project lies in the captured tree, so restoring a checkpoint from before it
    (`restore 0 --code`) would delete it and silently stop the logging, and git would
    see it. Outside a mount the hook finds no mount and exits 0 at once.
    """
    settings = _read_settings(path)
    if agent == "cursor":
        settings.setdefault("version", 1)
    hooks = _member(settings, "hooks", dict, path)
    # Every hook stays synchronous (no "async": true): the conversation is kept in the
    # order its lines arrive, and a call's line must land before its changes, its result
    # before the next call (parallel tool calls are milliseconds apart), a prompt before
    # the first call it causes; `claude -p` may exit before a background Stop hook ends.
    # The hook answers in about 10 ms more than Python's own start (bench/hook.py).
    for event in AGENT_EVENTS[agent]:
        entries = _member(hooks, event, list, path)
        ours = [i for i, e in enumerate(entries) if _is_ours(e)]
        if ours:  # an earlier install's command (say, without -P) becomes this one, in place
            entries[ours[0]] = _hook_entry(agent, event, command)
            entries[:] = [e for i, e in enumerate(entries) if i not in ours[1:]]
        else:
            entries.append(_hook_entry(agent, event, command))
    _write_settings(path, settings)
    return path


def _drop_our_hooks(settings: dict[str, Any]) -> bool:
    """Take our entries out of settings["hooks"]; True if any were there."""
    hooks = settings.get("hooks")
    if not isinstance(hooks, dict):
        return False
    changed = False
    for event, entries in list(hooks.items()):
        if not isinstance(entries, list):
            continue  # e.g. an "enabled" flag
        kept = [e for e in entries if not _is_ours(e)]
        if len(kept) != len(entries):
            changed = True
            if kept:
                hooks[event] = kept
            else:
                del hooks[event]
    if changed and not hooks:
        del settings["hooks"]
    return changed


def uninstall_hooks(path: str) -> bool:
    """Take our hooks out of the agent's hooks file, keeping the rest; True if it changed."""
    if not os.path.exists(path):
        return False
    settings = _read_settings(path)
    if not _drop_our_hooks(settings):
        return False
    _write_settings(path, settings)
    return True


def remove_project_hooks(project: str) -> str | None:
    """Take our hooks out of a project's .claude/settings.local.json (where earlier
    versions put them: with the user's hooks too, every event would be logged twice).
    Returns the path if it changed."""
    path = os.path.join(project, ".claude", "settings.local.json")
    try:
        return path if uninstall_hooks(path) else None
    except Exception:
        return None  # not ours to fix


CODEX_MCP_TABLE = f"[mcp_servers.{MCP_NAME}]"


def _codex_toml(path: str) -> tuple[str, dict[str, Any]]:
    import tomllib
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        from overlayckpt.errors import UserError
        raise UserError(f"{path} is not valid TOML ({e}): fix it first") from None


def _without_codex_table(text: str) -> str:
    """text without our [mcp_servers.overlayckpt] table (and its subtables)."""
    out, ours = [], False
    for line in text.splitlines(keepends=True):
        head = line.strip()
        if head.startswith("["):
            ours = head == CODEX_MCP_TABLE or head.startswith(CODEX_MCP_TABLE[:-1] + ".")
        if not ours:
            out.append(line)
    return "".join(out).rstrip("\n") + "\n" if out else ""


def install_mcp(path: str, python: str, agent: str) -> str:
    """Register `overlayckpt mcp` in the agent's mcpServers. No --mount: the server finds
    the mount from the directory the agent starts it in."""
    if agent == "codex":  # TOML: the table appended as text, so the user's file stays as written
        text, config = _codex_toml(path)
        if MCP_NAME in (config.get("mcp_servers") or {}):
            text = _without_codex_table(text)
        table = f'{CODEX_MCP_TABLE}\ncommand = {json.dumps(python)}\nargs = {json.dumps(MCP_ARGS)}\n'
        _replace_file(path, (text.rstrip("\n") + "\n\n" if text.strip() else "") + table)
        return path
    settings = _read_settings(path)
    servers = _member(settings, "mcpServers", dict, path)
    server: dict[str, Any] = {"command": python, "args": MCP_ARGS}
    if agent == "claude-code":
        server = {"type": "stdio", **server, "env": {}}
    servers[MCP_NAME] = server
    _write_settings(path, settings)
    return path


def uninstall_mcp(path: str) -> bool:
    if not os.path.exists(path):
        return False
    if path.endswith(".toml"):
        text, config = _codex_toml(path)
        if MCP_NAME not in (config.get("mcp_servers") or {}):
            return False
        _replace_file(path, _without_codex_table(text))
        return True
    settings = _read_settings(path)
    servers = settings.get("mcpServers")
    if not isinstance(servers, dict) or MCP_NAME not in servers:
        return False
    del servers[MCP_NAME]
    _write_settings(path, settings)
    return True


def _claude_result(entry: dict[str, Any], call_id: str) -> bool:
    message = entry.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") == call_id
        for b in content)


def _codex_result(entry: dict[str, Any], call_id: str) -> bool:
    payload = entry.get("payload")
    return entry.get("type") == "response_item" and isinstance(payload, dict) \
        and payload.get("type") in ("function_call_output", "custom_tool_call_output") \
        and payload.get("call_id") == call_id


def transcript_root(agent: str) -> str:
    """The directory where the agent keeps this user's transcripts (Claude Code:
    CLAUDE_CONFIG_DIR or ~/.claude, then projects/; Codex: CODEX_HOME or ~/.codex, then
    sessions/), as the daemon's environment (the user's, at mount time) names it."""
    home = os.path.expanduser("~")
    if agent == "codex":
        return os.path.join(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"), "sessions")
    return os.path.join(os.environ.get("CLAUDE_CONFIG_DIR") or os.path.join(home, ".claude"), "projects")


class Transcript:
    """A transcript named by a conversation line (which the agent can forge), opened
    beneath its agent's transcript root one component at a time, never through a symlink:
    `dir_fd` holds it (the cut copy goes there), `fd` reads it. Close it when done."""

    def __init__(self, path: Any, agent: str) -> None:
        from overlayckpt.names import quote_path
        root = transcript_root(agent)
        shown = quote_path(path) if isinstance(path, str) else repr(path)
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise ValueError(f"{shown} is not an absolute path")
        # lexically beneath the root as the user spells it, or as it resolves (the root
        # itself may be a link the user made: only what lies below it is walked strictly)
        rest = None
        for base in dict.fromkeys((os.path.normpath(root), os.path.realpath(root))):
            if path.startswith(base.rstrip("/") + "/"):
                rest = path[len(base.rstrip("/")) + 1:].split("/")
                break
        if rest is None or any(part in ("", ".", "..") for part in rest):
            raise ValueError(f"{shown} is not in {quote_path(root)}, where {agent} keeps its transcripts")
        self.path = path
        uid = os.getuid()
        fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in rest[:-1]:
                try:
                    step = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except NotADirectoryError:
                    raise ValueError(f"{shown} goes through a symlink or a file") from None
                os.close(fd)
                fd = step
            if os.fstat(fd).st_uid != uid:
                raise ValueError(f"{shown} lies in a directory of another user")
            try:
                src = os.open(rest[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError(f"{shown} is a symlink") from None
                raise
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                os.close(src)
                raise ValueError(f"{shown} is not a regular file of this user")
        except BaseException:
            os.close(fd)
            raise
        self.dir_fd, self.fd = fd, src

    def lines(self) -> Any:
        return os.fdopen(os.dup(self.fd), encoding="utf-8", errors="surrogateescape")

    def write_copy(self, name: str, lines: list[str]) -> str:
        """A new file beside the transcript, 0600 as the agents keep theirs; its path."""
        from overlayckpt.names import is_file_name
        if not is_file_name(name.encode("utf-8", "surrogateescape")):
            raise ValueError(f"cannot name a copy {name!r}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.dir_fd)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as dst:
            dst.writelines(lines)
        return os.path.join(os.path.dirname(self.path), name)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.dir_fd)


def resume_command(lines: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The agent transcript of a checkpoint's conversation (its lines, oldest first) cut
    back to it: (the command that resumes it, the copy's path); None if there is none.

    The newest line naming a transcript that exists decides; ValueError (saying why) if
    that transcript is not where its agent keeps them: a line may be forged by anyone who
    can write ctl, and nothing is read or written outside the agent's own directory."""
    for line in reversed(lines):
        path = line.get("transcript_path")
        agent = line.get("agent")
        if agent not in TRANSCRIPT_AGENTS or not path:
            continue
        try:
            transcript = Transcript(path, agent)
        except FileNotFoundError:
            continue  # gone (deleted by the agent or the user): an older one may remain
        try:
            call = line.get("tool_use_id") if line.get("event") in TOOL_EVENTS else None
            if agent == "codex":
                session, copy = cut_codex_rollout(transcript, line["time"], call)
                return f"codex resume {session}", copy
            copy = cut_transcript(transcript, line["time"], call)
            return f"claude --resume {copy}", copy
        finally:
            transcript.close()
    return None


def _cut(transcript: Transcript, until_iso: str, is_end: Any) -> list[str]:
    """A JSONL transcript's lines (as written) through the first entry is_end accepts,
    or, if none does, those stamped no later than until_iso."""
    import datetime
    until = datetime.datetime.fromisoformat(until_iso.replace("Z", "+00:00"))
    entries: list[tuple[str, dict[str, Any]]] = []
    with transcript.lines() as src:
        for line in src:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(entry, dict):
                entries.append((line if line.endswith("\n") else line + "\n", entry))
    ends = [i for i, (_, e) in enumerate(entries) if is_end(e)]
    if ends:
        return [line for line, _ in entries[:ends[0] + 1]]
    kept = []
    for line, entry in entries:
        stamp = entry.get("timestamp")
        if isinstance(stamp, str) and datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")) > until:
            break
        kept.append(line)
    return kept


def cut_transcript(transcript: Transcript, until_iso: str, tool_use_id: str | None = None) -> str:
    """Copy a Claude Code transcript up to a point, beside it; returns the copy's path.

    The point is a tool call's result when tool_use_id is given (the transcript names
    calls by the ids the hooks log), else a time. The copy keeps the session id: Claude
    keeps its file-history backups by session, and its own /rewind reaches the earlier
    prompts only under that id (resumed, Claude appends the new turns to the session's
    own transcript, as a branch from the cut). `claude --resume COPY` works from any
    directory.
    """
    import uuid
    kept = _cut(transcript, until_iso, lambda e: tool_use_id is not None and _claude_result(e, tool_use_id))
    return transcript.write_copy(str(uuid.uuid4()) + ".jsonl", kept)


def cut_codex_rollout(rollout: Transcript, until_iso: str, call_id: str | None = None) -> tuple[str, str]:
    """Copy a Codex rollout up to a call's output (else a time) as a session of its own,
    beside it; returns (its id, its path). Codex finds a session by the id in its first
    line (session_meta) and in the file's name; `codex resume ID` works from any directory."""
    import uuid
    kept = _cut(rollout, until_iso, lambda e: call_id is not None and _codex_result(e, call_id))
    new_id = str(uuid.uuid4())
    old_id = None
    for i, line in enumerate(kept):
        entry = json.loads(line)
        payload = entry.get("payload")
        if entry.get("type") == "session_meta" and isinstance(payload, dict) and payload.get("id"):
            old_id = str(payload["id"])
            kept[i] = line.replace(old_id, new_id)
            break
    if old_id is None:
        raise ValueError(f"{os.path.basename(rollout.path)} has no session id")
    name = os.path.basename(rollout.path)
    name = name.replace(old_id, new_id) if old_id in name else f"rollout-{new_id}.jsonl"
    return new_id, rollout.write_copy(name, kept)
