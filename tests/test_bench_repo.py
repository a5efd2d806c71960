"""`overlayckpt bench REPO` (issue 33, point 3): it measures on the user's own repo and
leaves it as it was: REPO bit-identical (.git included), nothing mounted, nothing
beside REPO or in the temp dir, also when interrupted; its JSON has the documented
schema; bad input gets one line.

Real mounts, the real CLI as a subprocess, real git. The scratch session goes in a
TMPDIR of the test's own, so that what it leaves behind can be seen.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import CLI, make_repo, run_cli, tree_digest, wait_for
from overlayckpt.cli.bench import sample_files

SIX = ("native_p50_us", "mounted_p50_us", "ratio_p50", "native_p99_us", "mounted_p99_us",
       "ratio_p99")
WRITE_OPS = {"atomic_save", "edit", "append", "create", "delete", "rename"}


def git(cwd: Path, *args: str) -> None:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd))
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, timeout=120)


def git_repo(path: Path) -> Path:
    make_repo(path)
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "start")
    return path


def our_mounts() -> list[str]:
    """The overlayckpt mounts now (other tests may run beside: compare by place)."""
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2] == "fuse.overlayckpt"]


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> dict[str, str]:
    """The bench's TMPDIR: a directory of the test's, beside neither REPO nor anything."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return dict(os.environ, TMPDIR=str(tmp))


def bench(repo: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("bench", str(repo), "--seconds", "1", *extra, env=env)


def check_schema(doc: dict, git_ops: bool) -> None:
    ops = doc["ops"]
    assert WRITE_OPS <= set(ops)
    assert ({"git_status", "git_diff", "git_status_first"} <= set(ops)) == git_ops
    if not git_ops:
        assert not any(op.startswith("git") for op in ops)
    for op, o in ops.items():
        for key in SIX:
            assert isinstance(o[key], (int, float)) and o[key] > 0, (op, key, o)
        assert o["ratio_p50"] == pytest.approx(o["mounted_p50_us"] / o["native_p50_us"], rel=0.01)
        assert o["ratio_p99"] == pytest.approx(o["mounted_p99_us"] / o["native_p99_us"], rel=0.01)
        assert o["count"] >= 1
    assert doc["checkpoint"]["count"] == doc["rounds"] >= 1
    assert doc["restore"]["count"] == doc["rounds"]
    assert doc["restore"]["p50_ms"] > 0
    assert doc["store"]["bytes_written"] > 0
    assert isinstance(doc["store"]["bytes_per_mib_written"], int)
    assert doc["repo_untouched"] is True
    assert doc["daemon_log_problems"] == []


def test_bench_leaves_a_git_repo_bit_identical_and_nothing_behind(
        tmp_path: Path, tmpdir_env: dict[str, str]) -> None:
    repo = git_repo(tmp_path / "repo")
    before, beside = tree_digest(str(repo)), sorted(os.listdir(tmp_path))
    proc = bench(repo, tmpdir_env, "--json")
    doc = json.loads(proc.stdout)
    assert tree_digest(str(repo)) == before  # .git included: git never refreshed its index
    assert sorted(os.listdir(tmp_path)) == beside
    assert os.listdir(tmpdir_env["TMPDIR"]) == []
    assert not any(m.startswith(tmpdir_env["TMPDIR"] + "/") for m in our_mounts())
    check_schema(doc, git_ops=True)
    assert doc["files_sampled"] == doc["files_walked"] == 8  # (the symlink is no file)
    assert "Traceback" not in proc.stderr and "%" in proc.stderr  # progress only


def test_bench_on_a_repo_without_git_leaves_the_git_ops_out(
        tmp_path: Path, tmpdir_env: dict[str, str]) -> None:
    repo = make_repo(tmp_path / "repo")
    before = tree_digest(str(repo))
    doc = json.loads(bench(repo, tmpdir_env, "--json").stdout)
    check_schema(doc, git_ops=False)
    assert doc["git"] is False and doc["git_skipped"] == "not a git repository"
    assert tree_digest(str(repo)) == before
    assert os.listdir(tmpdir_env["TMPDIR"]) == []


def test_bench_prints_a_table(tmp_path: Path, tmpdir_env: dict[str, str]) -> None:
    repo = git_repo(tmp_path / "repo")
    out = bench(repo, tmpdir_env).stdout
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("operation"))
    assert header.split() == ["operation", "n", "native", "p50", "mounted", "p50", "ratio",
                              "native", "p99", "mounted", "p99", "ratio"]
    for op in sorted(WRITE_OPS) + ["git_status", "git_diff", "checkpoint", "restore"]:
        assert any(ln.split()[0] == op for ln in lines if ln.strip()), op
    assert "per MiB written" in out and "restore to the state at mount" in out


