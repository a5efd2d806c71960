"""Gemini CLI and Cursor hooks: their documented payloads, fed to the real hooks (the
compiled one install-hooks writes and `overlayckpt hook`) inside a real mount, become the
conversation lines Claude Code's do, the same lines the Python hook made when it built them
itself; `install-hooks` merges our hooks and MCP server into each agent's user settings and
takes them out again."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import CLI, Mount, conversation, run_cli, summaries
from overlayckpt.agents.hooks import event_to_line
from overlayckpt.agents.lines import parse_line
from overlayckpt.agents.settings import hook_program

HOOKS = {"compiled": [str(hook_program())], "python": CLI + ["hook"]}


@pytest.fixture(params=list(HOOKS))
def hook_cmd(request: pytest.FixtureRequest) -> list[str]:
    """A hook command without its AGENT argument: the compiled one, and the Python one."""
    assert hook_program(), "the compiled hook is not built: setup.py build_ext --inplace"
    return HOOKS[request.param]


def gemini_events(cwd: str) -> list[dict[str, Any]]:
    """Fields as Gemini CLI's hooks reference names them (base fields + each event's)."""
    base = {"session_id": "g1", "transcript_path": "/tmp/g1.json", "cwd": cwd,
            "timestamp": "2026-12-01T10:00:00Z"}
    edit = {"file_path": f"{cwd}/src/main.py", "old_string": "hello", "new_string": "bye"}
    return [
        dict(base, hook_event_name="BeforeAgent", prompt="fix the greeting"),
        dict(base, hook_event_name="BeforeTool", tool_name="replace", tool_input=edit),
        dict(base, hook_event_name="AfterTool", tool_name="replace", tool_input=edit,
             tool_response={"llmContent": "Successfully modified src/main.py", "returnDisplay": "diff"}),
        dict(base, hook_event_name="BeforeTool", tool_name="run_shell_command", tool_input={"command": "false"}),
        dict(base, hook_event_name="AfterTool", tool_name="run_shell_command", tool_input={"command": "false"},
             tool_response={"llmContent": "", "returnDisplay": "", "error": {"message": "exit code 1"}}),
        dict(base, hook_event_name="AfterAgent", prompt="fix the greeting",
             prompt_response="Changed the greeting.", stop_hook_active=False),
    ]


def cursor_events(root: str) -> list[dict[str, Any]]:
    """Fields as Cursor's hooks documentation names them: no cwd, workspace_roots instead."""
    base = {"conversation_id": "c1", "generation_id": "gen1", "workspace_roots": [root],
            "model": "x", "cursor_version": "2.0"}
    write = {"file_path": f"{root}/notes.txt", "contents": "mine\n"}
    return [
        dict(base, hook_event_name="beforeSubmitPrompt", prompt="add notes", attachments=[]),
        dict(base, hook_event_name="preToolUse", tool_name="Write", tool_input=write, tool_use_id="cu_1"),
        dict(base, hook_event_name="postToolUse", tool_name="Write", tool_input=write, tool_output="ok",
             tool_use_id="cu_1"),
        dict(base, hook_event_name="postToolUseFailure", tool_name="Shell", tool_input={"command": "false"},
             error_message="exit 1", tool_use_id="cu_2"),
        dict(base, hook_event_name="afterAgentResponse", text="Added the notes."),
    ]


def opencode_events(cwd: str) -> list[dict[str, Any]]:
    """What our opencode plugin sends (agents/opencode.py): its hooks' input and output."""
    base = {"cwd": cwd, "session_id": "ses_1"}
    write = {"filePath": f"{cwd}/notes.txt", "content": "mine\n"}
    return [
        dict(base, hook_event_name="chat.message", prompt="add notes"),
        dict(base, hook_event_name="tool.execute.before", tool="write", call_id="call_1", args=write),
        dict(base, hook_event_name="tool.execute.after", tool="write", call_id="call_1", title="notes.txt",
             output="Wrote file successfully."),
        dict(base, hook_event_name="tool.execute.before", tool="bash", call_id="call_2",
             args={"command": "make test", "description": "test"}),
        dict(base, hook_event_name="tool.execute.error", tool="bash", call_id="call_2", error="exit 2"),
        dict(base, hook_event_name="session.idle", message="Added the notes."),
    ]


