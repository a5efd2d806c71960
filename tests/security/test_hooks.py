"""The agent hook writes only into a live overlayckpt mount it has verified, and a
transcript path read from the conversation is used only where the agent keeps its
transcripts (issue 32, point 3 and part of 10).

Hostile inputs: a repo shipping `.overlayckpt/conversation.jsonl` as a symlink to a
shell rc file, a 0666 file planted in a parent directory (by the hook's own user or by
another one), OVERLAYCKPT_MOUNT or --mount naming a directory that is not a mount, a
root's --allow-other mount reached by another user, forged conversation lines naming
a transcript outside the agent's directory, and install-hooks into a missing directory.
Each test compares everything around it before and after.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import CLI, Mount, conversation, make_repo, run_cli
from helpers_users import ROOT, User
from overlayckpt.agents.settings import hook_program
from security.conftest import assert_one_line, surroundings

# Both hooks verify the mount the same way: the Python one (`overlayckpt hook`) and the
# compiled one install-hooks writes (overlayckpt/bin/overlayckpt-hook, built by setup.py)
HOOKS = {"python": [sys.executable, "-P", "-m", "overlayckpt", "hook"], "compiled": [str(hook_program())]}


@pytest.fixture(params=list(HOOKS))
def hook(request: pytest.FixtureRequest) -> list[str]:
    """The hook command without its AGENT argument."""
    assert hook_program(), "the compiled hook is not built: setup.py build_ext --inplace"
    return HOOKS[request.param]

PROMPT = "my password is hunter2; $(touch PWNED)"
RC = "# my shell rc\nexport PATH=$HOME/bin:$PATH\n"


def event(cwd: Path) -> str:
    return json.dumps({"hook_event_name": "UserPromptSubmit", "session_id": "s1", "transcript_path": "",
                       "cwd": str(cwd), "prompt": PROMPT})


def hook_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OVERLAYCKPT_MOUNT"}
    return {**env, **extra}


def run_hook(hook: list[str], cwd: Path, *args: str,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The hook as install-hooks writes it, run in cwd as the agent runs it: never fails."""
    proc = subprocess.run(hook + ["claude-code", *args], input=event(cwd), text=True,
                          capture_output=True, cwd=str(cwd), env=env or hook_env(), timeout=30)
    assert proc.returncode == 0, proc
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") <= 1, proc.stderr
    return proc


def shipped_symlinks(repo: Path, rc: Path) -> None:
    """The repo ships .overlayckpt/conversation.jsonl -> the user's rc file, at its top and below."""
    for d in (repo, repo / "src"):
        (d / ".overlayckpt").mkdir()
        (d / ".overlayckpt" / "conversation.jsonl").symlink_to(rc)


def test_a_shipped_symlink_outside_a_mount_gets_nothing(tmp_path: Path, hook: list[str]) -> None:
    rc = tmp_path / "home" / ".bashrc"
    rc.parent.mkdir()
    rc.write_text(RC)
    repo = make_repo(tmp_path / "repo")
    shipped_symlinks(repo, rc)
    before = surroundings(tmp_path)
    run_hook(hook, repo / "src")
    run_hook(hook, repo)
    for quiet in (run_hook(hook, repo, env=hook_env(OVERLAYCKPT_MOUNT=str(repo))),
                  run_hook(hook, repo, "--mount", str(repo))):
        assert "not an overlayckpt mount" in quiet.stderr  # named by the user: one line says why
    assert surroundings(tmp_path) == before
    assert rc.read_text() == RC


def test_a_shipped_symlink_in_a_mount_is_not_followed(tmp_path: Path, mount_factory, hook: list[str]) -> None:
    """The positive control: in a live mount the hook logs, into the mount's own
    conversation, whatever the repo ships at its top or in the directory the agent is in."""
    rc = tmp_path / "home" / ".bashrc"
    rc.parent.mkdir()
    rc.write_text(RC)
    repo = make_repo(tmp_path / "repo")
    shipped_symlinks(repo, rc)
    m: Mount = mount_factory(repo)
    before = surroundings(tmp_path, m.mnt, m.store)
    run_hook(hook, m.mnt / "src")
    run_hook(hook, tmp_path, env=hook_env(OVERLAYCKPT_MOUNT=str(m.mnt)))
    run_hook(hook, tmp_path, "--mount", str(m.mnt) + "/")
    assert [line["content"] for line in conversation(m)] == [PROMPT] * 3
    assert surroundings(tmp_path, m.mnt, m.store) == before
    assert rc.read_text() == RC