def test_bench_worktree_leaves_git_out(tmp_path: Path, tmpdir_env: dict[str, str]) -> None:
    """A .git file points outside REPO, where git in the mount would write: left out."""
    main = git_repo(tmp_path / "main")
    git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    before = tree_digest(str(main)), tree_digest(str(tmp_path / "wt"))
    doc = json.loads(bench(tmp_path / "wt", tmpdir_env, "--json").stdout)
    assert doc["git"] is False and "worktree" in doc["git_skipped"]
    assert (tree_digest(str(main)), tree_digest(str(tmp_path / "wt"))) == before


def test_bench_interrupted_unmounts_and_removes_its_scratch(
        tmp_path: Path, tmpdir_env: dict[str, str]) -> None:
    repo = git_repo(tmp_path / "repo")
    before = tree_digest(str(repo))
    scratch = Path(tmpdir_env["TMPDIR"])
    proc = subprocess.Popen(CLI + ["bench", str(repo), "--seconds", "120"], env=tmpdir_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(m.startswith(str(scratch)) for m in our_mounts()), "the scratch mount")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert not any(m.startswith(str(scratch)) for m in our_mounts())
    assert list(scratch.iterdir()) == []
    assert tree_digest(str(repo)) == before


def test_bench_sigterm_cleans_up_too(tmp_path: Path, tmpdir_env: dict[str, str]) -> None:
    repo = make_repo(tmp_path / "repo")
    scratch = Path(tmpdir_env["TMPDIR"])
    proc = subprocess.Popen(CLI + ["bench", str(repo), "--seconds", "120"], env=tmpdir_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(m.startswith(str(scratch)) for m in our_mounts()), "the scratch mount")
        proc.terminate()
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not any(m.startswith(str(scratch)) for m in our_mounts())
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("what, expect", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("empty", "nothing to measure"),
])
def test_bench_refuses_a_bad_repo_in_one_line(tmp_path: Path, tmpdir_env: dict[str, str],
                                              what: str, expect: str) -> None:
    target = tmp_path / what
    if what == "file":
        target.write_text("x\n")
    elif what == "empty":
        target.mkdir()
    proc = run_cli("bench", str(target), env=tmpdir_env, check=False)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and expect in proc.stderr, proc.stderr
    assert proc.stdout == "" and os.listdir(tmpdir_env["TMPDIR"]) == []


def test_bench_refuses_an_overlayckpt_mount(repo: Path, mount_factory,
                                            tmpdir_env: dict[str, str]) -> None:
    m = mount_factory(repo)
    proc = run_cli("bench", str(m.mnt), env=tmpdir_env, check=False)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "is an overlayckpt mount" in proc.stderr, proc.stderr
    proc = run_cli("bench", str(m.mnt / "src"), env=tmpdir_env, check=False)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "is inside the overlayckpt mount" in proc.stderr, proc.stderr


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf"])
def test_bench_refuses_bad_seconds(repo: Path, tmpdir_env: dict[str, str], seconds: str) -> None:
    proc = run_cli("bench", str(repo), "--seconds", seconds, env=tmpdir_env, check=False)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "--seconds" in proc.stderr


def test_bench_refuses_a_store_of_the_users(repo: Path, tmp_path: Path,
                                            tmpdir_env: dict[str, str]) -> None:
    proc = run_cli("--store", str(tmp_path / "s"), "bench", str(repo), env=tmpdir_env, check=False)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "scratch session" in proc.stderr and not (tmp_path / "s").exists()


def test_bench_refuses_a_tmpdir_inside_the_repo(repo: Path) -> None:
    inside = repo / "tmp"
    inside.mkdir()
    before = tree_digest(str(repo))
    proc = run_cli("bench", str(repo), env=dict(os.environ, TMPDIR=str(inside)), check=False)
    assert proc.returncode == 1 and "TMPDIR" in proc.stderr, proc.stderr
    assert tree_digest(str(repo)) == before


# -- sampling, in process -------------------------------------------------------------

def test_sampling_is_deterministic_skips_git_and_respects_the_limit(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for d in range(20):
        (repo / f"d{d:02}").mkdir(parents=True)
        for f in range(30):
            (repo / f"d{d:02}" / f"f{f:02}.txt").write_text(f"{d} {f}\n")
    (repo / ".git").mkdir()
    (repo / ".git" / "config").write_text("x")
    (repo / "huge.bin").write_bytes(b"\0" * (2 << 20))
    first = sample_files(str(repo), limit=50)
    assert first.files == sample_files(str(repo), limit=50).files
    assert len(first.files) == 50 and first.walked == 20 * 30 + 1 and first.complete
    assert not any(p.startswith(".git") or p == "huge.bin" for p in first.files)
    assert len({p.split("/")[0] for p in first.files}) > 5  # spread over the tree
    assert sample_files(str(repo), limit=50, seed=1).files != first.files
