"""What an agent hook costs, per agent, and how soon the MCP server answers.

    python -m bench.hook [--runs 30] [--json]

Mounts a small repo under a temporary directory, then, alternated, RUNS rounds of:
each agent's recorded hook events (Claude Code, Codex, qwen-code, Gemini CLI, Cursor:
the fields each sends, a prompt, a tool call before and after, the turn's end) fed to
the compiled hook install-hooks writes (overlayckpt/bin/overlayckpt-hook) and to the
Python hook (`python -P -m overlayckpt hook`), each run in the mount as the agent runs
it; `python -c pass` as the floor of any Python hook; and `overlayckpt mcp` started in
the mount until its answer to `initialize` arrives. Times are from process start to
exit (to the answer, for MCP), in milliseconds: p50 and p99 of every run. Checks that
every event was logged, and unmounts in any case.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from overlayckpt.agents.hooks import event_to_line
from overlayckpt.agents.settings import hook_program


def agent_events(cwd: str) -> dict[str, list[dict[str, Any]]]:
    """Each agent's events as it sends them (field names from their hook references and
    from the real CLIs' payloads in tests/test_hooks_agents.py)."""
    edit = {"file_path": f"{cwd}/README.md", "old_string": "a", "new_string": "b"}
    claude = {"session_id": "bench", "transcript_path": "/tmp/bench.jsonl", "cwd": cwd,
              "permission_mode": "default"}
    gemini = {"session_id": "bench", "transcript_path": "/tmp/session-bench.jsonl", "cwd": cwd,
              "timestamp": "2026-12-01T10:00:00Z"}
    cursor = {"conversation_id": "c1", "generation_id": "g1", "workspace_roots": [cwd], "model": "x"}
    opencode = {"cwd": cwd, "session_id": "ses_bench"}
    write = {"filePath": edit["file_path"], "content": "b\n"}

    def claude_like(tool: str, tool_input: dict[str, Any]) -> list[dict[str, Any]]:
        return [dict(claude, hook_event_name="UserPromptSubmit", prompt="fix the greeting"),
                dict(claude, hook_event_name="PreToolUse", tool_name=tool, tool_input=tool_input,
                     tool_use_id="toolu_01"),
                dict(claude, hook_event_name="PostToolUse", tool_name=tool, tool_input=tool_input,
                     tool_response={"filePath": edit["file_path"], "success": True}, tool_use_id="toolu_01"),
                dict(claude, hook_event_name="Stop", stop_hook_active=False, last_assistant_message="Done.")]
    return {
        "claude-code": claude_like("Edit", edit),
        "codex": [e for e in claude_like("Bash", {"command": "apply_patch <<'EOF'\n*** Begin Patch\n"
                                                             "*** Update File: README.md\n@@\n-a\n+b\n"
                                                             "*** End Patch\nEOF"})
                  if e["hook_event_name"] != "PostToolUseFailure"],
        "qwen": claude_like("edit", edit),
        "gemini": [dict(gemini, hook_event_name="BeforeAgent", prompt="fix the greeting"),
                   dict(gemini, hook_event_name="BeforeTool", tool_name="replace", tool_input=edit),
                   dict(gemini, hook_event_name="AfterTool", tool_name="replace", tool_input=edit,
                        tool_response={"llmContent": "Successfully modified README.md"}),
                   dict(gemini, hook_event_name="AfterAgent", prompt="fix the greeting",
                        prompt_response="Done.")],
        "cursor": [dict(cursor, hook_event_name="beforeSubmitPrompt", prompt="fix the greeting"),
                   dict(cursor, hook_event_name="preToolUse", tool_name="Write", tool_input=edit,
                        tool_use_id="cu_1"),
                   dict(cursor, hook_event_name="postToolUse", tool_name="Write", tool_input=edit,
                        tool_output="ok", tool_use_id="cu_1"),
                   dict(cursor, hook_event_name="afterAgentResponse", text="Done.")],
        "opencode": [dict(opencode, hook_event_name="chat.message", prompt="fix the greeting"),
                     dict(opencode, hook_event_name="tool.execute.before", tool="write", call_id="call_1",
                          args=write),
                     dict(opencode, hook_event_name="tool.execute.after", tool="write", call_id="call_1",
                          title="README.md", output="Wrote file successfully."),
                     dict(opencode, hook_event_name="session.idle", message="Done.")],
    }


def timed(argv: list[str], stdin: bytes, cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, input=stdin, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def mcp_start(argv: list[str], cwd: str) -> float:
    """From spawning the MCP server to its answer to `initialize`."""
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                        "clientInfo": {"name": "bench", "version": "0"}}}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(hello) + "\n").encode())
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    took = time.perf_counter() - start
    proc.stdin.close()
    proc.wait(timeout=30)
    assert answer.get("id") == 1 and "result" in answer, answer
    return took


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=30, help="rounds (each agent's events once per round)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args()
    compiled = hook_program()
    if compiled is None:
        sys.exit("the compiled hook is not built: make install (or setup.py build_ext --inplace)")
    cli = [sys.executable, "-m", "overlayckpt"]
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-hook-") as tmp:
        repo, mnt, store = (os.path.join(tmp, x) for x in ("repo", "mnt", "store"))
        os.mkdir(repo)
        os.mkdir(mnt)
        with open(os.path.join(repo, "README.md"), "w") as f:
            f.write("a\n")
        subprocess.run(cli + ["mount", repo, mnt, "--store", store], check=True, stdout=subprocess.DEVNULL)
        try:
            events = agent_events(mnt)
            hooks = {"compiled": [compiled], "python": [sys.executable, "-P", "-m", "overlayckpt", "hook"]}
            for _ in range(args.runs):
                times.setdefault("python -c pass", []).append(timed([sys.executable, "-c", "pass"], b"", mnt))
                for agent, evs in events.items():
                    for kind, hook in hooks.items():
                        for event in evs:
                            times.setdefault(f"{kind} {agent}", []).append(
                                timed(hook + [agent], json.dumps(event).encode(), mnt))
                times.setdefault("mcp initialize", []).append(mcp_start(cli[:1] + ["-P"] + cli[1:] + ["mcp"], mnt))
            with open(os.path.join(mnt, ".overlayckpt", "conversation.jsonl")) as f:
                logged = sum(1 for _ in f)
        finally:
            subprocess.run(cli + ["unmount", mnt, "--no-apply"], check=False)
    expected = args.runs * len(hooks) * sum(1 for agent, evs in events.items() for e in evs
                                            if event_to_line(e, agent) is not None)
    assert logged == expected, f"the hooks logged {logged} lines of {expected}"
    result = {name: {"p50_ms": round(quantile(xs, 0.5) * 1e3, 2), "p99_ms": round(quantile(xs, 0.99) * 1e3, 2),
                     "runs": len(xs)} for name, xs in times.items()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, r in result.items():
            print(f"{name:22} p50 {r['p50_ms']:7.1f} ms   p99 {r['p99_ms']:7.1f} ms   ({r['runs']} runs, alternated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
