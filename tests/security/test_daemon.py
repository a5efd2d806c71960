"""The daemon and its store against hostile or careless input (issue 32, points 4 to 7).

- Nothing the agent writes to ctl, and no store or mountpoint given to mount, run or
  fork, makes the daemon reach a path through its own mount (it would wait on itself,
  and every process using the mount with it): each is refused with one line, within a
  bounded time, and the mount still answers afterwards.
- `--store` never takes a directory of the user's; `drop` deletes a store's files only.
- Store files are 0600 in 0700 directories whatever the umask; the control files of an
  --allow-other mount are the mounting user's only.
- A sandboxed agent (run --private) cannot apply, change the apply setting, fork,
  export or gc through ctl; the repo is unchanged.

Every probe that could hang on a mount runs in a subprocess with a timeout; a mount
that hung is aborted (umount -f) before the test fails, so a regression fails fast.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, Mount, force_unmount, is_mounted, make_repo, run_cli, stop_daemon
from helpers_users import User
from security.conftest import assert_one_line, surroundings

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts, bind mounts and a second user need root")

PROBE_TIMEOUT = 30  # seconds: a refusal is immediate; a deadlock is forever


class Hung(AssertionError):
    pass


def abort(mnt: Path) -> None:
    """Free a mount whose daemon waits on itself (only umount -f does), then unmount."""
    subprocess.run(["umount", "-f", str(mnt)], capture_output=True, timeout=30)
    force_unmount(str(mnt))


def bounded(argv: list[str], mnt: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    """argv in a subprocess that must end within PROBE_TIMEOUT; if it does not, the mount
    is aborted and the test fails."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # type: ignore[call-overload]  # **kw: no overload is picked
    try:
        out, err = proc.communicate(timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        # (a process waiting on a hung FUSE request cannot be killed: abort the mount first)
        abort(mnt)
        proc.kill()
        proc.communicate(timeout=PROBE_TIMEOUT)
        raise Hung(f"{argv[:6]} did not end within {PROBE_TIMEOUT} s: the mount hung") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def cli(mnt: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return bounded(CLI + list(args), mnt)


def answers(mnt: Path) -> None:
    """The mount still answers: a stat of its root and of its control files."""
    proc = bounded(["stat", "-c", "%n", str(mnt), str(mnt / ".overlayckpt" / "status.json")], mnt)
    assert proc.returncode == 0, proc.stderr


_CTL = ("import json, sys\n"
        "with open(sys.argv[1], 'r+b', buffering=0) as f:\n"
        "    try:\n"
        "        f.write((sys.argv[2] + '\\n').encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "    print(f.read().decode().strip().splitlines()[-1])\n")


def ctl_line(mnt: Path, cmd: dict) -> dict:
    """One ctl line written by another process (the agent), bounded; its reply."""
    proc = bounded([sys.executable, "-c", _CTL, str(mnt / ".overlayckpt" / "ctl"), json.dumps(cmd)],
                   mnt)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_refused(reply: dict, *words: str) -> None:
    assert reply["ok"] is False, reply
    assert "\n" not in reply["error"] and "Traceback" not in reply["error"], reply
    for w in words:
        assert w in reply["error"], (w, reply)


# -- point 4: the daemon never reaches through its own mount -------------------------

def test_ctl_paths_into_the_mount_or_repo_are_refused(mounted: Mount, tmp_path: Path) -> None:
    mnt, repo = mounted.mnt, mounted.repo
    (tmp_path / "to-mnt").symlink_to(mnt)
    bind = tmp_path / "bind"
    bind.mkdir()
    subprocess.run(["mount", "--bind", str(mnt / "src"), str(bind)], check=True, timeout=30)
    try:
        hostile = [
            {"cmd": "fork", "store": f"{mnt}/inside"},
            {"cmd": "fork", "store": f"{tmp_path}/outside/../mnt/inside"},
            {"cmd": "fork", "store": f"{tmp_path}/to-mnt/inside"},  # a symlink into the mount
            {"cmd": "fork", "store": f"{bind}/inside"},  # a bind mount of part of it
            {"cmd": "fork", "store": f"{repo}/inside"},
            {"cmd": "unfork", "store": f"{mnt}/inside"},
            {"cmd": "unfork", "store": f"{tmp_path}/to-mnt/x"},
            {"cmd": "export_bundle", "path": f"{mnt}/b.ocb"},
            {"cmd": "export_bundle", "path": f"{bind}/b.ocb"},
            {"cmd": "export_bundle", "path": f"{repo}/b.ocb"},
        ]
        before = surroundings(tmp_path, mounted.store, mnt, bind)
        for cmd in hostile:
            assert_refused(ctl_line(mnt, cmd), "inside")
            answers(mnt)
        assert_refused(ctl_line(mnt, {"cmd": "fork", "store": "relative/x"}), "absolute")
        assert surroundings(tmp_path, mounted.store, mnt, bind) == before
        assert mounted.ctl_ok({"cmd": "forks"})["forks"] == {}  # none recorded half way
        # a path outside both still works
        assert mounted.ctl_ok({"cmd": "export_bundle", "path": f"{tmp_path}/ok.ocb"})
    finally:
        subprocess.run(["umount", "-l", str(bind)], capture_output=True, timeout=30)


def test_a_git_dir_leading_into_the_mount_is_refused(mounted: Mount) -> None:
    # the repo has no .git; one made behind the mount as a symlink into the mount itself
    os.symlink(mounted.mnt / "src", mounted.repo / ".git")
    try:
        assert_refused(ctl_line(mounted.mnt, {"cmd": "export_git"}), ".git", "mount")
        answers(mounted.mnt)
    finally:
        os.unlink(mounted.repo / ".git")


def test_a_transcript_path_into_the_mount_does_not_hang_restore(mounted: Mount) -> None:
    mnt = mounted.mnt
    (mnt / "src" / "t.jsonl").write_text('{"type": "user", "timestamp": "2020-01-01T00:00:00Z"}\n')
    line = {"role": "tool", "content": "x", "agent": "claude-code",
            "transcript_path": f"{mnt}/src/t.jsonl"}
    proc = bounded(["sh", "-c", f"printf '%s\\n' '{json.dumps(line)}' >> "
                                f"{mnt}/.overlayckpt/conversation.jsonl"], mnt)
    assert proc.returncode == 0, proc.stderr
    cid = mounted.ctl_ok({"cmd": "checkpoint", "name": "t"})["id"]
    reply = ctl_line(mnt, {"cmd": "restore", "id": cid, "what": "both"})
    assert "error" not in reply or "\n" not in reply["error"], reply
    answers(mnt)


def test_mountpoint_inside_the_repo_is_refused(repo: Path, tmp_path: Path) -> None:
    (repo / "inner").mkdir()
    before = surroundings(tmp_path)
    try:
        proc = cli(repo / "inner", "mount", str(repo), str(repo / "inner"), "--new")
        assert_one_line(proc, "inside the repo")
        assert not is_mounted(str(repo / "inner"))
        assert bounded(["ls", str(repo / "inner")], repo / "inner").returncode == 0
    finally:
        abort(repo / "inner")
    assert surroundings(tmp_path) == before


def test_a_repo_under_its_mountpoint_is_refused(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "top" / "repo")
    proc = cli(tmp_path / "top", "mount", str(repo), str(tmp_path / "top"), "--store",
               str(tmp_path / "s"))
    assert_one_line(proc, "inside the mountpoint")
    assert not is_mounted(str(tmp_path / "top")) and not (tmp_path / "s").exists()


@pytest.mark.parametrize("how", ["mount", "run", "symlink"])
def test_store_inside_the_repo_is_refused(repo: Path, tmp_path: Path, how: str) -> None:
    store = repo / ".ckpt"
    if how == "symlink":  # a path outside that leads into the repo
        (tmp_path / "link").symlink_to(repo)
        store = tmp_path / "link" / ".ckpt"
    before = surroundings(tmp_path)
    try:
        if how == "run":
            proc = cli(repo, "run", "--store", str(store), "--repo", str(repo), "--", "true")
        else:
            proc = cli(repo, "mount", "--store", str(store), str(repo))
        assert_one_line(proc, "inside the repo")
        assert not is_mounted(str(repo))
    finally:
        abort(repo)
    assert surroundings(tmp_path) == before


def test_fork_from_the_cli_into_the_mount_is_refused(mounted: Mount, tmp_path: Path) -> None:
    mnt = mounted.mnt
    (tmp_path / "fmnt").mkdir()
    before = surroundings(tmp_path, mounted.store, mnt)
    cases = [
        (["fork", str(tmp_path / "fmnt"), "--fork-store", f"{mnt}/inside"], "inside the parent's mount"),
        (["fork", str(tmp_path / "fmnt"), "--fork-store", f"{mounted.repo}/inside"], "inside the repo"),
        (["fork", f"{mnt}/src"], "inside the parent's mount"),
        (["fork", str(mounted.repo / "src")], "inside the repo"),
    ]
    for args, words in cases:
        assert_one_line(cli(mnt, "--mount", str(mnt), *args), words)
        answers(mnt)
    assert surroundings(tmp_path, mounted.store, mnt) == before
    assert mounted.ctl_ok({"cmd": "forks"})["forks"] == {}


# -- point 5: --store never takes the user's directory; drop deletes only a store ------

def test_store_on_a_directory_of_the_users_is_refused(repo: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "important").mkdir(parents=True)
    (mine / "important" / "thesis.txt").write_text("years of work\n")
    (tmp_path / "mnt").mkdir()
    before = surroundings(tmp_path)
    for args in (["mount", str(repo), str(tmp_path / "mnt"), "--store", str(mine)],
                 ["run", "--store", str(mine), "--repo", str(repo), "--", "true"]):
        try:
            assert_one_line(cli(tmp_path / "mnt", *args), "not an overlayckpt store", "important")
        finally:
            abort(tmp_path / "mnt")
            abort(repo)
    assert surroundings(tmp_path) == before
    # drop refuses it too, whatever it holds
    assert_one_line(run_cli("drop", str(mine), check=False), "not an overlayckpt session store")
    assert surroundings(tmp_path) == before


def test_drop_deletes_only_the_stores_own_files(repo: Path, tmp_path: Path, mount_factory) -> None:
    m = mount_factory(repo)
    (m.mnt / "new.txt").write_text("x\n")
    m.ctl_ok({"cmd": "checkpoint", "name": "one"})
    run_cli("unmount", str(m.mnt))
    stop_daemon(m.store)
    (m.store / "important").mkdir()
    (m.store / "important" / "thesis.txt").write_text("years of work\n")
    (m.store / "notes.txt").write_text("mine\n")
    proc = run_cli("--json", "drop", str(m.store))
    assert json.loads(proc.stdout)["kept"] == ["important", "notes.txt"]
    assert sorted(os.listdir(m.store)) == ["important", "notes.txt"]
    assert (m.store / "important" / "thesis.txt").read_text() == "years of work\n"
    # a store directory holding nothing else goes entirely
    m2 = mount_factory(repo, name="mnt2")
    run_cli("unmount", str(m2.mnt))
    stop_daemon(m2.store)
    run_cli("drop", str(m2.store))
    assert not m2.store.exists()


# -- point 6: modes ----------------------------------------------------------------

def _umask0(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["sh", "-c", 'umask 000 && exec "$@"', "-", *CLI, *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def _modes(store: Path) -> dict[str, str]:
    """Every entry of a store that is not 0600 (files) or 0700 (the directory)."""
    bad = {}
    st = os.stat(store)
    if stat.S_IMODE(st.st_mode) != 0o700:
        bad[str(store)] = oct(stat.S_IMODE(st.st_mode))
    for p in store.iterdir():
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        if mode != 0o600:
            bad[str(p)] = oct(mode)
    return bad


def test_store_files_are_private_whatever_the_umask(repo: Path, tmp_path: Path, torn_down) -> None:
    store, fork_store, mnt, fmnt = (tmp_path / n for n in ("store", "forks/f1", "mnt", "fmnt"))
    store.mkdir(mode=0o755)  # made beforehand, as the README's CI example does
    os.chmod(store, 0o755)
    mnt.mkdir()
    fmnt.mkdir()
    torn_down(mnt, store)
    torn_down(fmnt, fork_store)
    try:
        _umask0("mount", str(repo), str(mnt), "--store", str(store))
        (mnt / "secret.key").write_text("hunter2\n")
        os.chmod(mnt / "secret.key", 0o600)
        _umask0("--mount", str(mnt), "checkpoint", "k")
        (mnt / ".overlayckpt" / "conversation.jsonl").write_text('{"role": "user", "content": "pw"}\n')
        _umask0("--mount", str(mnt), "fork", str(fmnt), "--fork-store", str(fork_store))
        _umask0("unmount", str(fmnt))
        _umask0("unmount", str(mnt), "--no-apply")
    finally:
        force_unmount(str(fmnt))
        force_unmount(str(mnt))
    assert stop_daemon(store) is None and stop_daemon(fork_store) is None
    assert {"data.mdb", "lock.mdb", "session.json", "daemon.log"} <= set(os.listdir(store))
    assert _modes(store) == {} and _modes(fork_store) == {}
    assert stat.S_IMODE(os.stat(fork_store.parent).st_mode) == 0o700  # (made for it)
    # recover's new store and the damaged copy it keeps
    _umask0("--store", str(store), "recover")
    (kept,) = tmp_path.glob("store.damaged-*")
    assert _modes(store) == {} and _modes(kept) == {}


def test_the_daemon_imports_nothing_from_where_mount_ran(repo: Path, tmp_path: Path,
                                                        torn_down) -> None:
    """The daemon is forked from the mount's CLI: what it imports afterwards (pyfuse3,
    trio) must not come from the directory the CLI was started in (`python -m` puts it
    first on sys.path), which may be a repo from anyone."""
    here, store, mnt = tmp_path / "here", tmp_path / "store", tmp_path / "mnt"
    here.mkdir()
    mnt.mkdir()
    marker = tmp_path / "ran"
    for module in ("pyfuse3", "trio"):
        (here / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write('{module}')\n"
                                           "raise SystemExit(3)\n")
    torn_down(mnt, store)
    run_cli("mount", str(repo), str(mnt), "--store", str(store), cwd=str(here))
    try:
        assert (mnt / "README.md").read_text() == (repo / "README.md").read_text()
    finally:
        run_cli("unmount", str(mnt), "--no-apply")
    assert not marker.exists(), marker.read_text()


def test_the_default_store_and_its_parents_are_private(repo: Path, tmp_path: Path,
                                                      torn_down) -> None:
    data = tmp_path / "data"  # XDG_DATA_HOME, missing: the run makes it
    env = dict(os.environ, XDG_DATA_HOME=str(data))
    torn_down(repo, data)
    proc = subprocess.run(["sh", "-c", 'umask 000 && exec "$@"', "-", *CLI, "run", "--no-apply",
                           "--repo", str(repo), "--", "sh", "-c", "echo x > new.txt"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    (store,) = (data / "overlayckpt").iterdir()
    assert stop_daemon(store) is None
    for d in (data, data / "overlayckpt"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert _modes(store) == {}


def test_other_users_cannot_read_the_control_files(user: User, tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="ctl-", dir=user.home))  # a place the user can reach
    os.chmod(base, 0o755)
    repo, mnt, store = make_repo(base / "repo"), base / "mnt", tmp_path / "store"
    mnt.mkdir()
    try:
        run_cli("mount", str(repo), str(mnt), "--store", str(store), "--allow-other")
        with open(mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
            f.write(json.dumps({"role": "user", "content": "my password is hunter2"}) + "\n")
        assert user.run("cat", str(mnt / "README.md")).returncode == 0  # the mount is shared
        for name in ("conversation.jsonl", "status.json", "ctl"):
            path = mnt / ".overlayckpt" / name
            proc = user.run("cat", str(path))
            assert proc.returncode != 0 and "hunter2" not in proc.stdout, (name, proc.stdout)
            st = os.stat(path)
            assert st.st_uid == os.getuid() and not stat.S_IMODE(st.st_mode) & 0o077, (name, oct(st.st_mode))
        proc = user.run("sh", "-c", f"echo '{{\"cmd\": \"apply\"}}' > {mnt}/.overlayckpt/ctl")
        assert proc.returncode != 0
    finally:
        force_unmount(str(mnt))
        problem = stop_daemon(store)
        import shutil
        shutil.rmtree(base, ignore_errors=True)
    assert problem is None


# -- point 7: a sandboxed agent cannot reach outside -----------------------------------

AGENT = r"""
echo evil > evil.txt
for c in "$@"; do
  exec 3<>.overlayckpt/ctl
  printf '%s\n' "$c" >&3 2>/dev/null
  head -n1 <&3 >> "$OUT"
  exec 3<&-
done
overlayckpt_apply() { "$PY" -m overlayckpt apply --force 2>> "$OUT.cli"; }
overlayckpt_apply
exit 0
"""


def test_a_private_run_refuses_its_agent_what_reaches_outside(repo: Path, tmp_path: Path,
                                                              torn_down) -> None:
    store, out = tmp_path / "store", tmp_path / "replies"
    torn_down(repo, store)
    outside: list[dict[str, Any]] = [
        {"cmd": "apply", "force": True},
        {"cmd": "apply", "checkpoint": 0, "force": True},
        {"cmd": "set_apply", "apply": True},
        {"cmd": "fork", "store": str(tmp_path / "fork")},
        {"cmd": "unfork", "store": str(tmp_path / "fork")},
        {"cmd": "export_bundle", "path": str(tmp_path / "b.ocb")},
        {"cmd": "export_git"},
        {"cmd": "gc"},
    ]
    inside = [{"cmd": "checkpoint", "name": "mine"}, {"cmd": "restore", "id": "mine", "what": "code"}]
    lines = [json.dumps(c) for c in outside + inside]
    before = surroundings(tmp_path, store, out, Path(str(out) + ".cli"))
    env = dict(os.environ, OUT=str(out), PY=sys.executable,
               PYTHONPATH=os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[2])))
    proc = subprocess.run([*CLI, "run", "--private", "--no-apply", "--store", str(store), "--repo",
                           str(repo), "--", "sh", "-c", AGENT, "agent", *lines],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    replies = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(replies) == len(lines), replies
    for cmd, reply in zip(outside, replies):
        assert_refused(reply, cmd["cmd"], "sandboxed")
    assert all(r["ok"] for r in replies[len(outside):]), replies
    cli_err = Path(str(out) + ".cli").read_text().strip()
    assert "\n" not in cli_err and "sandboxed" in cli_err, cli_err
    assert not is_mounted(str(repo))
    assert surroundings(tmp_path, store, out, Path(str(out) + ".cli")) == before  # repo too
    # the session kept what the agent did, for its user to apply
    log = json.loads(run_cli("--store", str(store), "--json", "log").stdout)
    assert any(c["name"] == "mine" for c in log["checkpoints"])
