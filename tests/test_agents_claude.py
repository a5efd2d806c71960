"""The real Claude Code CLI (pinned in the Makefile, from npm) inside a mount with our
hooks, driven by a scripted model on 127.0.0.1 (tests/agent_server.py).

One scripted session makes ten changing tool calls (Write, Edit, Edit with replace_all
in place of MultiEdit, which 2.1.197 no longer offers, Bash with `sed -i` and `rm`)
and some Reads that Claude demands before an Edit of a file it has not seen. Each
changing call must be exactly one automatic checkpoint, with the call as its summary,
its files, the conversation up to that call, and a restore that gives its files back;
`claude --resume` of the transcript cut at a checkpoint must send the model that cut.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent_server import ScriptedModel, absolute, agent_cli, assert_each_call_restores, run_agent
from conftest import Mount, run_cli


@pytest.fixture(scope="module")
def claude() -> Path:
    return agent_cli("claude")


def run_claude(claude: Path, model: ScriptedModel, home: Path, cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(HOME=str(home), ANTHROPIC_BASE_URL=model.url, ANTHROPIC_API_KEY="sk-scripted",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
    return run_agent([claude, "-p", *args, "--allowedTools", "Read,Write,Edit,Bash"], env, cwd, timeout=300,
                     stdin=None)


# (tool, input with paths relative to the mount, summary, {path: content after, None: gone})
# Read calls change nothing: summary None.
STEPS: list[tuple[str, dict, str | None, dict[str, str | None]]] = [
    ("Write", {"file_path": "notes.txt", "content": "alpha\nbeta\ngamma\n"},
     "Write notes.txt", {"notes.txt": "alpha\nbeta\ngamma\n"}),
    ("Edit", {"file_path": "notes.txt", "old_string": "beta", "new_string": "BETA"},
     "Edit notes.txt", {"notes.txt": "alpha\nBETA\ngamma\n"}),
    ("Edit", {"file_path": "notes.txt", "old_string": "a", "new_string": "A", "replace_all": True},
     "Edit notes.txt", {"notes.txt": "AlphA\nBETA\ngAmmA\n"}),
    ("Bash", {"command": "sed -i 's/hello/HELLO/' README.md", "description": "shout"},
     "Bash sed -i 's/hello/HELLO/' README.md", {"README.md": "# demo\n\nHELLO\n"}),
    ("Write", {"file_path": "src/new/mod.py", "content": "X = 1\n"},
     "Write src/new/mod.py", {"src/new/mod.py": "X = 1\n"}),
    ("Read", {"file_path": "src/main.py"}, None, {}),
    ("Edit", {"file_path": "src/main.py", "old_string": "print", "new_string": "exit"},
     "Edit src/main.py", {"src/main.py": "import pkg.util\nexit(pkg.util.answer())\n"}),
    ("Bash", {"command": "cp run.sh run2.sh && rm docs/guide.txt", "description": "two processes"},
     "Bash cp run.sh run2.sh && rm docs/guide.txt", {"run2.sh": "#!/bin/sh\necho run\n", "docs/guide.txt": None}),
    ("Bash", {"command": "sed -i -e 's/42/43/' src/pkg/util.py", "description": "bump"},
     "Bash sed -i -e 's/42/43/' src/pkg/util.py", {"src/pkg/util.py": "def answer():\n    return 43\n"}),
    ("Read", {"file_path": "README.md"}, None, {}),
    ("Write", {"file_path": "README.md", "content": "# demo\n\nrewritten\n"},
     "Write README.md", {"README.md": "# demo\n\nrewritten\n"}),
    ("Bash", {"command": "rm notes.txt", "description": "clean up"},
     "Bash rm notes.txt", {"notes.txt": None}),
]
FINAL = "All ten changes are made."


def test_a_claude_session_is_one_checkpoint_per_tool_call(claude: Path, model: ScriptedModel,
                                                          repo: Path, mount_factory, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # the daemon cuts transcripts only where this user's Claude keeps them: the same home
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("CLAUDE_CONFIG_DIR", raising=False)
    m: Mount = mount_factory(repo)
    run_cli("install-hooks", "claude-code", "--project", str(m.mnt), env=dict(os.environ, HOME=str(home)))
    assert not (m.mnt / ".claude").exists()  # nothing of ours in the captured tree
    model.play([(tool, absolute(m.mnt, args)) for tool, args, _, _ in STEPS] + [FINAL])
    out = run_claude(claude, model, home, m.mnt, "make the ten changes")
    assert FINAL in out
    call_ids = [f"toolu_e2e_{i + 1:02d}" for i in range(len(STEPS))]

    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    autos = sorted((c for c in log if c["id"] > 0), key=lambda c: c["id"])
    changing = [(i, s) for i, s in enumerate(STEPS) if s[2] is not None]
    assert [c["summary"] for c in autos] == [s[2] for _, s in changing], \
        [(c["id"], c["summary"], [f["path"] for f in c["files"]]) for c in autos]
    assert all(c["kind"] == "auto" for c in autos)

    assert_each_call_restores(m, repo, autos, [(i, s[3]) for i, s in changing], call_ids)

    # back to the fifth changing call, code and conversation: the cut transcript resumes
    ck_index, (step_index, _) = 4, changing[4]
    out = m.cli("restore", str(autos[ck_index]["id"])).stdout
    assert "claude --resume /" in out, out
    cut = Path(out.split("claude --resume ")[1].split()[0])
    assert cut.stat().st_mode & 0o777 == 0o600
    original = Path(m.ctl_ok({"cmd": "conversation", "at": autos[0]["id"]})["lines"][0]["transcript_path"])
    ids = {json.loads(line).get("sessionId") for line in cut.read_text().splitlines()} - {None}
    assert ids == {original.stem}  # Claude's own /rewind and backups go by the session id
    turns_before = len(model.turns)
    model.play(["Resumed where we were."])
    out = run_claude(claude, model, home, tmp_path, "--resume", str(cut), "where were we?")
    assert "Resumed where we were." in out
    sent = model.turns[turns_before]["messages"]
    uses = [b["id"] for msg in sent if isinstance(msg["content"], list)
            for b in msg["content"] if b.get("type") == "tool_use"]
    results = [b["tool_use_id"] for msg in sent if isinstance(msg["content"], list)
               for b in msg["content"] if b.get("type") == "tool_result"]
    assert uses == results == call_ids[:step_index + 1]
    assert "where were we?" in json.dumps(sent[-1])
