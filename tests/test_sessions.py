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
    from overlayckpt.core.seen import index_entries
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