def claude_events(cwd: str) -> list[dict[str, Any]]:
    """Claude Code's (and qwen-code's, Codex's) fields, with what strains a hook: a Write
    of 2 MiB (the event over the daemon's 1 MiB line limit, the line made of it not), text
    outside the BMP, a lone surrogate, a path with a space, Codex's apply_patch."""
    base = {"session_id": "s1", "transcript_path": f"{cwd}/../t.jsonl", "cwd": cwd}
    big = {"file_path": f"{cwd}/big file.txt", "content": "x" * (2 << 20)}
    patch = "apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: src/main.py\n@@\n-a\n+b\n*** End Patch\nEOF"
    return [
        dict(base, hook_event_name="UserPromptSubmit", prompt="fix it \U0001F600 and \ud83d that"),
        dict(base, hook_event_name="PreToolUse", tool_name="Write", tool_use_id="toolu_1", tool_input=big),
        dict(base, hook_event_name="PostToolUse", tool_name="Write", tool_use_id="toolu_1", tool_input=big,
             tool_response={"success": True}),
        dict(base, hook_event_name="PreToolUse", tool_name="Bash", tool_use_id="call_2",
             tool_input={"command": patch}),
        dict(base, hook_event_name="PostToolUseFailure", tool_name="Bash", tool_use_id="call_2",
             tool_input={"command": "false"}, error="Exit code 1", is_interrupt=True),
        dict(base, hook_event_name="SessionStart", source="startup"),  # logs nothing
        dict(base, hook_event_name="Stop", stop_hook_active=False, last_assistant_message="Done.\nAll of it."),
    ]


def hook(agent: str, event: dict[str, Any], cwd: Path, command: list[str] | None = None,
         text: str | None = None) -> None:
    proc = subprocess.run((command or HOOKS["compiled"]) + [agent], input=text or json.dumps(event),
                          text=True, capture_output=True, cwd=str(cwd), timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    if agent in ("gemini", "cursor"):
        assert json.loads(proc.stdout) == {}  # both agents read a JSON answer: allow
    else:
        assert proc.stdout == ""  # Claude adds a hook's output to the model's context


def stored(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in x.items() if k not in ("line", "seq", "time")} for x in lines]


def test_both_hooks_log_the_lines_the_python_hook_made(mounted: Mount) -> None:
    """The same recorded events through the compiled hook and through `overlayckpt hook`
    give the lines the Python hook wrote when it made them itself (event_to_line, then the
    daemon's parse), whatever the agent; one event pretty-printed over many lines."""
    cwd = str(mounted.mnt)
    cases = [("claude-code", claude_events(cwd)), ("codex", claude_events(cwd)[3:]),
             ("qwen", claude_events(cwd)), ("gemini", gemini_events(cwd)), ("cursor", cursor_events(cwd)),
             ("opencode", opencode_events(cwd))]
    expected = []
    for agent, events in cases:
        for event in events:
            made = event_to_line(event, agent)
            if made is not None:  # what the hook wrote, then what the daemon kept of it
                expected.append(parse_line(json.dumps(made, ensure_ascii=False).encode("utf-8", "surrogatepass")))
    for command in HOOKS.values():
        for agent, events in cases:
            for event in events:
                hook(agent, event, mounted.mnt, command)
    hook("claude-code", {}, mounted.mnt, HOOKS["compiled"], json.dumps(claude_events(cwd)[0], indent=2))
    got = stored(conversation(mounted))
    assert got[:len(expected)] == expected
    assert got[len(expected):-1] == expected
    assert got[-1] == expected[0]
    assert len(got[1]["content"]) < 400 and got[1]["summary"] == "Write big file.txt"


def test_opencode_events_are_the_conversation(mounted: Mount, hook_cmd: list[str]) -> None:
    cwd = str(mounted.mnt)
    for event in opencode_events(cwd):
        hook("opencode", event, mounted.mnt, hook_cmd)
    got = [(x["role"], x.get("tool"), x.get("summary"), x["content"], x["event"], x.get("tool_use_id"))
           for x in conversation(mounted)]
    assert got == [
        ("user", None, None, "add notes", "UserPromptSubmit", None),
        ("assistant", "write", "write notes.txt", json.dumps({"file_path": f"{cwd}/notes.txt", "content": "mine\n"}),
         "PreToolUse", "call_1"),
        ("tool", "write", None, "Wrote file successfully.", "PostToolUse", "call_1"),
        ("assistant", "bash", "bash make test", json.dumps({"command": "make test", "description": "test"}),
         "PreToolUse", "call_2"),
        ("tool", "bash", None, "exit 2", "PostToolUseFailure", "call_2"),
        ("assistant", None, None, "Added the notes.", "Stop", None),
    ]
    assert {x["agent"] for x in conversation(mounted)} == {"opencode"}