@pytest.mark.parametrize("planter", ["me", "another user"])
def test_a_planted_file_in_a_shared_parent_collects_nothing(tmp_path: Path, user: User, planter: str,
                                                            hook: list[str]) -> None:
    shared = tmp_path / "shared"  # like /tmp: anyone may create entries in it
    (shared / ".overlayckpt").mkdir(parents=True)
    shared.chmod(0o1777)
    planted = shared / ".overlayckpt" / "conversation.jsonl"
    planted.write_text("")
    planted.chmod(0o666)
    if planter == "another user":
        user.chown(shared / ".overlayckpt")
    project = shared / "project"
    project.mkdir()
    before = surroundings(tmp_path)
    run_hook(hook, project)
    assert run_hook(hook, project, env=hook_env(OVERLAYCKPT_MOUNT=str(shared))).stderr.count("\n") == 1
    assert surroundings(tmp_path) == before
    assert planted.read_text() == ""


def test_a_file_planted_by_root_collects_nothing_from_a_user(user: User, hook: list[str]) -> None:
    """The other way round: the hook runs as the user, below a directory where root
    planted a 0666 file (every step of the path the user's to pass)."""
    work = Path(tempfile.mkdtemp(prefix="hookplant-", dir=user.home))
    try:
        (work / "project").mkdir()
        user.chown(work)
        (work / ".overlayckpt").mkdir(mode=0o777)
        planted = work / ".overlayckpt" / "conversation.jsonl"
        planted.write_text("")
        planted.chmod(0o666)
        before = surroundings(work)
        for env in ([], [f"OVERLAYCKPT_MOUNT={work}"]):
            proc = subprocess.run(user.argv("env", f"PYTHONPATH={ROOT}", *env, *hook, "claude-code",
                                            cwd=work / "project"),
                                  input=event(work / "project"), cwd="/", env=user.env(), capture_output=True,
                                  text=True, timeout=60)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc
        assert surroundings(work) == before
        assert planted.read_text() == ""
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_mount_of_another_user_gets_nothing(user: User, torn_down, hook: list[str]) -> None:
    """root's --allow-other mount is open to the user, but it is not the user's: the hook
    run by the user logs nothing into it (mountinfo's user_id is root's)."""
    work = Path(tempfile.mkdtemp(prefix="hookother-", dir=user.home))
    try:
        repo, mnt, store = make_repo(work / "repo"), work / "mnt", work / "store"
        mnt.mkdir()
        os.chmod(work, 0o755)
        torn_down(mnt, store)
        run_cli("mount", str(repo), str(mnt), "--store", str(store), "--allow-other")
        m = Mount(repo, mnt, store)
        proc = subprocess.run(user.argv("env", f"PYTHONPATH={ROOT}", *hook, "claude-code", cwd=mnt),
                              input=event(mnt), cwd="/", env=user.env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr == "", proc
        run_hook(hook, mnt)  # root's own hook does log: the control
        assert [line["content"] for line in conversation(m)] == [PROMPT]
    finally:
        run_cli("unmount", str(work / "mnt"), "--no-apply", check=False)
        shutil.rmtree(work, ignore_errors=True)


def test_the_hook_logs_in_a_sandboxed_run_of_a_user(user: User, hook: list[str]) -> None:
    """The positive control where the checks could misfire: `run --private` as a normal
    user mounts in the user's own user and mount namespaces, and the agent runs in one
    more user namespace; mountinfo must still name the user's uid, and the hook log."""
    work = Path(tempfile.mkdtemp(prefix="hookns-", dir=user.home))
    try:
        repo = make_repo(work / "repo")
        (work / "event.json").write_text(event(repo))
        user.chown(work)
        command = " ".join(hook)
        probe = (f"{command} claude-code < {work}/event.json && "
                 f"{command} claude-code --mount {repo} < {work}/event.json && "
                 "cat .overlayckpt/conversation.jsonl")
        proc = user.cli("run", "--private", "--repo", str(repo), "--", "sh", "-c", probe,
                        wrap=("env", f"PYTHONPATH={ROOT}"))
        assert [json.loads(x)["content"] for x in proc.stdout.splitlines()] == [PROMPT] * 2, proc
        assert "overlayckpt hook" not in proc.stderr, proc.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- a transcript path read from the conversation --------------------------------------

def transcript_entry(text: str) -> str:
    return json.dumps({"sessionId": "sess", "type": "user", "message": text,
                       "timestamp": "2000-01-01T00:00:00.000Z"}) + "\n"


FORGED = ["outside", "dot-dot", "symlinked directory", "symlinked file", "another user's", "relative"]


@pytest.mark.parametrize("kind", FORGED)
def test_a_forged_transcript_path_is_not_followed(repo: Path, mount_factory, tmp_path: Path, user: User,
                                                  monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    claude = tmp_path / "claude"  # CLAUDE_CONFIG_DIR of the daemon: transcripts in claude/projects/*/
    project = claude / "projects" / "p"
    project.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "t.jsonl").write_text(transcript_entry("secret"))
    path = {"outside": str(outside / "t.jsonl"),
            "dot-dot": f"{claude}/projects/../../outside/t.jsonl",
            "symlinked directory": f"{project}/evil/t.jsonl",
            "symlinked file": f"{project}/t.jsonl",
            "another user's": f"{project}/theirs.jsonl",
            "relative": "outside/t.jsonl"}[kind]
    (project / "evil").symlink_to(outside)
    (project / "t.jsonl").symlink_to(outside / "t.jsonl")
    (project / "theirs.jsonl").write_text(transcript_entry("theirs"))
    os.chown(project / "theirs.jsonl", user.uid, user.gid)
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(claude))
    m: Mount = mount_factory(repo)
    # anyone who can write the conversation (the agent) can forge this line
    with open(m.mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
        f.write(json.dumps({"role": "user", "content": "hi", "agent": "claude-code", "event": "UserPromptSubmit",
                            "transcript_path": path}) + "\n")
    (m.mnt / "new.txt").write_text("after\n")
    cid = m.cli("checkpoint").stdout.strip()
    (m.mnt / "new.txt").write_text("later\n")
    before = surroundings(tmp_path, m.mnt, m.store)
    proc = m.cli("restore", cid, "--both")
    assert (m.mnt / "new.txt").read_text() == "after\n"  # the restore itself stands
    assert "claude --resume" not in proc.stdout and "restored checkpoint" in proc.stdout
    err = proc.stderr.strip()
    assert "\n" not in err and "the agent transcript was not cut" in err and "Traceback" not in err, err
    assert surroundings(tmp_path, m.mnt, m.store) == before


def opencode_events(mnt: Path, outside: Path) -> list[object]:
    """What anyone who can run the hook may send as opencode's plugin events: paths
    outside the repo (through .., absolute, a symlink the repo ships), a forged
    transcript path, fields of every wrong type, an unknown event, nesting."""
    base = {"cwd": str(mnt), "session_id": "ses_1"}
    deep: object = "x"
    for _ in range(200):
        deep = {"a": [deep]}
    return [
        dict(base, hook_event_name="tool.execute.before", tool="write", call_id="c1",
             args={"filePath": str(outside / "victim.txt"), "content": "pwned"}),
        dict(base, hook_event_name="tool.execute.after", tool="write", call_id="c1", output="ok"),
        dict(base, hook_event_name="tool.execute.before", tool="read", call_id="c2",
             args={"filePath": str(mnt / "src" / ".." / ".." / "outside" / "victim.txt")}),
        dict(base, hook_event_name="tool.execute.before", tool="edit", call_id="c3",
             args={"filePath": str(mnt / "out" / "victim.txt")}, transcript_path=str(outside / "victim.txt")),
        dict(base, hook_event_name="tool.execute.before", tool={"x": 1}, call_id=5, args="not an object"),
        dict(base, hook_event_name="tool.execute.after", tool=None, call_id=[1], output={"nested": deep}),
        dict(base, hook_event_name="chat.message", prompt=["not", "text"], session_id={"x": 1}),
        dict(base, hook_event_name="session.idle", message=7),
        dict(base, hook_event_name="tool.execute.before", tool="apply_patch", call_id="c4",
             args={"patchText": f"*** Begin Patch\n*** Add File: {outside}/victim.txt\n+x\n*** End Patch"}),
        dict(base, hook_event_name="file.edited", file=str(outside / "victim.txt")),  # logs nothing
        dict(base, hook_event_name="tool.execute.before", tool="write", args={"filePath": 42}),
    ]


def test_hostile_opencode_events_are_text_only(tmp_path: Path, mount_factory, hook: list[str]) -> None:
    """opencode's events are parsed by the daemon (agents/opencode.py) from whatever the
    hook was given: each becomes a line or nothing, its paths are only text in the line
    (nothing outside the repo is opened, read or written, no link is followed), the daemon
    logs no error, and a restore of the conversation reads no transcript it names."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("mine\n")
    repo = make_repo(tmp_path / "repo")
    (repo / "out").symlink_to(outside)
    m: Mount = mount_factory(repo)
    before = surroundings(tmp_path, m.mnt, m.store)
    for ev in opencode_events(m.mnt, outside):
        proc = subprocess.run(hook + ["opencode"], input=json.dumps(ev), text=True, capture_output=True,
                              cwd=str(m.mnt), env=hook_env(), timeout=30)
        assert proc.returncode == 0 and proc.stdout == "", proc
    lines = conversation(m)
    assert len(lines) == 10 and all(x["agent"] == "opencode" for x in lines), lines
    assert lines[0]["summary"] == f"write {outside}/victim.txt" and lines[0]["transcript_path"] is None
    assert lines[3]["transcript_path"] is None  # forged: dropped, never followed
    assert lines[4]["summary"] == "?" and lines[4]["tool"] == "?" and lines[4]["tool_use_id"] is None
    assert lines[6]["content"] == "" and lines[7]["content"] == "(turn finished)"
    assert lines[8]["summary"] == f"apply_patch {outside}/victim.txt"
    assert lines[9]["summary"] == "write"
    (m.mnt / "new.txt").write_text("after\n")
    cid = m.cli("checkpoint").stdout.strip()
    (m.mnt / "new.txt").write_text("later\n")
    done = m.cli("restore", cid, "--both")
    assert "opencode's own session is not rewound" in done.stderr and "Traceback" not in done.stderr
    assert (m.mnt / "new.txt").read_text() == "after\n"
    assert (outside / "victim.txt").read_text() == "mine\n"
    assert surroundings(tmp_path, m.mnt, m.store) == before


# --- install-hooks ------------------------------------------------------------------------

@pytest.mark.parametrize("agent", ["claude-code", "codex", "gemini", "cursor", "opencode"])
def test_install_hooks_into_a_missing_directory_is_refused(tmp_path: Path, agent: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = hook_env(HOME=str(home))
    env.pop("CLAUDE_CONFIG_DIR", None)
    env.pop("CODEX_HOME", None)
    before = surroundings(tmp_path)
    proc = run_cli("install-hooks", agent, "--settings", str(tmp_path / "nonexistent" / "dir" / "s.json"),
                   "--project", str(tmp_path), env=env, check=False)
    assert_one_line(proc, "nonexistent/dir", "not a directory")
    # the agent's default place, below a directory that is not there either: no tree made
    proc = run_cli("install-hooks", agent, "--project", str(tmp_path), check=False,
                   env=dict(env, HOME=str(tmp_path / "gone"), CODEX_HOME=str(tmp_path / "gone" / "codex"),
                            CLAUDE_CONFIG_DIR=str(tmp_path / "gone" / "claude")))
    assert_one_line(proc, "not a directory")
    assert surroundings(tmp_path) == before


def test_install_hooks_makes_the_agents_own_directory_private(tmp_path: Path) -> None:
    """The default place's one missing directory (~/.codex before Codex first ran) is made,
    0700, and the files 0600 whatever the umask."""
    home = tmp_path / "home"
    home.mkdir()
    env = hook_env(HOME=str(home))
    env.pop("CODEX_HOME", None)
    subprocess.run(CLI + ["install-hooks", "codex", "--project", str(tmp_path)], env=env, check=True,
                   capture_output=True, umask=0)
    assert (home / ".codex").stat().st_mode & 0o777 == 0o700
    for name in ("hooks.json", "config.toml"):
        assert (home / ".codex" / name).stat().st_mode & 0o777 == 0o600, name
    assert sorted(os.listdir(home / ".codex")) == ["config.toml", "hooks.json"]  # no temp file left


def test_install_hooks_keeps_the_mode_and_follows_no_planted_link(tmp_path: Path) -> None:
    """An existing file keeps its mode; a symlink at the settings' path is replaced, not
    written through, and so is one where the old fixed temp name was."""
    settings_dir = tmp_path / "cfg"
    settings_dir.mkdir()
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    kept = settings_dir / "kept.json"
    kept.write_text("{}")
    kept.chmod(0o640)
    linked = settings_dir / "linked.json"
    linked.symlink_to(victim)
    (settings_dir / "kept.json.tmp").symlink_to(victim)
    for path in (kept, linked):
        run_cli("install-hooks", "gemini", "--settings", str(path), "--project", str(tmp_path))
        assert "overlayckpt-hook gemini" in path.read_text()
        assert not path.is_symlink()
    assert kept.stat().st_mode & 0o777 == 0o640
    assert linked.stat().st_mode & 0o777 == victim.stat().st_mode & 0o777  # the mode the user gave it
    assert victim.read_text() == "{}"
    assert (settings_dir / "kept.json.tmp").is_symlink()


def test_a_repo_shipping_an_overlayckpt_package_runs_none_of_it(tmp_path: Path) -> None:
    """Agents run the installed hook and MCP server in the repo, whose directory `python -m`
    would put first on sys.path: a shipped overlayckpt/ package must not be what runs.
    An earlier install's command (without -P) is replaced in place."""
    settings = tmp_path / "settings.json"
    old = {"type": "command", "command": f"{sys.executable} -m overlayckpt hook claude-code"}
    settings.write_text(json.dumps({"hooks": {"Stop": [{"hooks": [old]}]}}))
    env = hook_env(CLAUDE_CONFIG_DIR=str(tmp_path))  # the MCP server goes to tmp_path/.claude.json
    run_cli("install-hooks", "claude-code", "--settings", str(settings), "--project", str(tmp_path), env=env)
    hooks = json.loads(settings.read_text())["hooks"]
    commands = {h["command"] for entries in hooks.values() for e in entries for h in e["hooks"]}
    assert len(commands) == 1 and len(hooks["Stop"]) == 1, hooks
    server = json.loads((tmp_path / ".claude.json").read_text())["mcpServers"]["overlayckpt"]
    repo = make_repo(tmp_path / "repo")
    (repo / "overlayckpt").mkdir()
    (repo / "overlayckpt" / "__init__.py").write_text("")
    (repo / "overlayckpt" / "__main__.py").write_text("open('PWNED', 'w')\n")
    before = surroundings(tmp_path)
    proc = subprocess.run(["sh", "-c", commands.pop()], input=event(repo), text=True, capture_output=True,
                          cwd=repo, env=hook_env(), timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", proc
    subprocess.run([server["command"], *server["args"]], stdin=subprocess.DEVNULL, capture_output=True,
                   cwd=repo, env=hook_env(), timeout=60)
    assert surroundings(tmp_path) == before
