"""`overlayckpt mcp`: a Model Context Protocol server (stdio) over one mount's daemon.

Any MCP-capable agent can list its timeline, see what a checkpoint changed, take a
named checkpoint before something risky, and rewind, without a shell. Each tool is
one control command (the same ones the CLI sends), so the server holds no state
and the daemon stays the only writer.

The protocol is JSON-RPC 2.0, one message per line, spoken here directly (no MCP
SDK): it starts in the time of a CLI command, and every line that is not a valid
request gets the error JSON-RPC prescribes instead of being dropped: -32700 (not
JSON, id null), -32600 (not a request), -32601 (no such method), -32602 (bad
params: an unknown tool, an argument of the wrong type). A tool the daemon refuses
(an unknown checkpoint, a bad name) is a tool result with isError and its one line,
as MCP wants, so the model can read it and correct itself. Both handshakes are
answered: `initialize` (protocol versions up to 2025-11-25) and `server/discover`
(2026-07-28, stateless).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO, NotRequired, TypedDict, TypeVar

from overlayckpt.cli import client
from overlayckpt.cli.target import find_mount
from overlayckpt.errors import UserError
from overlayckpt.messages import CheckpointRequest, DiffRequest, LogRequest, Request, RestoreRequest
from overlayckpt.names import parse_ref  # a checkpoint id or name, as the CLI reads it

INSTRUCTIONS = (
    "overlayckpt records every change made under this directory as checkpoints. "
    "Use checkpoint before a risky step, timeline and diff to see what changed, "
    "and restore to undo: a restore is itself undoable (restore '@before-last').")
NO_MOUNT = "no overlayckpt mount here: start the MCP server inside a mount, or pass --mount"

SERVER_INFO = {"name": "overlayckpt", "version": "0.1.0"}
STATELESS = "2026-07-28"  # server/discover, no initialize
HANDSHAKE_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")  # newest first
CAPABILITIES = {"tools": {"listChanged": False}}
MAX_MESSAGE = 4 << 20  # bytes of one line; longer is answered -32700 and skipped

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = (
    -32700, -32600, -32601, -32602, -32603)


class Prop(TypedDict):
    """One argument of a tool, in JSON Schema: its type, and what else it says."""
    type: str
    default: NotRequired[object]
    enum: NotRequired[list[str]]
    minimum: NotRequired[int]


class Schema(TypedDict):
    type: str
    properties: dict[str, Prop]
    title: str
    additionalProperties: bool
    required: NotRequired[list[str]]


class Tool(TypedDict):
    name: str
    description: str
    inputSchema: Schema
    outputSchema: dict[str, object]


def _schema(title: str, props: dict[str, Prop], required: tuple[str, ...] = ()) -> Schema:
    out: Schema = {"type": "object", "properties": props, "title": title,
                   "additionalProperties": False}
    if required:
        out["required"] = list(required)
    return out


def _str(default: str | None = None) -> Prop:
    return {"type": "string"} if default is None else {"type": "string", "default": default}


DICT_OUT: dict[str, object] = {"type": "object", "additionalProperties": True}
TOOLS: list[Tool] = [
    {"name": "timeline",
     "description": "The newest checkpoints first: id, time, kind, name, process, summary, files.",
     "inputSchema": _schema("timelineArguments", {"limit": {"type": "integer", "default": 20,
                                                            "minimum": 0}}),
     "outputSchema": {"type": "object", "required": ["result"], "properties": {
         "result": {"type": "array", "items": DICT_OUT}}}},
    {"name": "diff",
     "description": "What changed between checkpoints a and b (ids or names; b empty: the live "
                    "tree; both empty: the last checkpoint against the live tree). stat=false "
                    "gives the patch.",
     "inputSchema": _schema("diffArguments", {"a": _str(""), "b": _str(""),
                                              "stat": {"type": "boolean", "default": True}}),
     "outputSchema": DICT_OUT},
    {"name": "checkpoint",
     "description": "Take a checkpoint of the live tree now (a name makes it easy to come back to).",
     "inputSchema": _schema("checkpointArguments", {"name": _str(""), "message": _str("")}),
     "outputSchema": DICT_OUT},
    {"name": "restore",
     "description": "Put the tree (what='code'), the conversation or both back to a checkpoint.",
     "inputSchema": _schema("restoreArguments", {
         "checkpoint": _str(), "what": {"type": "string", "default": "code",
                                        "enum": ["code", "conversation", "both"]}},
         ("checkpoint",)),
     "outputSchema": DICT_OUT},
]
_BY_NAME = {t["name"]: t for t in TOOLS}
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "boolean": (bool,)}
_A = {"string": "a string", "integer": "an integer", "boolean": "true or false"}


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: object = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


def _arguments(tool: Tool, args: object) -> dict[str, object]:
    """args checked against the tool's input schema, defaults filled in; else -32602."""
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params", f"{tool['name']}: arguments must be an object")
    schema = tool["inputSchema"]
    out: dict[str, object] = {}
    for key, value in args.items():
        prop = schema["properties"].get(key)
        if prop is None:
            raise RpcError(INVALID_PARAMS, "Invalid params",
                           f"{tool['name']}: unknown argument {key!r}; it takes "
                           f"{', '.join(schema['properties'])}")
        wanted = _JSON_TYPES[prop["type"]]
        if not isinstance(value, wanted) or (bool not in wanted and isinstance(value, bool)):
            raise RpcError(INVALID_PARAMS, "Invalid params",
                           f"{tool['name']}: argument {key!r} must be {_A[prop['type']]}")
        if "enum" in prop and value not in prop["enum"]:
            raise RpcError(INVALID_PARAMS, "Invalid params",
                           f"{tool['name']}: argument {key!r} must be one of {', '.join(prop['enum'])}")
        if "minimum" in prop and isinstance(value, int) and value < prop["minimum"]:
            raise RpcError(INVALID_PARAMS, "Invalid params",
                           f"{tool['name']}: argument {key!r} must be at least {prop['minimum']}")
        out[key] = value
    for key in schema.get("required", ()):
        if key not in out:
            raise RpcError(INVALID_PARAMS, "Invalid params", f"{tool['name']}: {key!r} is required")
    for key, prop in schema["properties"].items():
        if key not in out and "default" in prop:
            out[key] = prop["default"]
    return out


