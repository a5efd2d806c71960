"""The real opencode CLI (pinned in the Makefile, from npm: a native binary) inside a
mount, without hooks (opencode has none we install), driven by a scripted OpenAI Chat
Completions API on 127.0.0.1 (tests/agent_server.py) through its
@ai-sdk/openai-compatible provider.

Every change is captured at the filesystem: five changing tool calls (write, edit, bash)
and a read, with the model taking longer than the mount's window to answer each turn
as a real one does, are five automatic checkpoints naming their files, none for the
read, each restoring exactly; opencode's own data (its session database, logs) stays
in its home, outside the captured tree.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agent_server import ScriptedModel, absolute, agent_cli, read
from conftest import Mount


@pytest.fixture(scope="module")
def opencode() -> Path:
    return agent_cli("opencode")


# (tool, input with paths relative to the mount, {path: content after, None: gone}); a
# read changes nothing
STEPS: list[tuple[str, dict, dict[str, str | None]]] = [
    ("write", {"filePath": "notes.txt", "content": "alpha\nbeta\n"}, {"notes.txt": "alpha\nbeta\n"}),
    ("edit", {"filePath": "notes.txt", "oldString": "beta", "newString": "BETA"}, {"notes.txt": "alpha\nBETA\n"}),
    ("read", {"filePath": "src/main.py"}, {}),
    ("bash", {"command": "sed -i 's/hello/HELLO/' README.md", "description": "shout"},
     {"README.md": "# demo\n\nHELLO\n"}),
    ("write", {"filePath": "src/new/mod.py", "content": "X = 1\n"}, {"src/new/mod.py": "X = 1\n"}),
    ("bash", {"command": "cp run.sh run2.sh && rm docs/guide.txt", "description": "copy, remove"},
     {"run2.sh": "#!/bin/sh\necho run\n", "docs/guide.txt": None}),
]
FINAL = "The five changes are made."


def test_an_opencode_session_is_one_checkpoint_per_changing_call(opencode: Path, model: ScriptedModel,
                                                                 repo: Path, mount_factory,
                                                                 tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    m: Mount = mount_factory(repo)
    config = tmp_path / "opencode.json"  # outside the mount: not part of the captured tree
    config.write_text(json.dumps({
        "provider": {"scripted": {"npm": "@ai-sdk/openai-compatible", "name": "scripted",
                                  "options": {"baseURL": model.url + "/v1", "apiKey": "scripted"},
                                  "models": {"x": {"name": "x", "tool_call": True}}}},
        "model": "scripted/x", "autoupdate": False, "share": "disabled"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "OPENCODE_", "XDG_"))}
    # opencode's shell tool starts in $PWD, not in its own working directory; it installs
    # its plugin SDK from npm on start, which it does without when the registry is away
    env.update(HOME=str(home), PWD=str(m.mnt), OPENCODE_CONFIG=str(config), OPENCODE_DISABLE_MODELS_FETCH="1",
               OPENCODE_DISABLE_AUTOUPDATE="1", npm_config_registry="http://127.0.0.1:9/")
    model.delay = 1.3  # > the mount's window (1 s): each call's writes are a burst of their own
    model.play([(tool, absolute(m.mnt, args, "filePath")) for tool, args, _ in STEPS] + [FINAL])
    proc = subprocess.run([str(opencode), "run", "--model", "scripted/x", "make the five changes"], cwd=m.mnt,
                          env=env, capture_output=True, text=True, timeout=180, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and FINAL in proc.stdout, f"opencode failed ({proc.returncode}):\n" \
                                                        f"{proc.stdout}\n{proc.stderr}"
    assert len(model.turns) == len(STEPS) + 1

    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    autos = sorted((c for c in log if c["id"] > 0), key=lambda c: c["id"])
    changing = [after for _, _, after in STEPS if after]
    shown = [(c["id"], c["summary"], [f["path"] for f in c["files"]]) for c in autos]
    assert len(autos) == len(changing) and all(c["kind"] == "auto" for c in autos), shown
    expected = {path: read(repo, path) for after in changing for path in after}
    states = []
    for ck, after in zip(autos, changing):
        expected.update(after)
        states.append(dict(expected))
        files = {f["path"] for f in ck["files"]}
        assert set(after) <= files <= set(after) | {"src/new"}, shown
        # hookless: the summary names the files changed
        assert all(Path(path).name in ck["summary"] for path in after), shown
    for ck, state in zip(autos, states):
        m.cli("restore", str(ck["id"]), "--code")
        assert {path: read(m.mnt, path) for path in state} == state, ck["id"]

    # a restore of code and conversation: the tree as it was, no agent session to resume
    result = m.ctl_ok({"cmd": "restore", "id": autos[2]["id"], "what": "both"})
    assert {path: read(m.mnt, path) for path in states[2]} == states[2]
    assert "resume" not in result, result
    assert not [p for p in os.listdir(m.mnt) if p.startswith(".opencode")]
