"""Gemini CLI and Cursor hooks: their documented payloads, fed to the real hook entry point
inside a real mount, become the conversation lines Claude Code's do; `install-hooks` merges
our hooks and MCP server into each agent's user settings and takes them out again."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import CLI, Mount, conversation, run_cli, summaries


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


def hook(agent: str, event: dict[str, Any], cwd: Path) -> None:
    proc = subprocess.run(CLI + ["hook", agent], input=json.dumps(event), text=True,
                          capture_output=True, cwd=str(cwd), timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout) == {}  # both agents read a JSON answer: allow


def test_gemini_events_are_the_conversation(mounted: Mount) -> None:
    events = gemini_events(str(mounted.mnt))
    for event in events[:2]:
        hook("gemini", event, mounted.mnt)
    subprocess.run(["sh", "-c", "printf 'bye\\n' > src/main.py"], cwd=mounted.mnt, check=True, timeout=30)
    for event in events[2:]:
        hook("gemini", event, mounted.mnt)
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


def test_cursor_events_are_the_conversation(mounted: Mount, tmp_path: Path) -> None:
    events = cursor_events(str(mounted.mnt))
    for event in events[:2]:
        hook("cursor", event, tmp_path)  # run outside the mount: workspace_roots finds it
    (mounted.mnt / "notes.txt").write_text("mine\n")
    for event in events[2:]:
        hook("cursor", event, tmp_path)
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
    return [e for e in entries if "overlayckpt hook" in json.dumps(e)]


MCP = {"command": sys.executable, "args": ["-P", "-m", "overlayckpt", "mcp"]}


def test_install_hooks_gemini_merges_and_uninstalls(tmp_path: Path) -> None:
    settings = tmp_path / ".gemini" / "settings.json"
    settings.parent.mkdir()
    mine = {"theme": "GitHub", "hooks": {"BeforeTool": [{"matcher": "write_file", "hooks": [
        {"type": "command", "command": "./check.sh"}]}]}, "mcpServers": {"other": {"command": "srv"}}}
    settings.write_text(json.dumps(mine))
    for _ in range(2):  # idempotent
        install("gemini", tmp_path)
    got = json.loads(settings.read_text())
    assert got["theme"] == "GitHub" and got["hooks"]["BeforeTool"][0] == mine["hooks"]["BeforeTool"][0]
    for event in ("BeforeAgent", "BeforeTool", "AfterTool", "AfterAgent"):
        [entry] = ours(got["hooks"][event])
        [h] = entry["hooks"]
        assert h["type"] == "command" and h["command"].endswith("-m overlayckpt hook gemini")
        assert h["timeout"] == 10_000  # Gemini's timeouts are milliseconds
    assert got["mcpServers"] == {"other": {"command": "srv"}, "overlayckpt": MCP}
    install("gemini", tmp_path, "--uninstall")
    assert json.loads(settings.read_text()) == mine


def test_install_hooks_cursor_merges_and_uninstalls(tmp_path: Path) -> None:
    hooks, mcp = tmp_path / ".cursor" / "hooks.json", tmp_path / ".cursor" / "mcp.json"
    hooks.parent.mkdir()
    mine = {"version": 1, "hooks": {"afterFileEdit": [{"command": "./format.sh"}],
                                    "preToolUse": [{"command": "./guard.sh", "matcher": "Shell"}]}}
    hooks.write_text(json.dumps(mine))
    mcp.write_text(json.dumps({"mcpServers": {"other": {"url": "http://x"}}}))
    for _ in range(2):
        install("cursor", tmp_path)
    got = json.loads(hooks.read_text())
    assert got["version"] == 1 and got["hooks"]["afterFileEdit"] == mine["hooks"]["afterFileEdit"]
    for event in ("beforeSubmitPrompt", "preToolUse", "postToolUse", "postToolUseFailure", "afterAgentResponse"):
        [entry] = ours(got["hooks"][event])
        assert entry["command"].endswith("-m overlayckpt hook cursor")
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
    mine = {"numStartups": 3, "projects": {"/x": {"allowedTools": []}},
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