T = TypeVar("T")


def _arg(a: Mapping[str, object], key: str, kind: type[T]) -> T:
    """A checked argument (_arguments: of its schema's type, its default filled in)."""
    value = a[key]
    if not isinstance(value, kind):
        raise RpcError(INVALID_PARAMS, "Invalid params", f"argument {key!r} has the wrong type")
    return value


def _command(name: str, a: Mapping[str, object]) -> Request[Any]:
    """The control command of tool name with its checked arguments."""
    if name == "timeline":
        return LogRequest(limit=_arg(a, "limit", int))
    if name == "diff":
        first, second = _arg(a, "a", str), _arg(a, "b", str)
        return DiffRequest(a=parse_ref(first) if first else None,
                           b=parse_ref(second) if second else None, stat=_arg(a, "stat", bool))
    if name == "checkpoint":
        return CheckpointRequest(name=_arg(a, "name", str) or None,
                                 message=_arg(a, "message", str) or None)
    return RestoreRequest(id=parse_ref(_arg(a, "checkpoint", str)), what=_arg(a, "what", str))


class Server:
    """Answers one JSON-RPC line at a time (a tool call is one control command)."""

    def __init__(self, mountpoint: str | None) -> None:
        # None (started outside any mount) answers every call with NO_MOUNT, so a
        # user-level registration (install-hooks) does not show the agent a failed
        # server in every directory that is not a mount
        self.mountpoint = mountpoint

    def answer(self, line: bytes) -> dict[str, object] | None:
        """The response to line, or None (a notification, a response, a blank line)."""
        if not line.strip():
            return None
        try:
            msg = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
            why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8 JSON text"
            return _error(None, PARSE_ERROR, "Parse error", why)
        if not isinstance(msg, dict):
            return _error(None, INVALID_REQUEST, "Invalid Request",
                          "a message is one JSON object (batches are not supported)")
        has_id = "id" in msg
        rid = msg.get("id")
        if has_id and (isinstance(rid, bool) or not isinstance(rid, (int, str))):
            return _error(None, INVALID_REQUEST, "Invalid Request", "id must be a string or an integer")
        if "method" not in msg and ("result" in msg or "error" in msg):
            return None  # a response: we send the client no requests, nothing to match
        method, params = msg.get("method"), msg.get("params")
        if msg.get("jsonrpc") != "2.0" or not isinstance(method, str):
            return _error(rid, INVALID_REQUEST, "Invalid Request",
                          'a request has "jsonrpc": "2.0" and a "method" string')
        if params is not None and not isinstance(params, (dict, list)):
            return _error(rid, INVALID_REQUEST, "Invalid Request", "params must be an object")
        if not has_id:
            return None  # a notification (initialized, cancelled, ...): never answered
        try:
            if isinstance(params, list):
                raise RpcError(INVALID_PARAMS, "Invalid params", "params must be an object")
            result = self.call(method, params or {})
        except RpcError as e:
            return _error(rid, e.code, e.message, e.data)
        except Exception as e:  # a bug of ours: still an answer, never silence
            return _error(rid, INTERNAL_ERROR, "Internal error", str(e))
        return {"jsonrpc": "2.0", "id": rid, "result": result}

    def call(self, method: str, params: Mapping[str, object]) -> dict[str, object]:
        meta = {"_meta": {"io.modelcontextprotocol/serverInfo": SERVER_INFO}}
        if method == "initialize":
            asked = params.get("protocolVersion")
            if not isinstance(asked, str):
                raise RpcError(INVALID_PARAMS, "Invalid params", "protocolVersion must be a string")
            version = asked if asked in HANDSHAKE_VERSIONS else HANDSHAKE_VERSIONS[0]
            return {"protocolVersion": version, "capabilities": CAPABILITIES,
                    "serverInfo": SERVER_INFO, "instructions": INSTRUCTIONS}
        if method == "server/discover":
            return {"supportedVersions": [STATELESS, *HANDSHAKE_VERSIONS],
                    "capabilities": CAPABILITIES, "instructions": INSTRUCTIONS,
                    "cacheScope": "private", "ttlMs": 0, "resultType": "complete", **meta}
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": TOOLS, "cacheScope": "private", "ttlMs": 0, "resultType": "complete",
                    **meta}
        if method == "tools/call":
            name = params.get("name")
            tool = _BY_NAME.get(name) if isinstance(name, str) else None
            if tool is None:
                raise RpcError(INVALID_PARAMS, "Invalid params",
                               f"Unknown tool: {name!r}; tools: {', '.join(_BY_NAME)}")
            cmd = _command(tool["name"], _arguments(tool, params.get("arguments")))
            return {**self.tool(tool["name"], cmd), "resultType": "complete", **meta}
        raise RpcError(METHOD_NOT_FOUND, "Method not found", method)

    def tool(self, name: str, cmd: Request[Any]) -> dict[str, object]:
        if self.mountpoint is None:
            return _tool_error(NO_MOUNT)
        try:
            reply: Mapping[str, object] = client.send(self.mountpoint, cmd)
        except UserError as e:  # the daemon's one line, as the tool's error
            return _tool_error(str(e))
        value = reply["checkpoints"] if name == "timeline" else reply
        structured = {"result": value} if name == "timeline" else value
        return {"content": [{"type": "text", "text": json.dumps(value, indent=2)}],
                "structuredContent": structured, "isError": False}

    def serve(self, stdin: BinaryIO, stdout: BinaryIO) -> None:
        while True:
            line = stdin.readline(MAX_MESSAGE + 1)
            if not line:
                return
            if len(line) > MAX_MESSAGE and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # skip the rest of it
                    line = stdin.readline(1 << 20)
                response: dict[str, object] | None = _error(
                    None, PARSE_ERROR, "Parse error", f"message longer than {MAX_MESSAGE} bytes")
            else:
                response = self.answer(line)
            if response is not None:  # (ASCII: a lone surrogate in a name cannot break it)
                stdout.write(json.dumps(response, separators=(",", ":")).encode() + b"\n")
                stdout.flush()


def _no_constant(word: str) -> object:
    raise ValueError(f"{word} is not a JSON number")


def _error(rid: object, code: int, message: str, data: object = None) -> dict[str, object]:
    """A JSON-RPC error: message is the standard one with what went wrong after it (what
    a client shows), data the detail alone."""
    error: dict[str, object] = {"code": code, "message": message}
    if data is not None:
        error["message"] = f"{message}: {data}"
        error["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": error}


def _tool_error(text: str) -> dict[str, object]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


def cmd_mcp(args: argparse.Namespace) -> int:
    mountpoint = find_mount(args.mount)
    if mountpoint is None and (args.mount or sys.stdin.isatty()):
        raise UserError(NO_MOUNT)  # a person at a terminal, or a wrong --mount
    Server(mountpoint).serve(sys.stdin.buffer, sys.stdout.buffer)
    return 0
