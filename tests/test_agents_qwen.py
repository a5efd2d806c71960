"""The real qwen-code CLI (pinned in the Makefile, from npm) inside a mount with our
hooks (`install-hooks qwen`, ~/.qwen/settings.json), driven by a scripted OpenAI Chat
Completions API on 127.0.0.1 (tests/agent_server.py).

Four changing tool calls (write_file, edit, run_shell_command) and a read_file: each
changing call is one automatic checkpoint with the call as its summary, its files, the
conversation up to that call and a restore that gives its files back; the read makes
none. A restore of code and conversation cuts qwen's own session (by position: qwen's
hooks send call ids of their own), and `qwen --resume ID` sends the model that cut.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent_server import ScriptedModel, absolute, agent_cli, assert_each_step_restores, read, run_agent
from conftest import Mount, run_cli


@pytest.fixture(scope="module")
def qwen() -> Path:
    return agent_cli("qwen")


def run_qwen(qwen: Path, env: dict[str, str], cwd: Path, *args: str) -> str:
    return run_agent([qwen, "--auth-type", "openai", "-m", "scripted", "--approval-mode", "yolo", *args], env, cwd)


# (tool, input with paths relative to the mount, summary, {path: content after, None: gone})
# a read changes nothing: summary None
STEPS: list[tuple[str, dict, str | None, dict[str, str | None]]] = [
    ("write_file", {"file_path": "notes.txt", "content": "alpha\nbeta\n"},
     "write_file notes.txt", {"notes.txt": "alpha\nbeta\n"}),
    ("edit", {"file_path": "notes.txt", "old_string": "beta", "new_string": "BETA"},
     "edit notes.txt", {"notes.txt": "alpha\nBETA\n"}),
    ("read_file", {"file_path": "src/main.py"}, None, {}),
    ("run_shell_command", {"command": "sed -i 's/hello/HELLO/' README.md"},
     "run_shell_command sed -i 's/hello/HELLO/' README.md", {"README.md": "# demo\n\nHELLO\n"}),
    ("run_shell_command", {"command": "cp run.sh run2.sh && rm docs/guide.txt"},
     "run_shell_command cp run.sh run2.sh && rm docs/guide.txt",
     {"run2.sh": "#!/bin/sh\necho run\n", "docs/guide.txt": None}),
]
FINAL = "The four changes are made."


def test_a_qwen_session_is_one_checkpoint_per_tool_call(qwen: Path, model: ScriptedModel, repo: Path,
                                                        mount_factory, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".qwen").mkdir(parents=True)
    # the daemon cuts sessions only where this user's qwen keeps them: the same home
    monkeypatch.setenv("HOME", str(home))
    for name in ("QWEN_HOME", "QWEN_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    # no usage statistics: qwen would wait for their upload to a host it cannot reach
    (home / ".qwen" / "settings.json").write_text(json.dumps({"privacy": {"usageStatisticsEnabled": False}}))
    m: Mount = mount_factory(repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QWEN_"))}
    env.update(HOME=str(home), OPENAI_BASE_URL=model.url + "/v1", OPENAI_API_KEY="scripted")
    run_cli("install-hooks", "qwen", env=env)
    settings = json.loads((home / ".qwen" / "settings.json").read_text())
    assert settings["privacy"] == {"usageStatisticsEnabled": False} and settings["hooks"]
    model.play([(tool, absolute(m.mnt, args)) for tool, args, _, _ in STEPS] + [FINAL])
    assert FINAL in run_qwen(qwen, env, m.mnt, "-p", "make the four changes")
    call_ids = [f"toolu_e2e_{i + 1:02d}" for i in range(len(STEPS))]

    autos, changing, states = assert_each_step_restores(m, repo, STEPS, "qwen")

    # back to the third changing call (the fourth call: the read came before it), code
    # and conversation: qwen's session is cut there as a session of its own
    ck_index, (step_index, _) = 2, changing[2]
    result = m.ctl_ok({"cmd": "restore", "id": autos[ck_index]["id"], "what": "both"})
    assert {path: read(m.mnt, path) for path in states[ck_index]} == states[ck_index]
    command = result["resume"].split()
    assert command[:2] == ["qwen", "--resume"], result
    copy = Path(result["transcript"])
    assert copy.name == command[2] + ".jsonl" and copy.stat().st_mode & 0o777 == 0o600
    assert copy.is_relative_to(home / ".qwen" / "projects")
    at = m.ctl_ok({"cmd": "conversation"})["lines"]
    assert at[-1]["event"] == "PreToolUse" and at[-1]["summary"] == STEPS[step_index][2]
    turns_before = len(model.turns)
    model.play(["Resumed where we were."])
    out = run_qwen(qwen, env, m.mnt, "--resume", command[2], "-p", "where were we?")
    assert "Resumed where we were." in out
    sent = model.turns[turns_before]["messages"]
    assert [c["id"] for x in sent for c in x.get("tool_calls") or []] == call_ids[:step_index + 1]
    assert [x["tool_call_id"] for x in sent if x["role"] == "tool"] == call_ids[:step_index + 1]
    assert "where were we?" in json.dumps(sent[-1])
