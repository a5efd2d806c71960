"""The conversation sidecar, its branches, and Claude Code hooks."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, Mount, conversation, run_cli, summaries

# Recorded Claude Code hook events (field names as Claude Code sends them).
EVENTS: dict[str, dict[str, Any]] = {
    "UserPromptSubmit": {"hook_event_name": "UserPromptSubmit", "session_id": "s1",
                         "transcript_path": "", "cwd": "", "prompt": "fix the login bug"},
    "PreToolUse": {"hook_event_name": "PreToolUse", "session_id": "s1", "transcript_path": "",
                   "cwd": "", "tool_name": "Edit", "tool_use_id": "toolu_1",
                   "tool_input": {"file_path": "README.md", "old_string": "hello", "new_string": "bye"}},
    "PostToolUse": {"hook_event_name": "PostToolUse", "session_id": "s1", "transcript_path": "",
                    "cwd": "", "tool_name": "Edit", "tool_use_id": "toolu_1",
                    "tool_input": {"file_path": "README.md"}, "tool_response": {"success": True}},
    "PostToolUseFailure": {"hook_event_name": "PostToolUseFailure", "session_id": "s1",
                           "transcript_path": "", "cwd": "", "tool_name": "Bash",
                           "tool_use_id": "toolu_2", "tool_input": {"command": "false"},
                           "error": "Exit code 1", "is_interrupt": False},
    "Stop": {"hook_event_name": "Stop", "session_id": "s1", "transcript_path": "", "cwd": "",
             "stop_hook_active": False, "last_assistant_message": "Fixed the login bug.\nDone."},
}


def hook(m: Mount, event: dict) -> None:
    """Run the hook as the agent does: the installed command, the event on stdin, in the mount."""
    proc = subprocess.run(CLI + ["hook", "claude-code"], input=json.dumps(dict(event, cwd=str(m.mnt))),
                          text=True, capture_output=True, cwd=str(m.mnt), timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def say(m: Mount, role: str, content: str, **extra: str) -> None:
    with open(m.mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
        f.write(json.dumps({"role": role, "content": content, **extra}) + "\n")


def live(m: Mount) -> list[str]:
    text = (m.mnt / ".overlayckpt" / "conversation.jsonl").read_text()
    return [json.loads(line)["content"] for line in text.splitlines()]


def test_lines_are_stamped_and_read_back(mounted: Mount) -> None:
    say(mounted, "user", "hello")
    (mounted.mnt / "README.md").write_text("x\n")
    say(mounted, "assistant", "done", tool="Edit")
    lines = [json.loads(x) for x in (mounted.mnt / ".overlayckpt" / "conversation.jsonl").read_text().splitlines()]
    assert [x["content"] for x in lines] == ["hello", "done"]
    assert lines[1]["seq"] > lines[0]["seq"]
    assert all("time" in x and "line" in x for x in lines)


@pytest.mark.parametrize("what", ["code", "conversation", "both"])
def test_restore_modes_move_the_right_halves(repo: Path, mount_factory, what: str) -> None:
    m = mount_factory(repo)
    say(m, "user", "one")
    cid = m.cli("checkpoint").stdout.strip()
    (m.mnt / "README.md").write_text("changed\n")
    say(m, "assistant", "two")
    m.cli("restore", cid, f"--{what}")
    code_back = (m.mnt / "README.md").read_text() == "# demo\n\nhello\n"
    conv_back = live(m) == ["one"]
    assert code_back == (what in ("code", "both"))
    assert conv_back == (what in ("conversation", "both"))
    if conv_back:
        every = json.loads(m.cli("--json", "conversation", "--all").stdout)["lines"]
        assert [(x["content"], x["live"]) for x in every] == [("one", True), ("two", False)]
        say(m, "user", "three")
        assert live(m) == ["one", "three"]
        m.cli("restore", "@before-last")
        assert live(m) == ["one", "two"]


def test_conversation_at_checkpoint_and_summary(mounted: Mount) -> None:
    say(mounted, "user", "please edit")
    say(mounted, "assistant", "editing README", tool="Edit")
    (mounted.mnt / "README.md").write_text("edited\n")
    log = mounted.ctl({"cmd": "log"})["checkpoints"]
    edit = next(c for c in log if any(f["path"] == "README.md" for f in c["files"]))
    assert edit["summary"].startswith("Edit")
    at = json.loads(mounted.cli("--json", "conversation", "--at", str(edit["id"])).stdout)["lines"]
    assert [x["content"] for x in at] == ["please edit", "editing README"]


@pytest.mark.parametrize("payload", [b"{not json\n", b'{"content": "no role"}\n', b"[1, 2]\n",
                                     b"\xff\xfe\x00garbage\n", b"x" * (2 << 20) + b"\n"])
def test_bad_lines_fail_with_einval_and_change_nothing(mounted: Mount, payload: bytes) -> None:
    say(mounted, "user", "kept")
    fd = os.open(mounted.mnt / ".overlayckpt" / "conversation.jsonl", os.O_WRONLY | os.O_APPEND)
    try:
        with pytest.raises(OSError) as e:
            view = memoryview(payload)
            while view:  # a long line may be taken in part before it is refused
                view = view[os.write(fd, view):]
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    assert live(mounted) == ["kept"]


def test_concurrent_appenders_keep_every_line_whole(mounted: Mount) -> None:
    def writer(n: int) -> None:
        fd = os.open(mounted.mnt / ".overlayckpt" / "conversation.jsonl", os.O_WRONLY | os.O_APPEND)
        try:
            for i in range(50):
                os.write(fd, (json.dumps({"role": "user", "content": f"{n}-{i}"}) + "\n").encode())
        finally:
            os.close(fd)
    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = live(mounted)
    assert sorted(got) == sorted(f"{n}-{i}" for n in range(4) for i in range(50))
    for n in range(4):  # each writer's lines stay in its order
        mine = [x for x in got if x.startswith(f"{n}-")]
        assert mine == [f"{n}-{i}" for i in range(50)]


def test_claude_code_hook_events(mounted: Mount) -> None:
    for event in EVENTS.values():
        hook(mounted, event)
    lines = conversation(mounted)
    assert [x["event"] for x in lines] == list(EVENTS)
    prompt, call, result, failure, stop = lines
    assert prompt["role"] == "user" and prompt["content"] == "fix the login bug"
    assert call["tool"] == "Edit" and call["summary"] == "Edit README.md"
    assert call["tool_use_id"] == result["tool_use_id"] == "toolu_1"
    assert "failed" not in result
    assert failure["role"] == "tool" and failure["tool"] == "Bash" and failure["failed"] is True
    assert failure["content"] == "Exit code 1" and failure["tool_use_id"] == "toolu_2"
    assert stop["role"] == "assistant" and stop["content"] == "Fixed the login bug.\nDone."


def test_stop_without_its_message_keeps_the_placeholder(mounted: Mount) -> None:
    stop = {k: v for k, v in EVENTS["Stop"].items() if k != "last_assistant_message"}
    hook(mounted, stop)
    assert [x["content"] for x in conversation(mounted)] == ["(turn finished)"]


def writes(m: Mount, name: str, text: str) -> None:
    """A write by a process of its own (a separate checkpoint from the test's)."""
    subprocess.run(["sh", "-c", f"printf '{text}' > {name}"], cwd=m.mnt, check=True, timeout=30)


def test_a_turns_last_message_sums_up_its_changes_not_the_next(mounted: Mount) -> None:
    hook(mounted, EVENTS["UserPromptSubmit"])
    hook(mounted, EVENTS["PreToolUse"])
    writes(mounted, "src/main.py", "bye\n")
    hook(mounted, EVENTS["PostToolUse"])
    hook(mounted, EVENTS["Stop"])
    writes(mounted, "notes.txt", "mine\n")  # the user, after the turn
    got = summaries(mounted)
    assert got["src/main.py"] == "Edit README.md"  # the tool call names its own change
    assert got["notes.txt"] == "added notes.txt"  # the finished turn is not its summary


def test_a_turn_without_a_tool_call_is_summed_up_by_its_last_message(mounted: Mount) -> None:
    hook(mounted, EVENTS["UserPromptSubmit"])
    writes(mounted, "src/main.py", "bye\n")
    hook(mounted, EVENTS["Stop"])
    writes(mounted, "notes.txt", "mine\n")
    got = summaries(mounted)
    assert got["src/main.py"] == "Fixed the login bug."
    assert got["notes.txt"] == "added notes.txt"


@pytest.mark.parametrize("compiled", [False, True])
def test_hook_never_breaks_the_agent(tmp_path: Path, compiled: bool) -> None:
    from overlayckpt.agents.settings import hook_program
    command = [str(hook_program())] if compiled else CLI + ["hook"]
    for stdin in ("{broken", json.dumps(EVENTS["PreToolUse"]), "", "[1]", "x" * (5 << 20)):
        start = time.monotonic()
        proc = subprocess.run(command + ["claude-code"], input=stdin, text=True,
                              capture_output=True, cwd=tmp_path, timeout=30)
        assert proc.returncode == 0 and proc.stdout == ""
        assert proc.stderr.count("\n") == (stdin != json.dumps(EVENTS["PreToolUse"])), proc.stderr
        assert time.monotonic() - start < 10
        assert "Traceback" not in proc.stderr


def test_install_hooks_keeps_existing_settings(tmp_path: Path) -> None:
    """Into the user's settings (HOME here is a scratch directory), never the project's."""
    home, project = tmp_path / "home", tmp_path / "project"
    settings = home / ".claude" / "settings.json"
    settings.parent.mkdir(parents=True)
    mine: dict[str, Any] = {"permissions": {"allow": ["Bash(ls)"]},
            "hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command": "x"}]}]}}
    settings.write_text(json.dumps(mine))
    # an install by an earlier version, in the project (inside the captured tree)
    local = project / ".claude" / "settings.local.json"
    local.parent.mkdir(parents=True)
    local.write_text(json.dumps({"permissions": {"allow": ["Read"]}, "hooks": {"Stop": [
        {"hooks": [{"type": "command", "command": "python -m overlayckpt hook claude-code"}]}]}}))
    env = dict(os.environ, HOME=str(home))
    env.pop("CLAUDE_CONFIG_DIR", None)
    for _ in range(2):  # idempotent
        run_cli("install-hooks", "claude-code", "--project", str(project), env=env)
    got = json.loads(settings.read_text())
    assert got["permissions"] == mine["permissions"]
    pre = got["hooks"]["PreToolUse"]
    assert pre[0] == mine["hooks"]["PreToolUse"][0] and len(pre) == 2
    for event in EVENTS:
        assert sum(h["command"].endswith("/overlayckpt-hook claude-code")
                   for e in got["hooks"][event] for h in e["hooks"]) == 1
    assert json.loads(local.read_text()) == {"permissions": {"allow": ["Read"]}}
    assert not (project / ".claude" / "settings.json").exists()


