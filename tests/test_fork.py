"""Forks on real mounts through the CLI (issue 20): two forks of one checkpoint edited
at once with sed, each restoring on its own, an exact diff between them, apply --from
writing exactly the winner's tree, drop refused for a parent with forks, fsck along the
chain, export on each fork's own branch, and run --fork N."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli, tree_digest, wait_daemon_gone


@pytest.fixture
def two_forks(tmp_path: Path, repo: Path, mount_factory, torn_down):
    """A parent mounted beside the repo with a named checkpoint `base`, and two forks of
    it mounted (each torn down at the end, whatever happens)."""
    parent = mount_factory(repo)
    subprocess.run(["sed", "-i", "s/hello/hello from the parent/", str(parent.mnt / "README.md")],
                   check=True)
    parent.cli("checkpoint", "base")
    forks = []
    for name in ("f1", "f2"):
        mnt, store = tmp_path / f"mnt-{name}", tmp_path / f"store-{name}"
        mnt.mkdir()
        torn_down(mnt, store)
        parent.cli("fork", "base", str(mnt), "--fork-store", str(store))
        forks.append((mnt, store))
    return parent, forks


def sed_at_once(*jobs: tuple[str, Path]) -> None:
    """sed -i of each (expression, file), all started before any is waited for."""
    procs = [subprocess.Popen(["sed", "-i", expr, str(path)]) for expr, path in jobs]
    assert [p.wait(timeout=120) for p in procs] == [0] * len(procs)


def test_two_forks_of_one_checkpoint(tmp_path: Path, repo: Path, two_forks) -> None:
    parent, ((m1, s1), (m2, s2)) = two_forks
    base = tree_digest(str(parent.mnt))
    assert tree_digest(str(m1)) == base == tree_digest(str(m2))
    sed_at_once(("s/line/one/", m1 / "docs" / "guide.txt"), ("3s/.*/two/", m2 / "docs" / "guide.txt"),
                ("s/42/1/", m1 / "src" / "pkg" / "util.py"), ("s/print/echo/", m2 / "src" / "main.py"))
    (m1 / "new.txt").write_text("only in f1\n")
    os.remove(m2 / "bin.dat")
    one, two = tree_digest(str(m1)), tree_digest(str(m2))
    assert one != two and tree_digest(str(parent.mnt)) == base  # apart from each other

    # each restores on its own
    run_cli("--mount", str(m1), "restore", "0")
    assert tree_digest(str(m1)) == base and tree_digest(str(m2)) == two
    run_cli("--mount", str(m1), "restore", "@before-last")
    assert tree_digest(str(m1)) == one

    # the diff between the forks is exact: applied to f1's tree it gives f2's
    patch = run_cli("diff", f"{s1}:", f"{s2}:").stdout
    assert "only in f1" in patch and "-    return 1\n+    return 42\n" in patch
    copy = tmp_path / "copy"
    shutil.copytree(m1, copy, symlinks=True)
    subprocess.run(["git", "apply", "--binary", "-"], input=patch.encode(), cwd=copy, check=True)
    assert tree_digest(str(copy)) == two
    stat = run_cli("--json", "diff", "--stat", f"{s1}:", f"{s2}:").stdout
    assert {f["path"] for f in json.loads(stat)["files"]} == {
        "docs/guide.txt", "src/pkg/util.py", "src/main.py", "new.txt", "bin.dat"}
    # a state against a checkpoint of the parent: only the fork's own changes
    own = json.loads(run_cli("--json", "diff", "--stat", f"{parent.store}:base", f"{s2}:").stdout)
    assert {f["path"] for f in own["files"]} == {"docs/guide.txt", "src/main.py", "bin.dat"}

    # log says where each fork started; fsck follows the chain to the parent's blocks
    assert "at its checkpoint" in run_cli("--mount", str(m2), "log").stdout
    assert "clean" in run_cli("--mount", str(m2), "fsck").stdout

    # the winner's tree, exactly, into the repo
    run_cli("apply", "--from", f"{s2}:", "--repo", str(repo))
    assert tree_digest(str(repo)) == two


def test_drop_refuses_a_parent_with_forks_and_thinning_keeps_the_fork_point(
        tmp_path: Path, repo: Path, two_forks) -> None:
    parent, ((m1, s1), (m2, s2)) = two_forks
    big = os.urandom(1 << 20)
    (parent.mnt / "big.bin").write_bytes(big)
    newest = json.loads(parent.cli("--json", "log").stdout)["checkpoints"][0]  # (sealed)
    assert newest["kind"] == "auto" and "big.bin" in {f["path"] for f in newest["files"]}
    m3, s3 = tmp_path / "mnt-f3", tmp_path / "store-f3"
    m3.mkdir()
    parent.cli("fork", str(newest["id"]), str(m3), "--fork-store", str(s3))
    try:
        assert (s3 / "data.mdb").stat().st_blocks * 512 < (1 << 20) // 2  # no file data copied
        os.remove(parent.mnt / "big.bin")
        for i in range(4):  # more automatic checkpoints, for thinning to drop
            (parent.mnt / f"n{i}.txt").write_text(f"{i}\n")
            parent.cli("log")
        parent.cli("gc", "--budget", "0")  # thin all it may, then collect
        kept = {c["id"] for c in json.loads(parent.cli("--json", "log", "--all").stdout)["checkpoints"]}
        assert newest["id"] in kept
        assert (m3 / "big.bin").read_bytes() == big
        for m in (m1, m2, m3):
            run_cli("unmount", str(m), "--no-apply")
        run_cli("unmount", str(parent.mnt), "--no-apply")
        wait_daemon_gone(parent.store)
        refused = run_cli("drop", str(parent.store), check=False)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
        assert "has forks" in refused.stderr and str(s3) in refused.stderr
        assert (parent.store / "data.mdb").exists()
        run_cli("--store", str(s3), "fsck")
        for s in (s1, s2, s3):
            run_cli("drop", str(s))
        run_cli("drop", str(parent.store))
        assert not parent.store.exists()
    finally:
        subprocess.run(["fusermount3", "-u", str(m3)], capture_output=True)


def test_export_of_a_fork_lands_on_its_own_branch(tmp_path: Path, mount_factory, torn_down) -> None:
    repo = tmp_path / "gitrepo"
    repo.mkdir()
    (repo / "a.txt").write_text("a\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_NOSYSTEM="1", HOME=str(tmp_path))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)
    parent = mount_factory(repo)
    (parent.mnt / "a.txt").write_text("parent\n")
    mnt, store = tmp_path / "mnt-f", tmp_path / "store-fork"
    mnt.mkdir()
    torn_down(mnt, store)
    parent.cli("fork", str(mnt), "--fork-store", str(store))
    (mnt / "a.txt").write_text("fork\n")
    out = run_cli("--mount", str(mnt), "export", "git").stdout
    parent.cli("export", "git")
    branches = subprocess.run(["git", "branch", "--format=%(refname:short)"], cwd=repo, env=env,
                              capture_output=True, text=True, check=True).stdout.split()
    assert "overlayckpt/store-fork" in branches and "overlayckpt/store-mnt" in branches
    shown = subprocess.run(["git", "show", "overlayckpt/store-fork:a.txt"], cwd=repo, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert shown == "fork\n" and "overlayckpt/store-fork" in out


def test_run_fork_runs_the_command_in_each_fork(tmp_path: Path, repo: Path, mount_factory,
                                                 monkeypatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    parent = mount_factory(repo)
    script = 'echo "$OVERLAYCKPT_FORK" > fork.txt; sed -i "s/hello/fork $OVERLAYCKPT_FORK/" README.md; ' \
             'exit $((OVERLAYCKPT_FORK - 1))'
    proc = run_cli("--json", "--mount", str(parent.mnt), "run", "--fork", "2", "--", "sh", "-c",
                   script, check=False)
    assert proc.returncode == 1  # one of them failed
    result = json.loads(proc.stdout)
    assert [f["status"] for f in result["forks"]] == [0, 1]
    for i, f in enumerate(result["forks"], 1):
        assert {x["path"] for x in f["files"]} == {"fork.txt", "README.md"}
        log = json.loads(run_cli("--json", "--store", f["store"], "log").stdout)
        assert log["checkpoints"][0]["message"] == f"run: exit {i - 1}"
        patch = run_cli("diff", f"{parent.store}:", f"{f['store']}:").stdout
        assert f"+fork {i}\n" in patch and "+hello\n" not in patch
    assert not [m for m in open("/proc/self/mounts").read().splitlines() if "overlayckpt-forks-" in m]
    # sessions: the forks are numbered sessions of the repo, each naming its parent
    listed = json.loads(run_cli("--json", "sessions", str(repo)).stdout)["sessions"]
    forks = [x for x in listed if x["parent"]]
    assert [x["store"] for x in forks] == [f["store"] for f in result["forks"]]
    assert all(x["parent"] == {"store": str(parent.store), "checkpoint": result["checkpoint"]}
               for x in forks)
    table = run_cli("sessions", str(repo)).stdout
    assert "FORK OF" in table


def test_a_fork_of_a_session_mounted_in_place_is_refused(tmp_path: Path, repo: Path,
                                                         torn_down) -> None:
    store = tmp_path / "store-inplace"
    torn_down(repo, store)
    run_cli("mount", str(repo), "--store", str(store))
    mnt = tmp_path / "mnt-fork"
    mnt.mkdir()
    proc = run_cli("--mount", str(repo), "fork", str(mnt), check=False)
    assert proc.returncode == 1 and "mounted in place" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert os.listdir(mnt) == []
    run_cli("unmount", str(repo), "--no-apply")


def test_bad_fork_input_gets_one_line_and_changes_nothing(tmp_path: Path, repo: Path,
                                                          mount_factory) -> None:
    parent = mount_factory(repo)
    (parent.mnt / "x.txt").write_text("x\n")
    before = parent.cli("--json", "log", "--all").stdout
    store = tmp_path / "store-bad"
    (tmp_path / "fmnt").mkdir()
    for args, says in (
            (["fork", str(tmp_path / "nowhere"), "--fork-store", str(store)], "not a directory"),
            (["fork", "999", str(tmp_path / "fmnt"), "--fork-store", str(store)], "unknown checkpoint"),
            # a mountpoint above the repo and the stores: the fork's daemon would read
            # them through its own mount
            (["fork", str(tmp_path), "--fork-store", str(store)], "inside the mountpoint"),
            (["fork", str(repo), "--fork-store", str(store)], "beside the repo")):
        proc = parent.cli(*args, check=False)
        assert proc.returncode == 1 and says in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    usage = parent.cli("fork", "1", "2", "3", check=False)
    assert usage.returncode == 2 and "unrecognized arguments" in usage.stderr
    assert not store.exists()
    assert parent.cli("--json", "log", "--all").stdout == before
    other = tmp_path / "other"
    other.mkdir()
    o = mount_factory(other, name="other")
    proc = run_cli("diff", f"{parent.store}:", f"{o.store}:", check=False)
    assert proc.returncode == 1 and "not sessions of one repo" in proc.stderr
    # one session's two states through the same syntax: its own diff
    same = run_cli("diff", "--stat", f"{parent.store}:0", f"{parent.store}:").stdout
    assert "x.txt" in same


def test_the_default_session_is_the_newest_that_is_not_a_fork(tmp_path: Path, monkeypatch) -> None:
    from overlayckpt.cli.sessions import numbered, store_for
    from overlayckpt.store.info import default_store_dir
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    repo = tmp_path / "r"
    repo.mkdir()
    base = default_store_dir(str(repo))
    for n, parent in ((1, None), (2, None), (3, base + ".2"), (4, base + ".3")):
        store = Path(base if n == 1 else f"{base}.{n}")
        store.mkdir(parents=True)
        for name in ("data.mdb", "lock.mdb"):
            (store / name).write_bytes(b"")
        (store / "session.json").write_text(json.dumps({"repo": str(repo), "parent": parent}))
    assert [n for n, _ in numbered(str(repo))] == [1, 2, 3, 4]
    assert store_for(str(repo), None, False) == base + ".2"  # (3 and 4 are forks)
    assert store_for(str(repo), None, True) == base + ".5"


def test_run_fork_of_a_command_that_cannot_start_leaves_no_mount(tmp_path: Path, repo: Path,
                                                                 mount_factory, monkeypatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    parent = mount_factory(repo)
    proc = run_cli("--mount", str(parent.mnt), "run", "--fork", "2", "--",
                   str(tmp_path / "no-such-command"), check=False)
    assert proc.returncode == 1 and "cannot run" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not [m for m in open("/proc/self/mounts").read().splitlines() if "overlayckpt-forks-" in m]