def test_install_hooks_opencode_writes_its_plugin_and_uninstalls(tmp_path: Path) -> None:
    """The plugin goes into opencode's user plugins directory (made, 0700, below
    ~/.config), runs the compiled hook, and --uninstall removes it and nothing else."""
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env["HOME"] = str(home)
    run_cli("install-hooks", "opencode", env=env)
    plugins = home / ".config" / "opencode" / "plugins"
    plugin = plugins / "overlayckpt.js"
    text = plugin.read_text()
    assert text.startswith("// overlayckpt: ") and json.dumps([str(hook_program()), "opencode"]) in text
    assert plugins.stat().st_mode & 0o777 == 0o700 and plugin.stat().st_mode & 0o777 == 0o600
    run_cli("install-hooks", "opencode", env=env)  # again: the same file
    assert plugin.read_text() == text
    (plugins / "theirs.js").write_text("export const P = async () => ({})\n")
    mine = plugins / "mine.js"
    mine.write_text("// my own plugin\n")
    assert "removed" in run_cli("install-hooks", "opencode", "--uninstall", env=env).stdout
    assert sorted(p.name for p in plugins.iterdir()) == ["mine.js", "theirs.js"]
    assert "no hooks of ours" in run_cli("install-hooks", "opencode", "--uninstall", "--settings", str(mine),
                                         env=env).stdout
    assert mine.read_text() == "// my own plugin\n"


def test_gemini_events_are_the_conversation(mounted: Mount, hook_cmd: list[str]) -> None:
    events = gemini_events(str(mounted.mnt))
    for event in events[:2]:
        hook("gemini", event, mounted.mnt, hook_cmd)
    subprocess.run(["sh", "-c", "printf 'bye\\n' > src/main.py"], cwd=mounted.mnt, check=True, timeout=30)
    for event in events[2:]:
        hook("gemini", event, mounted.mnt, hook_cmd)
    lines = conversation(mounted)
    assert [x["event"] for x in lines] == ["UserPromptSubmit", "PreToolUse", "PostToolUse", "PreToolUse",
                                           "PostToolUseFailure", "Stop"]
    assert [x["agent_event"] for x in lines] == [e["hook_event_name"] for e in events]
    prompt, call, result, shell, failure, stop = lines
    assert prompt["role"] == "user" and prompt["content"] == "fix the greeting" and prompt["agent"] == "gemini"
    assert call["summary"] == "replace src/main.py" and call["session_id"] == "g1"
    assert result["role"] == "tool" and result["content"] == "Successfully modified src/main.py"
    assert shell["summary"] == "run_shell_command false"
    assert failure["failed"] is True and failure["content"] == "exit code 1"
    assert stop["role"] == "assistant" and stop["content"] == "Changed the greeting."
    assert summaries(mounted)["src/main.py"] == "replace src/main.py"


def test_cursor_events_are_the_conversation(mounted: Mount, tmp_path: Path, hook_cmd: list[str]) -> None:
    events = cursor_events(str(mounted.mnt))
    for event in events[:2]:
        hook("cursor", event, tmp_path, hook_cmd)  # run outside the mount: workspace_roots finds it
    (mounted.mnt / "notes.txt").write_text("mine\n")
    for event in events[2:]:
        hook("cursor", event, tmp_path, hook_cmd)
    lines = conversation(mounted)
    assert [x["event"] for x in lines] == ["UserPromptSubmit", "PreToolUse", "PostToolUse",
                                           "PostToolUseFailure", "Stop"]
    prompt, call, result, failure, stop = lines
    assert prompt["content"] == "add notes" and prompt["session_id"] == "c1" and prompt["agent"] == "cursor"
    assert call["summary"] == "Write notes.txt" and call["tool_use_id"] == result["tool_use_id"] == "cu_1"
    assert result["content"] == "ok" and "failed" not in result
    assert failure["failed"] is True and failure["content"] == "exit 1" and failure["tool_use_id"] == "cu_2"
    assert stop["content"] == "Added the notes."
    assert summaries(mounted)["notes.txt"] == "Write notes.txt"


