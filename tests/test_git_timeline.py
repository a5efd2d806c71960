"""The real git in a mount: the log names what git did, not the files it keeps in .git."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import Mount

GIT_ENV = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "gc.auto=0"]


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *GIT_ENV, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_git_operations_read_as_git_commands(tmp_path: Path, mount_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "app.py").write_text("print('hi')\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "init")
    m: Mount = mount_factory(repo)
    (m.mnt / "app.py").write_text("print('hashed')\n")
    git(m.mnt, "add", "app.py")
    git(m.mnt, "commit", "-qm", "hash passwords")
    git(m.mnt, "checkout", "-q", "-b", "feat")
    git(m.mnt, "checkout", "-q", "main")
    (m.mnt / "app.py").write_text("print('oops')\n")
    git(m.mnt, "reset", "-q", "--hard")
    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    summaries = [c["summary"] for c in reversed(log)]
    # (the commit, run by the process that made the edit, shares its row: core/folds.py)
    want = ['git commit "hash passwords"; modified app.py', "git checkout -b feat",
            "git checkout main", "git reset --hard HEAD; modified app.py"]
    assert [s for s in summaries if s in want] == want, summaries
    assert not any(f["path"].startswith(".git/") for c in log for f in c["files"])
    assert "no net changes" not in summaries
    everything = m.ctl_ok({"cmd": "log", "all": True})["checkpoints"]
    assert any(f["path"] == ".git/COMMIT_EDITMSG" for c in everything for f in c["files"])
    stat = m.cli("diff", "--stat").stdout
    assert "app.py" in stat and ".git" not in stat
    assert ".git/index" in m.cli("diff", "--stat", "--all").stdout


def test_log_shows_a_page_and_says_how_to_see_more(mounted: Mount) -> None:
    for i in range(4):
        mounted.cli("checkpoint", f"c{i}")
    page = mounted.cli("log", "--limit", "2").stdout.splitlines()
    assert page[-1].startswith("(the newest 2; older ones: --limit N, or --limit 0 for all)")
    assert len([line for line in page if line[:4].strip().isdigit()]) == 2
    everything = mounted.cli("log", "--limit", "0").stdout
    assert "older ones" not in everything and "session start" in everything
    for_scripts = json.loads(mounted.cli("--json", "log").stdout)  # all of it, unless --limit
    assert len(for_scripts["checkpoints"]) == 5 and for_scripts["more"] is False


def test_a_restores_entry_says_what_it_added_modified_and_deleted(mounted: Mount) -> None:
    start = mounted.cli("checkpoint", "start").stdout.strip()
    (mounted.mnt / "new.txt").write_text("made after start\n")
    (mounted.mnt / "README.md").write_text("changed\n")
    (mounted.mnt / "run.sh").unlink()
    mounted.cli("restore", start, "--code")
    entry = mounted.listed_log(limit=1)[0]
    assert entry["kind"] == "restore"
    changes = {f["path"]: f["change"] for f in entry["files"]}
    assert changes == {"new.txt": "D", "README.md": "M", "hardlink.md": "M", "run.sh": "A"}, changes
