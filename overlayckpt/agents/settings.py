"""Installing our hooks and MCP server into an agent's user settings, and taking them out.

Settings files are the user's: written beside themselves and renamed over (mode kept,
0600 when new), into a directory that must exist (only the agent's own default one is
made, one level, 0700).
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import NoReturn, TypedDict

from overlayckpt.agents.hooks import AGENT_EVENTS, HOOK_MARK, MCP_ARGS, MCP_NAME, TOOL_EVENTS

HOOK_PROGRAM = "overlayckpt-hook"


class CommandHook(TypedDict, total=False):
    """One hook command as we install it (Claude, Codex, qwen and Gemini read these)."""
    type: str
    command: str
    timeout: int  # seconds, milliseconds for Gemini and qwen
    name: str  # Gemini's


class HookEntry(TypedDict, total=False):
    """An entry of an event's list in the agent's hooks file: our commands, with a tool
    matcher for tool events; Cursor's entries are the command itself."""
    hooks: list[CommandHook]
    matcher: str
    command: str


class McpServer(TypedDict, total=False):
    """Our entry in the agent's mcpServers."""
    type: str
    command: str
    args: list[str]
    env: dict[str, str]


def hook_program() -> str | None:
    """The compiled hook (setup.py builds it beside the package), if it is there and runs."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bin", HOOK_PROGRAM)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def gemini_home() -> str:
    """Where Gemini CLI keeps its .gemini directory (GEMINI_CLI_HOME, else the home)."""
    return os.environ.get("GEMINI_CLI_HOME") or os.path.expanduser("~")


def qwen_home() -> str:
    """Gemini's fork qwen-code: QWEN_HOME, else ~/.qwen."""
    return os.environ.get("QWEN_HOME") or os.path.join(os.path.expanduser("~"), ".qwen")