def install(agent: str, home: Path, *extra: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAUDE_", "CODEX_"))}
    run_cli("install-hooks", agent, "--project", str(home), *extra, env=dict(env, HOME=str(home)))


def ours(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if "overlayckpt-hook " in json.dumps(e)]


MCP = {"command": sys.executable, "args": ["-P", "-m", "overlayckpt", "mcp"]}
HOOK = str(hook_program())  # install-hooks writes the compiled hook's absolute path


def test_install_hooks_gemini_merges_and_uninstalls(tmp_path: Path) -> None:
    settings = tmp_path / ".gemini" / "settings.json"
    settings.parent.mkdir()
    mine: dict[str, Any] = {"theme": "GitHub", "hooks": {"BeforeTool": [{"matcher": "write_file", "hooks": [
        {"type": "command", "command": "./check.sh"}]}]}, "mcpServers": {"other": {"command": "srv"}}}
    settings.write_text(json.dumps(mine))
    for _ in range(2):  # idempotent
        install("gemini", tmp_path)
    got = json.loads(settings.read_text())
    assert got["theme"] == "GitHub" and got["hooks"]["BeforeTool"][0] == mine["hooks"]["BeforeTool"][0]
    for event in ("BeforeAgent", "BeforeTool", "AfterTool", "AfterAgent"):
        [entry] = ours(got["hooks"][event])
        [h] = entry["hooks"]
        assert h["type"] == "command" and h["command"] == f"{HOOK} gemini"
        assert h["timeout"] == 10_000  # Gemini's timeouts are milliseconds
    assert got["mcpServers"] == {"other": {"command": "srv"}, "overlayckpt": MCP}
    assert got["hooksConfig"] == {"notifications": False}  # no "Executing Hooks: overlayckpt, ..."
    install("gemini", tmp_path, "--uninstall")
    assert json.loads(settings.read_text()) == mine


def test_install_hooks_gemini_keeps_the_users_notification_choice(tmp_path: Path) -> None:
    settings = tmp_path / ".gemini" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"hooksConfig": {"notifications": True, "disabled": ["x"]}}))
    install("gemini", tmp_path)
    assert json.loads(settings.read_text())["hooksConfig"] == {"notifications": True, "disabled": ["x"]}


def test_install_hooks_qwen_writes_millisecond_timeouts(tmp_path: Path) -> None:
    """qwen-code reads Claude's hooks from ~/.qwen/settings.json, timeouts in milliseconds
    (seconds there: 10 ms, and nothing is ever logged); its MCP servers in the same file."""
    settings = tmp_path / ".qwen" / "settings.json"
    settings.parent.mkdir()
    mine: dict[str, Any] = {"model": {"name": "x"},
                            "hooks": {"Stop": [{"hooks": [{"type": "command", "command": "./done.sh"}]}]}}
    settings.write_text(json.dumps(mine))
    for _ in range(2):
        install("qwen", tmp_path)
    got = json.loads(settings.read_text())
    assert got["model"] == mine["model"] and got["hooks"]["Stop"][0] == mine["hooks"]["Stop"][0]
    for event in ("UserPromptSubmit", "PreToolUse", "PostToolUse", "PostToolUseFailure", "Stop"):
        [entry] = ours(got["hooks"][event])
        assert entry["hooks"] == [{"type": "command", "command": f"{HOOK} qwen", "timeout": 10_000}]
        assert entry.get("matcher") == ("*" if "Tool" in event else None)
    assert got["mcpServers"] == {"overlayckpt": MCP}
    install("qwen", tmp_path, "--uninstall")
    assert json.loads(settings.read_text()) == mine


