"""A scripted stand-in for the model APIs on 127.0.0.1, for the real agent CLIs: the
Anthropic Messages API (Claude Code), the OpenAI Responses API (Codex), the Gemini API
(`models/M:streamGenerateContent`, `:generateContent`, `:countTokens`: Gemini CLI) and
OpenAI Chat Completions (qwen-code, opencode, Aider), streamed as server-sent events or
not, as the agents ask.

Every request that offers tools (the agent's own turn) gets the next step of the
script: a tool call (name, input) or, at the end, a final text. Other requests
(titles, summaries, token counts) get a short text, so the script is not consumed
by them. Every request body is kept in `requests`, so a test can read the history
an agent sent (for example after `claude --resume`).
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def agent_cli(name: str, path: Path | None = None) -> Path:
    """An agent CLI pinned in the Makefile (.agents/node_modules/.bin/NAME, or path);
    installed by `make agents` if missing, the test skipped only if that fails (no
    network)."""
    path = path or ROOT / ".agents" / "node_modules" / ".bin" / name
    if not path.exists():
        proc = subprocess.run(["make", "-C", str(ROOT), "agents"], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0 or not path.exists():
            last = (proc.stderr.strip() or proc.stdout.strip() or "?").splitlines()[-1]
            pytest.skip(f"{name} could not be installed (`make agents`): {last}")
    return path

def run_agent(argv: Sequence[Any], env: dict[str, str] | None, cwd: Path, timeout: float = 180,
              stdin: int | None = subprocess.DEVNULL) -> str:
    """Run an agent CLI (argv[0]) to its end; its stdout, the test failed with its
    output if it exits non-zero."""
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False, stdin=stdin)
    assert proc.returncode == 0, f"{Path(argv[0]).name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def absolute(mnt: Path, tool_input: dict, key: str = "file_path") -> dict:
    """A tool call's input with its path (tool_input[key]) made absolute beneath mnt."""
    out = dict(tool_input)
    if key in out:
        out[key] = str(mnt / out[key])
    return out


# a tool call (name, JSON input; for a Responses custom tool such as Codex's apply_patch,
# the input is its text), or the turn's final text
Step = tuple[str, dict[str, Any] | str] | str


