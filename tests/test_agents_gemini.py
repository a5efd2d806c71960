"""The real Gemini CLI (pinned in the Makefile, from npm) inside a mount with our hooks
(`install-hooks gemini`, ~/.gemini/settings.json), driven by a scripted Gemini API on
127.0.0.1 (tests/agent_server.py).

Four changing tool calls (write_file, replace, run_shell_command) and a read_file: each
changing call is one automatic checkpoint with the call as its summary, its files, the
conversation up to that call and a restore that gives its files back; the read makes
none. A restore of code and conversation cuts Gemini's own session (by position: Gemini
sends no call id), and `gemini --session-file COPY` sends the model that cut.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent_server import ScriptedModel, absolute, agent_cli, assert_each_step_restores, read, run_agent
from conftest import Mount, run_cli


@pytest.fixture(scope="module")
def gemini() -> Path:
    return agent_cli("gemini")


def run_gemini(gemini: Path, env: dict[str, str], cwd: Path, *args: str) -> str:
    # an explicit model: without one, Gemini asks a classifier model (JSON) which to route to
    return run_agent([gemini, "--skip-trust", "--yolo", "-m", "gemini-2.5-flash", *args], env, cwd)


# (tool, input with paths relative to the mount, summary, {path: content after, None: gone})
# a read changes nothing: summary None
STEPS: list[tuple[str, dict, str | None, dict[str, str | None]]] = [
    ("write_file", {"file_path": "notes.txt", "content": "alpha\nbeta\n"},
     "write_file notes.txt", {"notes.txt": "alpha\nbeta\n"}),
    ("replace", {"file_path": "notes.txt", "old_string": "beta", "new_string": "BETA", "instruction": "shout"},
     "replace notes.txt", {"notes.txt": "alpha\nBETA\n"}),
    ("read_file", {"file_path": "src/main.py"}, None, {}),
    ("run_shell_command", {"command": "sed -i 's/hello/HELLO/' README.md"},
     "run_shell_command sed -i 's/hello/HELLO/' README.md", {"README.md": "# demo\n\nHELLO\n"}),
    ("run_shell_command", {"command": "cp run.sh run2.sh && rm docs/guide.txt"},
     "run_shell_command cp run.sh run2.sh && rm docs/guide.txt",
     {"run2.sh": "#!/bin/sh\necho run\n", "docs/guide.txt": None}),
]
FINAL = "The four changes are made."


def calls_sent(contents: list[dict]) -> list[tuple[str, str]]:
    """The function calls and responses in a request's history, in order, each once
    (Gemini 0.61 sends a resumed session's every response twice, also of a session
    not cut: from its model record's toolCalls and from the user record after it)."""
    out: list[tuple[str, str]] = []
    for message in contents:
        for part in message.get("parts", []):
            if "functionCall" in part:
                out.append(("call", part["functionCall"]["name"]))
            elif "functionResponse" in part and out[-1:] != [("response", part["functionResponse"]["name"])]:
                out.append(("response", part["functionResponse"]["name"]))
    return out


def test_a_gemini_session_is_one_checkpoint_per_tool_call(gemini: Path, model: ScriptedModel, repo: Path,
                                                          mount_factory, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".gemini").mkdir(parents=True)
    # the daemon cuts sessions only where this user's Gemini keeps them: the same home
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GEMINI_CLI_HOME", raising=False)
    # an API key, not Google login (without it: exit 41, "Invalid auth method")
    (home / ".gemini" / "settings.json").write_text(
        json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    m: Mount = mount_factory(repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMINI_", "GOOGLE_"))}
    env.update(HOME=str(home), GOOGLE_GEMINI_BASE_URL=model.url, GEMINI_API_KEY="scripted")
    run_cli("install-hooks", "gemini", env=env)
    settings = json.loads((home / ".gemini" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key" and settings["hooks"]
    model.play([(tool, absolute(m.mnt, args)) for tool, args, _, _ in STEPS] + [FINAL])
    assert FINAL in run_gemini(gemini, env, m.mnt, "-p", "make the four changes")

    autos, changing, states = assert_each_step_restores(m, repo, STEPS, "gemini")

    # back to the third changing call (the fourth call: the read came before it), code
    # and conversation: Gemini's session is cut there and resumes from any directory
    ck_index, (step_index, _) = 2, changing[2]
    result = m.ctl_ok({"cmd": "restore", "id": autos[ck_index]["id"], "what": "both"})
    assert {path: read(m.mnt, path) for path in states[ck_index]} == states[ck_index]
    command = result["resume"].split()
    assert command[:2] == ["gemini", "--session-file"], result
    copy = Path(command[2])
    assert copy.stat().st_mode & 0o777 == 0o600
    assert copy.is_relative_to(home / ".gemini" / "tmp")
    at = m.ctl_ok({"cmd": "conversation"})["lines"]
    assert at[-1]["event"] == "PreToolUse" and at[-1]["summary"] == STEPS[step_index][2]
    turns_before = len(model.turns)
    model.play(["Resumed where we were."])
    out = run_gemini(gemini, env, tmp_path, "--session-file", str(copy), "-p", "where were we?")
    assert "Resumed where we were." in out
    sent = model.turns[turns_before]["contents"]
    tools = [s[0] for s in STEPS[:step_index + 1]]
    assert calls_sent(sent) == [(kind, t) for t in tools for kind in ("call", "response")], calls_sent(sent)
    assert "where were we?" in json.dumps(sent[-1])