def test_install_hooks_cursor_merges_and_uninstalls(tmp_path: Path) -> None:
    hooks, mcp = tmp_path / ".cursor" / "hooks.json", tmp_path / ".cursor" / "mcp.json"
    hooks.parent.mkdir()
    mine: dict[str, Any] = {"version": 1, "hooks": {"afterFileEdit": [{"command": "./format.sh"}],
                                                    "preToolUse": [{"command": "./guard.sh", "matcher": "Shell"}]}}
    hooks.write_text(json.dumps(mine))
    mcp.write_text(json.dumps({"mcpServers": {"other": {"url": "http://x"}}}))
    for _ in range(2):
        install("cursor", tmp_path)
    got = json.loads(hooks.read_text())
    assert got["version"] == 1 and got["hooks"]["afterFileEdit"] == mine["hooks"]["afterFileEdit"]
    for event in ("beforeSubmitPrompt", "preToolUse", "postToolUse", "postToolUseFailure", "afterAgentResponse"):
        [entry] = ours(got["hooks"][event])
        assert entry["command"] == f"{HOOK} cursor"
    assert got["hooks"]["preToolUse"][0] == mine["hooks"]["preToolUse"][0]
    assert json.loads(mcp.read_text())["mcpServers"] == {"other": {"url": "http://x"}, "overlayckpt": MCP}
    install("cursor", tmp_path, "--uninstall")
    assert json.loads(hooks.read_text()) == mine
    assert json.loads(mcp.read_text()) == {"mcpServers": {"other": {"url": "http://x"}}}


def test_install_hooks_fresh_cursor_file_is_version_1(tmp_path: Path) -> None:
    install("cursor", tmp_path)
    assert json.loads((tmp_path / ".cursor" / "hooks.json").read_text())["version"] == 1


def test_install_hooks_claude_registers_the_mcp_server_at_user_scope(tmp_path: Path) -> None:
    user = tmp_path / ".claude.json"
    mine: dict[str, Any] = {"numStartups": 3, "projects": {"/x": {"allowedTools": []}},
                            "mcpServers": {"other": {"type": "stdio", "command": "srv", "args": [], "env": {}}}}
    user.write_text(json.dumps(mine))
    install("claude-code", tmp_path)
    got = json.loads(user.read_text())
    assert got["numStartups"] == 3 and got["projects"] == mine["projects"]
    assert got["mcpServers"] == {**mine["mcpServers"], "overlayckpt": {"type": "stdio", **MCP, "env": {}}}
    install("claude-code", tmp_path, "--uninstall")
    assert json.loads(user.read_text()) == mine
    assert "hooks" not in json.loads((tmp_path / ".claude" / "settings.json").read_text())


def test_install_hooks_no_mcp_leaves_the_mcp_config_alone(tmp_path: Path) -> None:
    install("cursor", tmp_path, "--no-mcp")
    assert not (tmp_path / ".cursor" / "mcp.json").exists()


async def _list_tools(command: str, args: list[str], cwd: Path) -> list[str]:
    async with Client(StdioServerParameters(command=command, args=args, cwd=str(cwd))) as client:
        return sorted(t.name for t in (await client.list_tools()).tools)


def test_the_registered_mcp_server_serves_the_mount_it_starts_in(mounted: Mount, tmp_path: Path) -> None:
    install("cursor", tmp_path)
    server = json.loads((tmp_path / ".cursor" / "mcp.json").read_text())["mcpServers"]["overlayckpt"]
    tools = asyncio.run(_list_tools(server["command"], server["args"], mounted.mnt / "src"))
    assert tools == ["checkpoint", "diff", "restore", "timeline"]


def test_install_hooks_refuses_settings_of_another_shape(tmp_path: Path) -> None:
    settings = tmp_path / ".gemini" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"hooks": [{"command": "old-style"}]}))
    env = dict(os.environ, HOME=str(tmp_path))
    proc = run_cli("install-hooks", "gemini", env=env, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"overlayckpt: {settings}: 'hooks' is not a JSON object: fix it first"]
    assert json.loads(settings.read_text()) == {"hooks": [{"command": "old-style"}]}


def test_install_hooks_codex_registers_the_mcp_server_in_config_toml(tmp_path: Path) -> None:
    import tomllib
    config = tmp_path / ".codex" / "config.toml"
    config.parent.mkdir()
    mine = 'model = "gpt-5"\n\n[mcp_servers.other]\ncommand = "srv"\n\n[profiles.fast]\nmodel = "x"\n'
    config.write_text(mine)
    for _ in range(2):  # idempotent
        install("codex", tmp_path)
    got = tomllib.loads(config.read_text())
    assert got["model"] == "gpt-5" and got["profiles"] == {"fast": {"model": "x"}}
    assert got["mcp_servers"] == {"other": {"command": "srv"}, "overlayckpt": MCP}
    install("codex", tmp_path, "--uninstall")
    assert config.read_text() == mine