def test_install_hooks_refuses_a_broken_settings_file(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text("{broken")
    proc = run_cli("install-hooks", "claude-code", "--settings", str(settings), "--project", str(tmp_path),
                   check=False)
    assert proc.returncode != 0 and "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert settings.read_text() == "{broken"


def test_restore_cuts_the_claude_transcript(repo: Path, mount_factory, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path))  # the daemon's: transcripts in tmp_path/projects
    m = mount_factory(repo)
    transcript = tmp_path / "projects" / "sess.jsonl"
    transcript.parent.mkdir()

    def entry(text: str, at: float) -> str:
        return json.dumps({"sessionId": "sess", "type": "user", "message": text,
                           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(at))})
    # the entries' times are chosen, not waited for: "first" before the hook's line (where
    # the restore cuts), "second" after it, each a minute away from now
    transcript.write_text(entry("first", time.time() - 60) + "\n")
    event = dict(EVENTS["UserPromptSubmit"], transcript_path=str(transcript), cwd=str(m.mnt))
    subprocess.run(CLI + ["hook", "claude-code"], input=json.dumps(event), text=True, check=True)
    cid = m.cli("checkpoint").stdout.strip()
    with open(transcript, "a") as f:
        f.write(entry("second", time.time() + 60) + "\n")
    out = m.cli("restore", cid).stdout
    assert "claude --resume" in out
    cut_path = Path(out.split("claude --resume ")[1].split()[0])
    assert cut_path.is_absolute() and cut_path.parent == transcript.parent
    cut = cut_path.read_text().splitlines()
    assert [json.loads(x)["message"] for x in cut] == ["first"]
    assert all(json.loads(x)["sessionId"] == "sess" for x in cut)  # Claude's /rewind needs it
    assert cut_path.stat().st_mode & 0o777 == 0o600


