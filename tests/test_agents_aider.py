"""The real Aider (pinned in the Makefile, from PyPI into .agents/aider-venv) inside a
mount, without hooks (Aider has none), driven by a scripted OpenAI Chat Completions API
on 127.0.0.1 (tests/agent_server.py) through litellm's openai/ provider.

Aider in a git repo with its defaults: one `aider --message` per message, each applying
the model's SEARCH/REPLACE edits and committing them. Every message that changes files
is one checkpoint in the default log (its edits, git's commit and Aider's own files
together: the chat history, input history and SQLite repo-map cache, which the repo
ignores, fold into it), also when the model takes longer than the mount's window to
write the commit message; a question that changes nothing makes none, and each restores
exactly (committed: git status clean), Aider's own chat history included: after a
restore, `aider --restore-chat-history` resumes from that message.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agent_server import ROOT, ScriptedModel, agent_cli, read
from conftest import Mount


@pytest.fixture(scope="module")
def aider() -> Path:
    return agent_cli("aider", ROOT / ".agents" / "aider-venv" / "bin" / "aider")


def edit(path: str, search: str, replace: str) -> str:
    return f"{path}\n```\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n```\n"


# (the user's message, the model's answer, {path: content after, None: gone}); a question
# changes nothing
MESSAGES: list[tuple[str, str, dict[str, str | None]]] = [
    ("shout the greeting", "Shouting it.\n\n" + edit("README.md", "hello\n", "HELLO\n"),
     {"README.md": "# demo\n\nHELLO\n"}),
    ("what does main.py print?", "It prints the answer, 42.", {}),
    ("bump the answer and exit with it",
     "Two edits.\n\n" + edit("src/pkg/util.py", "    return 42\n", "    return 43\n")
     + "\n" + edit("src/main.py", "print(pkg.util.answer())\n", "exit(pkg.util.answer())\n"),
     {"src/pkg/util.py": "def answer():\n    return 43\n",
      "src/main.py": "import pkg.util\nexit(pkg.util.answer())\n"}),
    ("add notes", "A new file.\n\n" + edit("notes.txt", "", "alpha\nbeta\n"), {"notes.txt": "alpha\nbeta\n"}),
]
COMMIT = "Apply the scripted edit"


def git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


# seconds the model takes to write a commit message: at once, or longer than the mount's
# window (1 s), so that Aider's commit closes as a checkpoint after its edits'
COMMIT_DELAYS = {"prompt-commit-message": 0.0, "slow-commit-message": 1.5}


@pytest.mark.parametrize("commit_delay", list(COMMIT_DELAYS.values()), ids=list(COMMIT_DELAYS))
def test_an_aider_session_is_one_checkpoint_per_message(aider: Path, model: ScriptedModel, repo: Path,
                                                        mount_factory, tmp_path: Path,
                                                        commit_delay: float) -> None:
    home = tmp_path / "home"
    (home / ".aider" / "caches").mkdir(parents=True)
    # a fresh (empty) model-price cache: Aider does not fetch litellm's list from GitHub
    (home / ".aider" / "caches" / "model_prices_and_context_window.json").write_text("{}")
    (home / ".gitconfig").write_text("[user]\n\tname = Test\n\temail = test@example.com\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AIDER_", "GIT_", "LITELLM_"))}
    env.update(HOME=str(home), LITELLM_LOCAL_MODEL_COST_MAP="True")
    # a git repo that ignores Aider's files, as Aider makes it on its first run
    (repo / "hardlink.md").unlink()  # (a hard link to README.md: an edit would change both)
    (repo / ".gitignore").write_text(".aider*\n")
    git(repo, "init", "-q", env=env)
    git(repo, "add", "-A", env=env)
    git(repo, "commit", "-qm", "start", env=env)
    m: Mount = mount_factory(repo)
    env["PWD"] = str(m.mnt)
    # Aider asks the same model for its commit messages: those are not turns. Slower than
    # the mount's window, the commit is a checkpoint of its own, which the default log
    # shows in one row with the edits (the commit's id, the edits' in "folded")
    model.is_turn = lambda body: "commit message" not in json.dumps(body.get("messages", [])[:1])
    model.aside = COMMIT
    model.aside_delay = commit_delay
    for prompt, answer, after in MESSAGES:
        model.play([answer])
        proc = subprocess.run(
            [str(aider), "--model", "openai/scripted", "--openai-api-base", model.url + "/v1",
             "--openai-api-key", "scripted", "--edit-format", "diff", "--yes-always", "--no-check-update",
             "--analytics-disable", "--no-show-model-warnings", "--no-pretty", "--message", prompt,
             "README.md", "src/main.py", "src/pkg/util.py"],
            cwd=m.mnt, env=env, capture_output=True, text=True, timeout=180, check=False, stdin=subprocess.DEVNULL)
        applied = {line.split("Applied edit to ", 1)[1] for line in proc.stdout.splitlines()
                   if line.startswith("Applied edit to ")}
        assert proc.returncode == 0 and applied == set(after), f"aider failed ({proc.returncode}):\n" \
                                                               f"{proc.stdout}\n{proc.stderr}"
    assert len(model.turns) == len(MESSAGES)

    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    autos = sorted((c for c in log if c["id"] > 0), key=lambda c: c["id"])
    changing = [(prompt, after) for prompt, _, after in MESSAGES if after]
    shown = [(c["id"], c["summary"], [f["path"] for f in c["files"]]) for c in autos]
    assert len(autos) == len(changing) and all(c["kind"] == "auto" for c in autos), shown
    if commit_delay:  # each message's edits, then its commit: two checkpoints, one row
        everything = m.ctl_ok({"cmd": "log", "all": True})["checkpoints"]
        assert len(everything) > len(log) and all(c.get("folded") for c in autos), shown
    expected = {path: read(repo, path) for _, after in changing for path in after}
    states = []
    for ck, (_, after) in zip(autos, changing):
        expected.update(after)
        states.append(dict(expected))
        files = {f["path"] for f in ck["files"]}
        # besides its edits, only Aider's own files (git's are not listed)
        assert set(after) <= files and all(f.startswith(".aider") for f in files - set(after)), shown
        assert f'git commit "{COMMIT}"' in ck["summary"], shown
    for ck, state in zip(autos, states):
        m.cli("restore", str(ck["id"]), "--code")
        assert {path: read(m.mnt, path) for path in state} == state, ck["id"]
        assert git(m.mnt, "status", "--porcelain", env=env) == ""

    # back to the second changing message: the tree, git's history and Aider's own chat
    # history as they were after it, no later message in any of them
    result = m.ctl_ok({"cmd": "restore", "id": autos[1]["id"]})
    assert "resume" not in result, result
    assert {path: read(m.mnt, path) for path in states[1]} == states[1]
    assert git(m.mnt, "log", "--format=%s", env=env).splitlines() == [COMMIT, COMMIT, "start"]
    history = read(m.mnt, ".aider.chat.history.md") or ""
    assert all(prompt in history for prompt, _, _ in MESSAGES[:3]) and MESSAGES[3][0] not in history
