"""Sessions a user can see (issue 18): mount announces a resumed session, `--new`,
`sessions`, `drop`; and apply's conflict check against what git rewrites in the repo.

Real mounts, the real CLI, real git.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_cli, wait_daemon_gone


def git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd))
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True, timeout=120).stdout


def git_repo(path: Path) -> Path:
    path.mkdir()
    (path / "a.py").write_text("a = 1\n")
    (path / "b.py").write_text("b = 2\n")
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "start")
    return path


def refresh_index(repo: Path) -> None:
    """What a plain `git status` does to the repo's index after its files' stat data
    changed: it rewrites .git/index with new stat data and the same entries."""
    before = (repo / ".git" / "index").read_bytes()
    later = time.time() + 5
    for name in ("a.py", "b.py"):
        os.utime(repo / name, (later, later))
    git(repo, "status", "--porcelain")
    assert (repo / ".git" / "index").read_bytes() != before  # the bytes did change


# -- apply's conflict check ---------------------------------------------------------

def test_apply_goes_on_after_git_status_rewrote_the_repos_index(tmp_path: Path, mount_factory) -> None:
    repo = git_repo(tmp_path / "repo")
    m = mount_factory(repo)
    (m.mnt / "c.py").write_text("c = 3\n")
    git(m.mnt, "add", "c.py")  # the session stages a new file: its .git/index changes
    refresh_index(repo)  # the user runs git status in the repo meanwhile
    run_cli("unmount", str(m.mnt), "--apply")
    wait_daemon_gone(m.store)
    assert git(repo, "diff", "--cached", "--name-only").split() == ["c.py"]
    assert git(repo, "status", "--porcelain").splitlines() == ["A  c.py"]


def test_apply_goes_on_after_a_file_was_rewritten_with_the_same_content(
        tmp_path: Path, mount_factory) -> None:
    repo = git_repo(tmp_path / "repo")
    m = mount_factory(repo)
    (m.mnt / "a.py").write_text("a = 10\n")
    (repo / "a.py").write_text("a = 1\n")  # the same bytes, a new mtime (a checkout, an editor)
    run_cli("--mount", str(m.mnt), "apply")
    assert (repo / "a.py").read_text() == "a = 10\n"


def test_apply_refusal_says_what_differs_and_which_side(tmp_path: Path, mount_factory) -> None:
    repo = git_repo(tmp_path / "repo")
    m = mount_factory(repo)
    (m.mnt / "a.py").write_text("a = 10\n")
    (m.mnt / "c.py").write_text("c = 3\n")
    git(m.mnt, "add", "c.py")
    (repo / "a.py").write_text("a = 1  # the user's\n")
    (repo / "d.py").write_text("d = 4\n")
    git(repo, "add", "d.py")  # the repo's index now stages something else
    proc = run_cli("--mount", str(m.mnt), "apply", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "a.py changed in the repo after the session changed it (size 6 -> 20 bytes" in proc.stderr
    assert ".git/index stages other entries in the repo than when the session began" in proc.stderr
    assert (repo / "a.py").read_text() == "a = 1  # the user's\n"  # nothing changed
    assert git(repo, "diff", "--cached", "--name-only").split() == ["d.py"]
    run_cli("--mount", str(m.mnt), "apply", "--force")
    assert (repo / "a.py").read_text() == "a = 10\n"
    assert git(repo, "diff", "--cached", "--name-only").split() == ["c.py"]


def test_index_entries_read_every_index_version_as_git_lists_them(tmp_path: Path) -> None:
    from overlayckpt.core.baseline import index_entries
    repo = git_repo(tmp_path / "repo")
    for i in range(40):
        (repo / f"dir{i % 3}").mkdir(exist_ok=True)
        (repo / f"dir{i % 3}" / f"file-with-a-longer-name-{i}.txt").write_text(f"{i}\n")
    git(repo, "add", "-A")
    git(repo, "update-index", "--skip-worktree", "a.py")  # extended flags (version 3)
    for version in ("2", "3", "4"):
        git(repo, "update-index", "--index-version", version)
        entries = index_entries((repo / ".git" / "index").read_bytes())
        assert entries is not None
        listed = [f"{mode:o} {oid.hex()} {(flags >> 12) & 3}\t{path.decode()}"
                  for mode, oid, flags, path in entries]
        assert listed == git(repo, "ls-files", "-s").splitlines(), version
    assert index_entries(b"DIRC\0\0\0\2\0\0\0\1" + b"\0" * 30) is None  # truncated
    assert index_entries(b"not an index") is None


# -- the lifecycle ------------------------------------------------------------------

@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The data directory of these tests' default stores (never the user's)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return dict(os.environ)


def listed(env: dict[str, str], repo: Path) -> dict:
    return json.loads(run_cli("sessions", str(repo), "--json", env=env).stdout)


def default_store(repo: Path) -> Path:
    from overlayckpt.store.info import default_store_dir
    return Path(default_store_dir(str(repo)))


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    out = tmp_path / "mnt"
    out.mkdir()
    return out


def test_a_resumed_session_is_announced_and_new_starts_a_fresh_one(
        mnt: Path, repo: Path, torn_down, env: dict[str, str]) -> None:
    first = default_store(repo)
    torn_down(mnt, first)
    torn_down(mnt, Path(f"{first}.2"))
    out = run_cli("mount", str(repo), str(mnt), env=env).stdout
    assert "resumed session" not in out
    (mnt / "agent.txt").write_text("from the first session\n")
    run_cli("--mount", str(mnt), "checkpoint", "one", env=env)
    run_cli("unmount", str(mnt), env=env)

    out = run_cli("mount", str(repo), str(mnt), env=env).stdout
    lines = out.splitlines()
    assert len(lines) == 3 and lines[1].startswith(f"resumed session 1 of {repo} (started ")
    assert "never applied to the repo" in lines[1] and "--new" in lines[2]
    assert (mnt / "agent.txt").exists()
    run_cli("unmount", str(mnt), env=env)

    out = run_cli("mount", str(repo), str(mnt), "--new", env=env).stdout
    assert "resumed session" not in out and f"(store {first}.2)" in out
    assert not (mnt / "agent.txt").exists()  # fresh: the repo as it is
    seen = listed(env, repo)
    assert [(s["id"], s["default"], s["mounted"]) for s in seen["sessions"]] == [
        (1, False, None), (2, True, str(mnt))]
    one = seen["sessions"][0]
    assert one["store"] == str(first) and one["checkpoints"] >= 2 and one["unapplied"] >= 1
    assert one["size_bytes"] > 0 and one["created"] <= one["last_activity"]
    text = run_cli("sessions", str(repo), env=env).stdout
    assert str(first) in text and str(mnt) in text
    run_cli("unmount", str(mnt), env=env)

    out = run_cli("mount", str(repo), str(mnt), "--json", env=env).stdout
    assert json.loads(out)["resumed"]["text"].startswith("resumed session 2 of")
    run_cli("unmount", str(mnt), env=env)
    assert "dropped session 1" in run_cli("drop", "1", "--repo", str(repo), env=env).stdout
    assert not first.exists()
    assert [s["id"] for s in listed(env, repo)["sessions"]] == [2]
    assert (repo / "agent.txt").exists() is False  # nothing was ever applied


def test_drop_refuses_a_mounted_session_and_bad_input_changes_nothing(
        tmp_path: Path, mnt: Path, repo: Path, torn_down, env: dict[str, str]) -> None:
    store = default_store(repo)
    torn_down(mnt, store)
    run_cli("mount", str(repo), str(mnt), env=env)
    for args, says in ((["drop", "1", "--repo", str(repo)], f"is mounted at {mnt}: unmount it first"),
                       (["drop", str(store)], "is mounted at"),
                       (["drop", "9", "--repo", str(repo)], "has no session 9"),
                       (["drop", str(repo)], "is not an overlayckpt session store"),
                       (["mount", str(repo), str(tmp_path), "--new", "--store", str(tmp_path / "s")],
                        "give --new or --store, not both"),
                       (["sessions", str(tmp_path / "nowhere")], "is not a directory")):
        proc = run_cli(*args, check=False, env=env)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert (store / "data.mdb").exists() and not (tmp_path / "s").exists()
    assert [s["id"] for s in listed(env, repo)["sessions"]] == [1]
    run_cli("unmount", str(mnt), env=env)
    wait_daemon_gone(store)


def test_a_store_made_before_sessions_were_numbered_is_session_1(
        mnt: Path, repo: Path, torn_down, env: dict[str, str]) -> None:
    store = default_store(repo)
    torn_down(mnt, store)
    run_cli("mount", str(repo), str(mnt), "--store", str(store), env=env)  # the old default path
    (mnt / "kept.txt").write_text("kept\n")
    run_cli("unmount", str(mnt), env=env)
    wait_daemon_gone(store)
    info = json.loads((store / "session.json").read_text())
    info.pop("created")  # as an older overlayckpt wrote it
    (store / "session.json").write_text(json.dumps(info))
    seen = listed(env, repo)["sessions"]
    assert [(s["id"], s["store"]) for s in seen] == [(1, str(store))] and seen[0]["created"]
    out = run_cli("mount", str(repo), str(mnt), env=env).stdout
    assert "resumed session 1 of" in out and (mnt / "kept.txt").read_text() == "kept\n"
    run_cli("unmount", str(mnt), env=env)
    wait_daemon_gone(store)