def user_settings_path(agent: str = "claude-code") -> str:
    """The agent's user-level hooks file: read for every project, outside every captured tree."""
    home = os.path.expanduser("~")
    if agent == "codex":
        return os.path.join(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"), "hooks.json")
    if agent == "gemini":
        return os.path.join(gemini_home(), ".gemini", "settings.json")
    if agent == "qwen":
        return os.path.join(qwen_home(), "settings.json")
    if agent == "cursor":
        return os.path.join(home, ".cursor", "hooks.json")
    if agent == "opencode":  # our plugin, in opencode's user plugins directory
        from overlayckpt.agents.opencode import plugin_path
        return plugin_path()
    base = os.environ.get("CLAUDE_CONFIG_DIR") or os.path.join(home, ".claude")
    return os.path.join(base, "settings.json")


def mcp_config_path(agent: str, hooks_path: str) -> str | None:
    """The agent's user-level file naming its MCP servers."""
    if agent == "claude-code":  # user scope, as `claude mcp add --scope user` writes it
        return os.path.join(os.environ.get("CLAUDE_CONFIG_DIR") or os.path.expanduser("~"), ".claude.json")
    if agent in ("gemini", "qwen"):
        return hooks_path  # one settings.json holds both
    if agent == "cursor":
        return os.path.join(os.path.dirname(hooks_path), "mcp.json")
    if agent == "codex":  # [mcp_servers.NAME] tables beside hooks.json
        return os.path.join(os.path.dirname(hooks_path), "config.toml")
    return None


def _our_command(command: object) -> bool:
    """A hook command we installed: `PYTHON -P -m overlayckpt hook AGENT` or the
    compiled `.../overlayckpt/bin/overlayckpt-hook AGENT`."""
    text = str(command)
    return HOOK_MARK in text or f"/{HOOK_PROGRAM} " in text


def _is_ours(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    if _our_command(entry.get("command", "")):  # Cursor's entries are the commands
        return True
    hooks = entry.get("hooks")
    return isinstance(hooks, list) and any(isinstance(h, dict) and _our_command(h.get("command", ""))
                                           for h in hooks)


def _read_settings(path: str) -> dict[str, object]:
    """The JSON object in the user's settings file at path (empty if there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            settings: object = json.load(f)
        except ValueError as e:
            from overlayckpt.errors import UserError
            raise UserError(f"{path} is not valid JSON ({e}): fix it first") from None
    if not isinstance(settings, dict):
        from overlayckpt.errors import UserError
        raise UserError(f"{path} is not a JSON object: fix it first")
    return settings


def settings_dir(path: str, create: bool, levels: int = 1) -> None:
    """Make sure the directory of an agent's settings file is there before anything is
    written: create=True (the agent's own default, e.g. ~/.codex) makes that one
    directory 0700 if its parent exists (levels=2: opencode's ~/.config/opencode/plugins,
    if ~/.config exists); no deeper tree is made, and a path the user gave (--settings)
    must lie in an existing directory. UserError otherwise."""
    from overlayckpt.errors import UserError
    from overlayckpt.names import quote_path
    d = os.path.dirname(path)
    if os.path.isdir(d):
        return
    chain = [d]
    while len(chain) < levels and not os.path.isdir(os.path.dirname(chain[-1])):
        chain.append(os.path.dirname(chain[-1]))
    if create and os.path.isdir(os.path.dirname(chain[-1])):
        try:
            for step in reversed(chain):
                try:
                    os.mkdir(step, 0o700)
                except FileExistsError:
                    pass
            if os.path.isdir(d):
                return
        except OSError:
            pass
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


def _write_settings(path: str, settings: Mapping[str, object]) -> None:
    _replace_file(path, json.dumps(settings, indent=2) + "\n")


def _object_member(obj: dict[str, object], key: str, path: str) -> dict[str, object]:
    """obj[key], a JSON object, made empty if missing; a value of another type is the
    user's to fix."""
    value = obj.setdefault(key, {})
    if not isinstance(value, dict):
        _not_a(path, key, "object")
    return value


def _array_member(obj: dict[str, object], key: str, path: str) -> list[object]:
    """obj[key], a JSON array, made empty if missing; as _object_member."""
    value = obj.setdefault(key, [])
    if not isinstance(value, list):
        _not_a(path, key, "array")
    return value


def _not_a(path: str, key: str, kind: str) -> NoReturn:
    from overlayckpt.errors import UserError
    raise UserError(f"{path}: {key!r} is not a JSON {kind}: fix it first")


def _hook_entry(agent: str, event: str, command: str) -> HookEntry:
    if agent == "cursor":
        return {"command": command}  # (its timeout's unit is not documented clearly: its default)
    hook: CommandHook = {"type": "command", "command": command, "timeout": 10}
    if agent == "gemini":
        hook["name"], hook["timeout"] = "overlayckpt", 10_000  # milliseconds; no matcher: every tool
    if agent == "qwen":
        hook["timeout"] = 10_000  # qwen reads Claude's hooks, but its timeouts in milliseconds
    entry: HookEntry = {"hooks": [hook]}
    if agent in ("claude-code", "codex", "qwen") and event in TOOL_EVENTS:
        entry["matcher"] = "*"
    return entry


def install_hooks(path: str, command: str, agent: str = "claude-code") -> str:
    """Add our hooks to the agent's settings (hooks) file at path, keeping everything there.

    Installed in the user's settings (user_settings_path), not the project's: a file in
    the project lies in the captured tree, so restoring a checkpoint from before it
    (`restore 0 --code`) would delete it and silently stop the logging, and git would
    see it. Outside a mount the hook finds no mount and exits 0 at once.
    """
    if agent == "opencode":  # no hooks file: a plugin of ours that runs the command
        from overlayckpt.agents.opencode import plugin_text
        _replace_file(path, plugin_text(command))
        return path
    settings = _read_settings(path)
    if agent == "cursor":
        settings.setdefault("version", 1)
    hooks = _object_member(settings, "hooks", path)
    # Every hook stays synchronous (no "async": true): the conversation is kept in the
    # order its lines arrive, and a call's line must land before its changes, its result
    # before the next call (parallel tool calls are milliseconds apart), a prompt before
    # the first call it causes; `claude -p` may exit before a background Stop hook ends.
    # The compiled hook answers in about a millisecond (bench/hook.py).
    for event in AGENT_EVENTS[agent]:
        entries = _array_member(hooks, event, path)
        ours = [i for i, e in enumerate(entries) if _is_ours(e)]
        if ours:  # an earlier install's command (say, without -P) becomes this one, in place
            entries[ours[0]] = _hook_entry(agent, event, command)
            entries[:] = [e for i, e in enumerate(entries) if i not in ours[1:]]
        else:
            entries.append(_hook_entry(agent, event, command))
    if agent == "gemini":
        # Gemini shows "Executing Hooks: overlayckpt, ..." in its status row for every
        # hook run, two per tool call; a choice the user made is kept
        _object_member(settings, "hooksConfig", path).setdefault("notifications", False)
    _write_settings(path, settings)
    return path


def _drop_our_hooks(settings: dict[str, object]) -> bool:
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


def uninstall_hooks(path: str, agent: str = "claude-code") -> bool:
    """Take our hooks out of the agent's hooks file, keeping the rest; True if it changed.
    Gemini's hook notifications, which install_hooks turned off, are the default again."""
    if not os.path.exists(path):
        return False
    if agent == "opencode":  # our plugin file, and nothing but it
        from overlayckpt.agents.opencode import is_ours
        if not is_ours(path):
            return False
        os.unlink(path)
        return True
    settings = _read_settings(path)
    if not _drop_our_hooks(settings):
        return False
    config = settings.get("hooksConfig")
    if agent == "gemini" and isinstance(config, dict) and config.get("notifications") is False:
        del config["notifications"]
        if not config:
            del settings["hooksConfig"]
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


def _codex_toml(path: str) -> tuple[str, dict[str, object]]:
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


def _codex_has_ours(config: Mapping[str, object]) -> bool:
    """Whether the parsed config.toml names our MCP server."""
    servers = config.get("mcp_servers")
    return isinstance(servers, dict) and MCP_NAME in servers


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
        if _codex_has_ours(config):
            text = _without_codex_table(text)
        table = f'{CODEX_MCP_TABLE}\ncommand = {json.dumps(python)}\nargs = {json.dumps(MCP_ARGS)}\n'
        _replace_file(path, (text.rstrip("\n") + "\n\n" if text.strip() else "") + table)
        return path
    settings = _read_settings(path)
    servers = _object_member(settings, "mcpServers", path)
    server: McpServer = {"command": python, "args": MCP_ARGS}
    if agent == "claude-code":
        server = {"type": "stdio", "command": python, "args": MCP_ARGS, "env": {}}
    servers[MCP_NAME] = server
    _write_settings(path, settings)
    return path


def uninstall_mcp(path: str) -> bool:
    if not os.path.exists(path):
        return False
    if path.endswith(".toml"):
        text, config = _codex_toml(path)
        if not _codex_has_ours(config):
            return False
        _replace_file(path, _without_codex_table(text))
        return True
    settings = _read_settings(path)
    servers = settings.get("mcpServers")
    if not isinstance(servers, dict) or MCP_NAME not in servers:
        return False
    del servers[MCP_NAME]
    if not servers:  # (as it was before install_mcp made it)
        del settings["mcpServers"]
    _write_settings(path, settings)
    return True
