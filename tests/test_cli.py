"""mount / unmount / run as a user drives them: in place, apply, status, private."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import CLI, force_unmount, run_cli, tree_digest, wait_daemon_gone


def edit(root: Path) -> None:
    (root / "README.md").write_text("edited\n")
    (root / "new.txt").write_text("new\n")
    os.unlink(root / "run.sh")
    (root / "src" / "pkg" / "util.py").rename(root / "util_moved.py")
    os.symlink("new.txt", root / "newlink")
    os.chmod(root / "bin.dat", 0o600)


def test_in_place_mount_applies_on_unmount(repo: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    run_cli("mount", str(repo), "--store", str(store))
    try:
        edit(repo)
        live = tree_digest(str(repo))
        status = run_cli("--mount", str(repo), "status").stdout
        assert "in_place: True" in status
        run_cli("unmount", str(repo))
    finally:
        force_unmount(str(repo))
    wait_daemon_gone(store)
    assert tree_digest(str(repo)) == live
    assert not (repo / ".overlayckpt").exists()
    # the session stays: mounting again resumes it, history intact
    run_cli("mount", str(repo), "--store", str(store))
    try:
        assert run_cli("--mount", str(repo), "show", "0", "run.sh").stdout == "#!/bin/sh\necho run\n"
        run_cli("--mount", str(repo), "restore", "0")
        assert (repo / "run.sh").exists() and not (repo / "new.txt").exists()
        run_cli("unmount", str(repo))
    finally:
        force_unmount(str(repo))
    wait_daemon_gone(store)
    assert (repo / "README.md").read_text() == "# demo\n\nhello\n"
    assert run_cli("--store", str(store), "fsck").returncode == 0


def test_separate_mount_applies_only_when_asked(repo: Path, mount_factory) -> None:
    before = tree_digest(str(repo))
    m = mount_factory(repo)
    edit(m.mnt)
    live = tree_digest(str(m.mnt))
    run_cli("unmount", str(m.mnt))
    wait_daemon_gone(m.store)
    assert tree_digest(str(repo)) == before
    run_cli("mount", str(repo), str(m.mnt), "--store", str(m.store))
    assert tree_digest(str(m.mnt)) == live
    run_cli("unmount", str(m.mnt), "--apply")
    wait_daemon_gone(m.store)
    assert tree_digest(str(repo)) == live


def test_second_mount_of_a_store_fails_cleanly(repo: Path, mount_factory, tmp_path: Path) -> None:
    m = mount_factory(repo)
    other = tmp_path / "other"
    other.mkdir()
    proc = run_cli("mount", str(repo), str(other), "--store", str(m.store), check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("overlayckpt: ") and "in use" in proc.stderr
    assert (m.mnt / "README.md").read_text() == "# demo\n\nhello\n"


def test_a_mount_started_with_its_output_closed_works(repo: Path, tmp_path: Path, torn_down) -> None:
    """The daemon is forked from the mount's CLI: started with stdin, stdout and stderr
    closed (as some process managers do), the CLI's Python has none of them, and the
    daemon must still serve and log (it once died at its first write to stderr)."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    torn_down(mnt, store)
    proc = subprocess.run(["sh", "-c", 'exec "$@" <&- >&- 2>&-', "sh", *CLI, "mount", str(repo),
                           str(mnt), "--store", str(store)], timeout=120)
    assert proc.returncode == 0
    (mnt / "made.txt").write_text("made\n")
    run_cli("unmount", str(mnt), "--no-apply")
    wait_daemon_gone(store)
    assert "Traceback" not in (store / "daemon.log").read_text()
    assert "made.txt" in run_cli("--store", str(store), "--json", "log").stdout


def test_run_returns_the_command_status(repo: Path, tmp_path: Path, torn_down) -> None:
    store = tmp_path / "store"
    torn_down(repo, store)  # run mounts in place: unmounted and its daemon ended whatever happens
    proc = run_cli("run", "--repo", str(repo), "--store", str(store), "--no-apply", "--",
                   "sh", "-c", "echo hi > made.txt; test -d .overlayckpt; exit 7", check=False)
    assert proc.returncode == 7, proc.stderr
    wait_daemon_gone(store)
    assert not (repo / "made.txt").exists()
    assert "made.txt" in run_cli("--store", str(store), "--json", "log").stdout
    run_cli("run", "--repo", str(repo), "--store", str(store), "--", "sh", "-c", "echo ok > done.txt")
    wait_daemon_gone(store)
    assert (repo / "done.txt").read_text() == "ok\n"


def test_run_private_hides_the_overlay_from_other_processes(repo: Path, tmp_path: Path,
                                                           torn_down) -> None:
    store = tmp_path / "store"
    torn_down(repo, store)  # the mount is in run's own namespace: its daemon is killed if left
    probe = f"test -d .overlayckpt && echo inside > private.txt && ! grep -q '{repo}' /proc/1/mountinfo"
    proc = run_cli("run", "--private", "--repo", str(repo), "--store", str(store), "--",
                   "sh", "-c", probe, check=False)
    assert proc.returncode == 0, proc.stderr
    wait_daemon_gone(store)
    assert not (repo / "private.txt").exists()  # private runs do not apply by default
    assert "private.txt" in run_cli("--store", str(store), "--json", "log").stdout
    with open("/proc/self/mountinfo") as f:
        assert str(repo) not in f.read()


def test_offline_apply_of_live_and_of_a_checkpoint(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    (m.mnt / "src" / "pkg" / "util.py").write_text("def answer():\n    return 43\n")
    (m.mnt / "docs" / "deep").mkdir()
    (m.mnt / "docs" / "deep" / "x.txt").write_text("x\n")
    cid = m.cli("checkpoint").stdout.strip()
    os.unlink(m.mnt / "docs" / "guide.txt")
    live = tree_digest(str(m.mnt))
    at_cid = tree_digest(str(m.mnt / ".overlayckpt" / "checkpoints" / cid))
    run_cli("unmount", str(m.mnt))
    wait_daemon_gone(m.store)
    run_cli("--store", str(m.store), "apply")  # a fresh process: nothing cached in memory
    assert tree_digest(str(repo)) == live
    run_cli("--store", str(m.store), "apply", "--checkpoint", cid)
    assert tree_digest(str(repo)) == at_cid
    assert run_cli("--store", str(m.store), "show", "0", "docs/guide.txt").stdout == "line\n" * 5000


def test_apply_refuses_to_overwrite_changes_made_in_the_repo(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    (m.mnt / "README.md").write_text("agent\n")
    (m.mnt / "src" / "main.py").write_text("agent too\n")
    (repo / "README.md").write_text("user, behind the mount's back\n")  # also hardlink.md
    (repo / "docs" / "guide.txt").write_text("user only\n")  # the agent never touched it
    proc = run_cli("unmount", str(m.mnt), "--apply", check=False)
    assert proc.returncode == 1 and "README.md" in proc.stderr and "--force" in proc.stderr
    assert proc.stderr.count("\n") == 1
    wait_daemon_gone(m.store)
    assert (repo / "README.md").read_text() == "user, behind the mount's back\n"
    run_cli("--store", str(m.store), "apply", "--force")
    assert (repo / "README.md").read_text() == "agent\n"
    assert (repo / "src" / "main.py").read_text() == "agent too\n"
    assert (repo / "docs" / "guide.txt").read_text() == "user only\n"
    run_cli("--store", str(m.store), "apply")  # now the repo is what we wrote: no conflict
