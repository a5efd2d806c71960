"""`overlayckpt mcp` with the mcp package's own client, over stdio, on a real mount: an agent
lists the timeline, checkpoints, sees the diff and restores; errors come back as tool errors."""
from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from conftest import CLI, Mount


def _structured(result: Any) -> Any:
    if result.structured_content is not None:
        data = result.structured_content
        return data.get("result", data) if isinstance(data, dict) and len(data) == 1 else data
    return json.loads(result.content[0].text)


async def _session(m: Mount) -> dict[str, Any]:
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "overlayckpt", "mcp", "--mount", str(m.mnt)])
    out: dict[str, Any] = {}
    async with Client(params) as client:
        out["tools"] = sorted(t.name for t in (await client.list_tools()).tools)
        (m.mnt / "README.md").write_text("changed by the agent\n")
        out["named"] = _structured(await client.call_tool("checkpoint", {"name": "before-risky"}))
        (m.mnt / "README.md").write_text("broken\n")
        (m.mnt / "new.txt").write_text("new\n")
        out["timeline"] = _structured(await client.call_tool("timeline", {"limit": 5}))
        out["diff"] = _structured(await client.call_tool("diff", {"a": "before-risky"}))
        out["restore"] = _structured(await client.call_tool("restore", {"checkpoint": "before-risky"}))
        out["readme"] = (m.mnt / "README.md").read_text()
        out["new_exists"] = (m.mnt / "new.txt").exists()
        out["bad"] = await client.call_tool("restore", {"checkpoint": "no-such"})
    return out


def test_an_mcp_client_lists_checkpoints_diffs_and_restores(mounted: Mount) -> None:
    out = asyncio.run(_session(mounted))
    assert out["tools"] == ["checkpoint", "diff", "restore", "timeline"]
    assert out["named"]["name"] == "before-risky"
    assert any(c.get("name") == "before-risky" for c in out["timeline"])
    assert {f["path"]: f["change"] for f in out["diff"]["files"]} == {"README.md": "M",
                                                                     "hardlink.md": "M",
                                                                     "new.txt": "A"}
    assert out["readme"] == "changed by the agent\n" and not out["new_exists"]
    assert out["restore"]["restored"] == out["named"]["id"]
    assert out["bad"].is_error and "unknown checkpoint" in out["bad"].content[0].text


def test_mcp_outside_a_mount_says_so_in_one_line(tmp_path: Path) -> None:
    """At a terminal: one line and exit 1. (An agent, stdin a pipe, gets a server whose
    tools say so: install-hooks registers it for every directory.)"""
    main, tty = pty.openpty()
    try:
        proc = subprocess.run(CLI + ["mcp"], stdin=tty, capture_output=True, text=True,
                              cwd=str(tmp_path), timeout=60)
    finally:
        os.close(main)
        os.close(tty)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "overlayckpt: no overlayckpt mount here: start the MCP server inside a mount, or pass --mount"]


async def _outside(cwd: Path) -> Any:
    params = StdioServerParameters(command=sys.executable, args=["-m", "overlayckpt", "mcp"], cwd=str(cwd))
    async with Client(params) as client:
        return await client.call_tool("timeline", {})


def test_mcp_started_by_an_agent_outside_a_mount_answers_each_call_so(tmp_path: Path) -> None:
    result = asyncio.run(_outside(tmp_path))
    assert result.is_error and "no overlayckpt mount here" in result.content[0].text
