"""The real Codex CLI (pinned in the Makefile, from npm) inside a mount with our hooks
(~/.codex/hooks.json), driven by a scripted Responses API on 127.0.0.1.

Codex 0.171 offers a shell tool (exec_command) and applies `apply_patch` run through it
itself; ten changing calls of both kinds must be ten checkpoints with their summaries,
files, conversation and restores, as with Claude Code (tests/test_agents_claude.py), and
`codex resume` of the rollout cut at a checkpoint must send the model that cut.
Codex sends no PostToolUse for an apply_patch: the next call's line ends it.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent_server import ScriptedModel, agent_cli, assert_each_call_restores, run_agent
from conftest import Mount, run_cli


@pytest.fixture(scope="module")
def codex() -> Path:
    return agent_cli("codex")


def patch(*lines: str) -> str:
    return "apply_patch <<'EOF'\n*** Begin Patch\n" + "\n".join(lines) + "\n*** End Patch\nEOF\n"


# (shell command, summary, {path: content after, None: gone})
STEPS: list[tuple[str, str, dict[str, str | None]]] = [
    (patch("*** Add File: notes.txt", "+alpha", "+beta", "+gamma"), "apply_patch notes.txt",
     {"notes.txt": "alpha\nbeta\ngamma\n"}),
    (patch("*** Update File: notes.txt", "@@", " alpha", "-beta", "+BETA", " gamma"), "apply_patch notes.txt",
     {"notes.txt": "alpha\nBETA\ngamma\n"}),
    ("sed -i 's/hello/HELLO/' README.md", "Bash sed -i 's/hello/HELLO/' README.md",
     {"README.md": "# demo\n\nHELLO\n"}),
    (patch("*** Add File: src/new/mod.py", "+X = 1"), "apply_patch src/new/mod.py", {"src/new/mod.py": "X = 1\n"}),
    (patch("*** Update File: src/main.py", "@@", " import pkg.util", "-print(pkg.util.answer())",
           "+exit(pkg.util.answer())"), "apply_patch src/main.py",
     {"src/main.py": "import pkg.util\nexit(pkg.util.answer())\n"}),
    ("cp run.sh run2.sh && rm docs/guide.txt", "Bash cp run.sh run2.sh && rm docs/guide.txt",
     {"run2.sh": "#!/bin/sh\necho run\n", "docs/guide.txt": None}),
    ("sed -i -e 's/42/43/' src/pkg/util.py", "Bash sed -i -e 's/42/43/' src/pkg/util.py",
     {"src/pkg/util.py": "def answer():\n    return 43\n"}),
    ("printf 'rewritten\\n' > README.md", "Bash printf 'rewritten\\n' > README.md", {"README.md": "rewritten\n"}),
    ("rm notes.txt", "Bash rm notes.txt", {"notes.txt": None}),
    (patch("*** Update File: src/new/mod.py", "@@", "-X = 1", "+X = 2"), "apply_patch src/new/mod.py",
     {"src/new/mod.py": "X = 2\n"}),
]
FINAL = "All ten changes are made."


def run_codex(codex: Path, env: dict[str, str], cwd: Path, *args: str) -> str:
    return run_agent([codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", *args],
                     env, cwd, timeout=300)


def test_a_codex_session_is_one_checkpoint_per_tool_call(codex: Path, model: ScriptedModel, repo: Path,
                                                         mount_factory, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    # the daemon cuts rollouts only where this user's Codex keeps them: the same CODEX_HOME
    monkeypatch.setenv("CODEX_HOME", str(home / ".codex"))
    m: Mount = mount_factory(repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"), SCRIPTED_KEY="sk-scripted")
    (home / ".codex" / "config.toml").write_text(
        'model = "gpt-5"\nmodel_provider = "scripted"\n[model_providers.scripted]\nname = "scripted"\n'
        f'base_url = "{model.url}/v1"\nwire_api = "responses"\nenv_key = "SCRIPTED_KEY"\n')
    run_cli("install-hooks", "codex", "--project", str(m.mnt), env=env)
    assert (home / ".codex" / "hooks.json").exists() and not (m.mnt / ".codex").exists()
    model.play([("exec_command", {"cmd": cmd}) for cmd, _, _ in STEPS] + [FINAL])
    # the bypass stands in for the user's review of new hooks (/hooks in codex)
    out = run_codex(codex, env, m.mnt, "--dangerously-bypass-hook-trust", "make the ten changes")
    assert FINAL in out
    call_ids = [f"toolu_e2e_{i + 1:02d}" for i in range(len(STEPS))]

    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    autos = sorted((c for c in log if c["id"] > 0), key=lambda c: c["id"])
    assert [c["summary"] for c in autos] == [summary for _, summary, _ in STEPS], \
        [(c["id"], c["summary"], [f["path"] for f in c["files"]]) for c in autos]

    assert_each_call_restores(m, repo, autos, [(i, after) for i, (_, _, after) in enumerate(STEPS)],
                              call_ids, agent="codex")

    # back to the fifth call, code and conversation: the cut rollout resumes, from anywhere
    result = m.ctl_ok({"cmd": "restore", "id": autos[4]["id"], "what": "both"})
    command = result["resume"].split()
    assert command[:2] == ["codex", "resume"], result
    assert Path(result["transcript"]).stat().st_mode & 0o777 == 0o600
    turns_before = len(model.turns)
    model.play(["Resumed where we were."])
    out = run_codex(codex, env, tmp_path, "resume", command[2], "where were we?")
    assert "Resumed where we were." in out
    sent = model.turns[turns_before]["input"]
    assert [x["call_id"] for x in sent if x.get("type") == "function_call"] == call_ids[:5]
    assert [x["call_id"] for x in sent if x.get("type") == "function_call_output"] == call_ids[:5]
    assert "where were we?" in str(sent[-1])
