"""The real opencode CLI (pinned in the Makefile, from npm: a native binary) inside a
mount with our hooks (`install-hooks opencode`: a plugin in
~/.config/opencode/plugins/, outside the captured tree), driven by a scripted OpenAI
Chat Completions API on 127.0.0.1 (tests/agent_server.py) through its
@ai-sdk/openai-compatible provider.

Five changing tool calls (write, edit, bash), a read and a failing edit, answered at
once under a window of ten minutes: each changing call is one automatic checkpoint named
by its call (the plugin logs it before it runs), with its files, the conversation up to
that call and a restore that gives its files back; the read and the failed call make
none (the failure is a line with "failed"). A restore of code and
conversation rewinds our conversation and says that opencode's own session (in its
database) is not rewound.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from agent_server import ScriptedModel, absolute, agent_cli, assert_each_call_restores, read
from conftest import Mount, run_cli


@pytest.fixture(scope="module")
def opencode() -> Path:
    return agent_cli("opencode")


# (tool, input with paths relative to the mount, summary (None: a read or a failed call),
#  {path: content after, None: gone})
STEPS: list[tuple[str, dict, str | None, dict[str, str | None]]] = [
    ("write", {"filePath": "notes.txt", "content": "alpha\nbeta\n"}, "write notes.txt",
     {"notes.txt": "alpha\nbeta\n"}),
    ("edit", {"filePath": "notes.txt", "oldString": "beta", "newString": "BETA"}, "edit notes.txt",
     {"notes.txt": "alpha\nBETA\n"}),
    ("read", {"filePath": "src/main.py"}, None, {}),
    ("edit", {"filePath": "notes.txt", "oldString": "gamma", "newString": "GAMMA"}, None, {}),  # fails
    ("bash", {"command": "sed -i 's/hello/HELLO/' README.md", "description": "shout"},
     "bash sed -i 's/hello/HELLO/' README.md", {"README.md": "# demo\n\nHELLO\n"}),
    ("write", {"filePath": "src/new/mod.py", "content": "X = 1\n"}, "write src/new/mod.py",
     {"src/new/mod.py": "X = 1\n"}),
    ("bash", {"command": "cp run.sh run2.sh && rm docs/guide.txt", "description": "copy, remove"},
     "bash cp run.sh run2.sh && rm docs/guide.txt", {"run2.sh": "#!/bin/sh\necho run\n", "docs/guide.txt": None}),
]
PROMPT = "make the five changes"
FINAL = "The five changes are made."


def test_an_opencode_session_is_one_checkpoint_per_changing_call(opencode: Path, model: ScriptedModel,
                                                                 repo: Path, mount_factory,
                                                                 tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    # a window far longer than the run: only the hooks' call lines end the checkpoints
    m: Mount = mount_factory(repo, "--window", "600")
    config = tmp_path / "opencode.json"  # outside the mount: not part of the captured tree
    config.write_text(json.dumps({
        "provider": {"scripted": {"npm": "@ai-sdk/openai-compatible", "name": "scripted",
                                  "options": {"baseURL": model.url + "/v1", "apiKey": "scripted"},
                                  "models": {"x": {"name": "x", "tool_call": True}}}},
        "model": "scripted/x", "autoupdate": False, "share": "disabled"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "OPENCODE_", "XDG_"))}
    # opencode's shell tool starts in $PWD, not in its own working directory; it installs
    # its plugin SDK from npm on start, which it does without when the registry is away.
    # Without retries: npm's default two (10 s, then 60 s apart) held its start for 70 s.
    env.update(HOME=str(home), PWD=str(m.mnt), OPENCODE_CONFIG=str(config), OPENCODE_DISABLE_MODELS_FETCH="1",
               OPENCODE_DISABLE_AUTOUPDATE="1", npm_config_registry="http://127.0.0.1:9/",
               npm_config_fetch_retries="0")
    env.pop("OVERLAYCKPT_MOUNT", None)
    run_cli("install-hooks", "opencode", env=env)
    plugin = home / ".config" / "opencode" / "plugins" / "overlayckpt.js"
    assert plugin.is_file() and "overlayckpt-hook" in plugin.read_text()
    first = model.calls
    model.play([(tool, absolute(m.mnt, args, "filePath")) for tool, args, _, _ in STEPS] + [FINAL])
    proc = subprocess.run([str(opencode), "run", "--model", "scripted/x", PROMPT], cwd=m.mnt,
                          env=env, capture_output=True, text=True, timeout=180, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and FINAL in proc.stdout, f"opencode failed ({proc.returncode}):\n" \
                                                        f"{proc.stdout}\n{proc.stderr}"
    assert len(model.turns) == len(STEPS) + 1

    lines = m.ctl_ok({"cmd": "conversation"})["lines"]
    # (`opencode run` sends its message in quotes, to the model too)
    assert (lines[0]["role"], lines[0]["content"], lines[0]["agent"]) == ("user", f'"{PROMPT}"', "opencode"), lines[0]
    assert (lines[-1]["role"], lines[-1]["content"], lines[-1]["event"]) == ("assistant", FINAL, "Stop"), lines[-1]
    call_ids = [f"toolu_e2e_{first + i + 1:02d}" for i in range(len(STEPS))]
    assert [x["tool_use_id"] for x in lines if x.get("event") == "PreToolUse"] == call_ids
    results = [x for x in lines if x.get("event") in ("PostToolUse", "PostToolUseFailure")]
    assert [x["tool_use_id"] for x in results] == call_ids
    assert [x.get("failed", False) for x in results] == [s[1].get("oldString") == "gamma" for s in STEPS]

    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    autos = sorted((c for c in log if c["id"] > 0), key=lambda c: c["id"])
    changing = [(i, after) for i, (_, _, _, after) in enumerate(STEPS) if after]
    shown = [(c["id"], c["summary"], [f["path"] for f in c["files"]]) for c in autos]
    # one per changing call, none for the read, each named by its call
    assert [c["summary"] for c in autos] == [STEPS[i][2] for i, _ in changing], shown
    assert all(c["kind"] == "auto" for c in autos), shown
    assert_each_call_restores(m, repo, autos, changing, call_ids, "opencode")

    # code and conversation: the tree as it was, our conversation ends with that call, and
    # the restore says that opencode's own session is not rewound
    ck_index, (step_index, _) = 2, changing[2]
    done = m.cli("restore", str(autos[ck_index]["id"]), "--both")
    assert "opencode's own session is not rewound" in done.stderr and "resume" not in done.stdout, done
    expected = {path: read(repo, path) for _, after in changing for path in after}
    for _, after in changing[:ck_index + 1]:
        expected.update(after)
    assert {path: read(m.mnt, path) for path in expected} == expected
    at = m.ctl_ok({"cmd": "conversation"})["lines"]
    assert at[-1]["event"] == "PreToolUse" and at[-1]["tool_use_id"] == call_ids[step_index], at[-1]
    assert at[-1]["summary"] == STEPS[step_index][2]
    assert not [p for p in os.listdir(m.mnt) if p.startswith(".opencode")]

    run_cli("install-hooks", "opencode", "--uninstall", env=env)
    assert not plugin.exists()