def test_the_hook_imports_only_what_it_needs(tmp_path: Path) -> None:
    """The agent waits for every hook: its process loads no store, FUSE or CLI module."""
    proc = subprocess.run([*CLI[:1], "-X", "importtime", *CLI[1:], "hook", "claude-code"],
                          input=json.dumps(EVENTS["PreToolUse"]), text=True, capture_output=True,
                          cwd=tmp_path, timeout=30)
    assert proc.returncode == 0
    loaded = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "overlayckpt.agents.hooks" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("trio", "lmdb", "zstandard", "blake3",
                                                      "pyfuse3", "prompt_toolkit")
             or m.startswith(("overlayckpt.cli", "overlayckpt.store", "overlayckpt.records",
                              "overlayckpt.agents.settings", "overlayckpt.agents.transcripts"))}
    assert not heavy


def test_other_forms_of_the_hook_command_get_the_full_cli(tmp_path: Path) -> None:
    proc = subprocess.run(CLI + ["hook", "no-such-agent"], input="{}", text=True,
                          capture_output=True, cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_the_hook_takes_its_mount(mounted: Mount, tmp_path: Path) -> None:
    for form in (["--mount", str(mounted.mnt)], [f"--mount={mounted.mnt}"]):
        subprocess.run(CLI + ["hook", "claude-code", *form], input=json.dumps(EVENTS["UserPromptSubmit"]),
                       text=True, check=True, cwd=tmp_path, timeout=30)
    assert live(mounted) == ["fix the login bug"] * 2