class ScriptedModel:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        # which requests are the agent's own turns: those offering tools, unless a test
        # says otherwise (Aider offers none: its edits are text)
        self.is_turn: Callable[[dict[str, Any]], bool] = lambda body: bool(body.get("tools"))
        # seconds a turn's answer takes, as a real model's does: an agent without hooks
        # is grouped by its quiet between calls (the mount's --window)
        self.delay = 0.0
        self.aside = "ok"  # the answer to other requests (titles, summaries, commit messages)
        self.aside_delay = 0.0  # seconds that answer takes
        self.script: list[Step] = []
        self.requests: list[dict[str, Any]] = []  # every body received, in order
        self.turns: list[dict[str, Any]] = []  # the bodies that got a scripted step
        self.calls = 0
        server = _Server(("127.0.0.1", 0), _handler(self))
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()

    def play(self, script: Sequence[Step]) -> None:
        with self.lock:
            self.script = list(script)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reply(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The content blocks to answer one request with."""
        with self.lock:
            self.requests.append(body)
            aside = not self.script or not self.is_turn(body)
            if not aside:
                self.turns.append(body)
                step = self.script.pop(0)
        if aside:
            time.sleep(self.aside_delay)
            return [{"type": "text", "text": self.aside}]
        time.sleep(self.delay)
        if isinstance(step, str):
            return [{"type": "text", "text": step}]
        name, tool_input = step
        with self.lock:
            self.calls += 1
            call_id = f"toolu_e2e_{self.calls:02d}"
        return [{"type": "tool_use", "id": call_id, "name": name, "input": tool_input}]


def _responses_stream(model: str, blocks: list[dict[str, Any]]) -> bytes:
    """The Responses API's events for one reply (what Codex reads of them)."""
    items = []
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            items.append({"type": "message", "role": "assistant", "id": f"msg_e2e_{i}", "status": "completed",
                          "content": [{"type": "output_text", "text": block["text"], "annotations": []}]})
        elif isinstance(block["input"], str):
            items.append({"type": "custom_tool_call", "id": f"ctc_{block['id']}", "status": "completed",
                          "call_id": block["id"], "name": block["name"], "input": block["input"]})
        else:
            items.append({"type": "function_call", "id": f"fc_{block['id']}", "status": "completed",
                          "call_id": block["id"], "name": block["name"],
                          "arguments": json.dumps(block["input"])})
    response = {"id": "resp_e2e", "object": "response", "model": model, "status": "in_progress", "output": []}
    out = [_sse("response.created", {"type": "response.created", "response": response})]
    for i, item in enumerate(items):
        out.append(_sse("response.output_item.added", {"type": "response.output_item.added",
                                                       "output_index": i, "item": item}))
        out.append(_sse("response.output_item.done", {"type": "response.output_item.done",
                                                      "output_index": i, "item": item}))
    done = dict(response, status="completed", output=items, usage={
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15})
    out.append(_sse("response.completed", {"type": "response.completed", "response": done}))
    return b"".join(out)


def _gemini_response(model: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One GenerateContentResponse (Gemini sends no call ids: the CLI makes its own)."""
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if block["type"] == "text":
            parts.append({"text": block["text"]})
        else:
            parts.append({"functionCall": {"name": block["name"], "args": block["input"]}})
    return {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15},
            "modelVersion": model, "responseId": "e2e"}


def _chat_message(blocks: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """A Chat Completions assistant message for one reply, and its finish reason."""
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [{"id": b["id"], "type": "function",
              "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
             for b in blocks if b["type"] == "tool_use"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls else "stop"


def _chat_stream(model: str, blocks: list[dict[str, Any]]) -> bytes:
    message, finish = _chat_message(blocks)
    head = {"id": "chatcmpl-e2e", "object": "chat.completion.chunk", "created": 0, "model": model}

    def chunk(delta: dict[str, Any], reason: str | None = None, **extra: Any) -> bytes:
        data = dict(head, choices=[{"index": 0, "delta": delta, "finish_reason": reason}], **extra)
        return f"data: {json.dumps(data)}\n\n".encode()
    out = [chunk({"role": "assistant", "content": ""})]
    if message["content"]:
        out.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls", [])):
        out.append(chunk({"tool_calls": [dict(call, index=i)]}))
    out.append(chunk({}, finish, usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # an agent that drops a kept-alive connection when it exits is no error


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _stream(model: str, blocks: list[dict[str, Any]], stop: str) -> bytes:
    usage = {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0}
    out = [_sse("message_start", {"type": "message_start", "message": {
        "id": "msg_e2e", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}})]
    for i, block in enumerate(blocks):
        start: dict[str, Any]
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                "content_block": start}))
        out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop,
                                      "stop_sequence": None}, "usage": {"output_tokens": 5}}))
    out.append(_sse("message_stop", {"type": "message_stop"}))
    return b"".join(out)


def _handler(owner: ScriptedModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet: the test reads `requests`
            pass

        def _send(self, status: int, ctype: str, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            self._send(200, "application/json", b"{}")

        do_HEAD = do_GET

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {}
            path = self.path.split("?")[0]
            if path.endswith(":countTokens"):
                self._send(200, "application/json", b'{"totalTokens": 10}')
                return
            if path.endswith((":streamGenerateContent", ":generateContent")):
                model = path.rsplit("/", 1)[-1].split(":")[0]
                answer = _gemini_response(model, owner.reply(body))
                if path.endswith(":generateContent"):
                    self._send(200, "application/json", json.dumps(answer).encode())
                else:
                    self._send(200, "text/event-stream", f"data: {json.dumps(answer)}\r\n\r\n".encode())
                return
            if path.endswith("/chat/completions"):
                model = str(body.get("model", "scripted"))
                blocks = owner.reply(body)
                if body.get("stream"):
                    self._send(200, "text/event-stream", _chat_stream(model, blocks))
                else:
                    message, finish = _chat_message(blocks)
                    answer = {"id": "chatcmpl-e2e", "object": "chat.completion", "created": 0, "model": model,
                              "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                              "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
                    self._send(200, "application/json", json.dumps(answer).encode())
                return
            if self.path.split("?")[0].endswith("/count_tokens"):
                self._send(200, "application/json", b'{"input_tokens": 10}')
                return
            if self.path.split("?")[0].endswith("/responses"):
                blocks = owner.reply(body)
                self._send(200, "text/event-stream", _responses_stream(str(body.get("model", "")), blocks))
                return
            if not self.path.split("?")[0].endswith("/v1/messages"):
                self._send(200, "application/json", b"{}")
                return
            blocks = owner.reply(body)
            stop = "tool_use" if blocks[-1]["type"] == "tool_use" else "end_turn"
            model = str(body.get("model", "claude-scripted"))
            if body.get("stream"):
                self._send(200, "text/event-stream", _stream(model, blocks, stop))
            else:
                message = {"id": "msg_e2e", "type": "message", "role": "assistant", "model": model,
                           "content": blocks, "stop_reason": stop, "stop_sequence": None,
                           "usage": {"input_tokens": 10, "output_tokens": 5}}
                self._send(200, "application/json", json.dumps(message).encode())
    return Handler


def read(root: Path, path: str) -> str | None:
    try:
        return (root / path).read_text()
    except FileNotFoundError:
        return None


def assert_each_call_restores(m: Any, repo: Path, autos: list[dict], calls: list[tuple[int, dict]],
                              call_ids: list[str], agent: str | None = None) -> None:
    """Each changing tool call's checkpoint (autos, oldest first; calls: its call's index
    and {path: content after it, None: gone}) lists its files, ends its conversation with
    its own call (not its result, not the next), and restores the tree as it was after it."""
    expected = {path: read(repo, path) for _, after in calls for path in after}
    states = []
    for ck, (i, after) in zip(autos, calls):
        expected.update(after)
        states.append(dict(expected))
        files = {f["path"] for f in ck["files"]}
        assert set(after) <= files and files <= set(after) | {"src/new"}, (ck["id"], files)
        at = m.ctl_ok({"cmd": "conversation", "at": ck["id"]})["lines"]
        assert at[-1]["event"] == "PreToolUse" and at[-1]["tool_use_id"] == call_ids[i], at[-1]
        if agent is not None:
            assert at[-1]["agent"] == agent
        assert [x["tool_use_id"] for x in at if x.get("event") == "PreToolUse"] == call_ids[:i + 1]
    for ck, state in zip(autos, states):
        m.cli("restore", str(ck["id"]), "--code")
        assert {path: read(m.mnt, path) for path in state} == state, ck["id"]


def assert_each_step_restores(m: Any, repo: Path, steps: list[tuple[str, Any, str | None, dict]],
                              agent: str) -> tuple[list[dict], list[tuple[int, tuple]], list[dict]]:
    """For agents whose hooks send no call id the tests can check (Gemini, qwen): steps are
    (tool, input, summary or None for a read, {path: content after, None: gone}). Each
    changing step is one automatic checkpoint with its summary and files, its conversation
    ends with its own call, and it restores the tree as it was after it. Returns the
    checkpoints, the changing steps (index, step) and the tree after each."""
    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    autos = sorted((c for c in log if c["id"] > 0), key=lambda c: c["id"])
    changing = [(i, s) for i, s in enumerate(steps) if s[2] is not None]
    assert [c["summary"] for c in autos] == [s[2] for _, s in changing], \
        [(c["id"], c["summary"], [f["path"] for f in c["files"]]) for c in autos]
    assert all(c["kind"] == "auto" for c in autos)
    expected = {path: read(repo, path) for _, s in changing for path in s[3]}
    states = []
    for ck, (i, (tool, _, _, after)) in zip(autos, changing):
        expected.update(after)
        states.append(dict(expected))
        assert {f["path"] for f in ck["files"]} == set(after), ck
        at = m.ctl_ok({"cmd": "conversation", "at": ck["id"]})["lines"]
        assert at[-1]["event"] == "PreToolUse" and at[-1]["agent"] == agent and at[-1]["tool"] == tool, at[-1]
        assert [x["tool"] for x in at if x.get("event") == "PreToolUse"] == [s[0] for s in steps[:i + 1]]
    for ck, state in zip(autos, states):
        m.cli("restore", str(ck["id"]), "--code")
        assert {path: read(m.mnt, path) for path in state} == state, ck["id"]
    return autos, changing, states
