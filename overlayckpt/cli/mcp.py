"""`overlayckpt mcp`: a Model Context Protocol server (stdio) over one mount's daemon.

Any MCP-capable agent can list its timeline, see what a checkpoint changed, take a
named checkpoint before something risky, and rewind, without a shell. Each tool is
one control command (the same ones the CLI sends), so the server holds no state
and the daemon stays the only writer. The `mcp` package is imported only here.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from overlayckpt.cli import client
from overlayckpt.cli.target import find_mount
from overlayckpt.errors import UserError

INSTRUCTIONS = (
    "overlayckpt records every change made under this directory as checkpoints. "
    "Use checkpoint before a risky step, timeline and diff to see what changed, "
    "and restore to undo: a restore is itself undoable (restore '@before-last').")
NO_MOUNT = "no overlayckpt mount here: start the MCP server inside a mount, or pass --mount"


def build(mountpoint: str | None) -> Any:
    """The server; mountpoint None (started outside any mount) answers every call with
    NO_MOUNT, so a user-level registration (install-hooks) does not show the agent a
    failed server in every directory that is not a mount."""
    from mcp.server import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("overlayckpt", instructions=INSTRUCTIONS)

    def call(cmd: dict[str, Any]) -> dict[str, Any]:
        if mountpoint is None:
            raise ToolError(NO_MOUNT)
        try:
            return client.send(mountpoint, cmd)
        except UserError as e:  # the daemon's one line, as the tool's error
            raise ToolError(str(e)) from None

    @server.tool()
    def timeline(limit: int = 20) -> list[dict[str, Any]]:
        """The newest checkpoints first: id, time, kind, name, process, summary, files."""
        return call({"cmd": "log", "limit": limit})["checkpoints"]

    @server.tool()
    def diff(a: str = "", b: str = "", stat: bool = True) -> dict[str, Any]:
        """What changed between checkpoints a and b (ids or names; b empty: the live tree;
        both empty: the last checkpoint against the live tree). stat=False gives the patch."""
        cmd: dict[str, Any] = {"cmd": "diff", "stat": stat}
        if a:
            cmd["a"] = _ref(a)
        if b:
            cmd["b"] = _ref(b)
        return call(cmd)

    @server.tool()
    def checkpoint(name: str = "", message: str = "") -> dict[str, Any]:
        """Take a checkpoint of the live tree now (a name makes it easy to come back to)."""
        return call({"cmd": "checkpoint", "name": name or None, "message": message or None})

    @server.tool()
    def restore(checkpoint: str, what: str = "code") -> dict[str, Any]:
        """Put the tree (what='code'), the conversation or both back to a checkpoint."""
        return call({"cmd": "restore", "id": _ref(checkpoint), "what": what})

    return server


def _ref(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def cmd_mcp(args: argparse.Namespace) -> int:
    mountpoint = find_mount(args.mount)
    if mountpoint is None and (args.mount or sys.stdin.isatty()):
        raise UserError(NO_MOUNT)  # a person at a terminal, or a wrong --mount
    try:
        server = build(mountpoint)
    except ImportError:
        raise UserError("the MCP server needs the mcp package: pip install 'overlayckpt[mcp]'"
                        ) from None
    server.run("stdio")
    return 0
