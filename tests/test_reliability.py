"""Reliability: kill -9 of the daemon, full disk, hostile input, concurrency.

Every test mounts for real (the CLI's `mount`, a detached daemon) and waits on
conditions, never on a fixed sleep: a kill point is "after N fsync-acknowledged
writes", a stale mount is "stat says ENOTCONN", a restore is over when its reply
arrives. The long versions live in test_stress.py (`make stress`) and reuse the
harness below. Apply's own tests (section 5) need no mount: a real Session over
tmp_path, as the offline commands open it.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    CLI,
    Mount,
    daemon_pid,
    force_unmount,
    is_mounted,
    make_repo,
    proc_alive,
    run_cli,
    tree_digest,
    wait_for,
)

DEADLINE = 60.0  # seconds for any single condition to become true


# -- harness ------------------------------------------------------------------

def stale(path: Path) -> bool:
    """The daemon is gone. stat of the mount root itself may still answer from the
    kernel's attribute cache (one hour), so ask for something never cached."""
    try:
        os.stat(path / ".overlayckpt" / "status.json")
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def mount_count(path: Path) -> int:
    with open("/proc/self/mounts") as f:
        return sum(1 for line in f if line.split()[1] == str(path))


def kill_daemon(m: Mount) -> None:
    """kill -9 the daemon, then wait until the kernel reports the mount as stale."""
    pid = daemon_pid(m.store)
    assert pid and proc_alive(pid), "no live daemon to kill"
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not proc_alive(pid), f"daemon {pid} to die")
    wait_for(lambda: stale(m.mnt), "the mount to go stale")


def cleanup_mount(m: Mount) -> None:
    """Unmount (lazily if stale) and make sure the daemon this test started is gone."""
    force_unmount(str(m.mnt))
    pid = daemon_pid(m.store)
    if pid and proc_alive(pid):
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not proc_alive(pid), "daemon exit after unmount", timeout=30)
        if proc_alive(pid):  # a daemon we started that hangs: ours to end
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not proc_alive(pid), "daemon to die")
    force_unmount(str(m.mnt))


def mount(repo: Path, mnt: Path, store: Path, *extra: str) -> Mount:
    with contextlib.suppress(FileExistsError):  # (is_dir() would fail on a stale mount)
        mnt.mkdir()
    run_cli("mount", str(repo), str(mnt), "--store", str(store), *extra)
    return Mount(repo, mnt, store)


@contextlib.contextmanager
def session(tmp: Path, repo: Path, *extra: str, name: str = "mnt") -> Iterator[Mount]:
    m = Mount(repo, tmp / name, tmp / f"store-{name}")
    try:
        yield mount(repo, m.mnt, m.store, *extra)
    finally:
        cleanup_mount(m)


def ctl_raw(m: Mount, payload: bytes) -> tuple[OSError | None, list[dict]]:
    """Write raw bytes to ctl on one handle; return the write's error and every reply."""
    fd = os.open(m.mnt / ".overlayckpt" / "ctl", os.O_RDWR)
    err: OSError | None = None
    try:
        view = memoryview(payload)
        while view:
            try:
                n = os.write(fd, view)  # a partial write is continued, as writers do
            except OSError as e:
                err = e
                break
            view = view[n:]
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    text = b"".join(chunks).decode()
    return err, [json.loads(line) for line in text.splitlines() if line.strip()]


def log_of(m: Mount) -> list[dict]:
    return m.ctl({"cmd": "log"})["checkpoints"]


def fsck_clean(args: list[str]) -> None:
    """fsck of a mounted session (["--mount", M], through ctl) or an unmounted one (CLI)."""
    if args[0] == "--mount":
        reply = Mount(Path(), Path(args[1]), Path()).ctl({"cmd": "fsck"})
        assert reply.get("problems") == [], reply
        return
    proc = run_cli(*args, "fsck", "--json", check=False)
    assert proc.returncode == 0, f"fsck failed:\n{proc.stdout}{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["clean"] and not report["problems"], report


def assert_one_line_error(proc: subprocess.CompletedProcess[str], code: int = 1) -> None:
    where = f"exit {proc.returncode}, stdout {proc.stdout!r}, stderr {proc.stderr!r}"
    assert proc.returncode == code, where
    assert "Traceback" not in proc.stderr, where
    if code == 1:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("overlayckpt: "), where
    else:
        assert "usage:" in proc.stderr, where


def show_matches_tree(m: Mount, cid: int) -> None:
    """`show ID` works, and restoring ID gives exactly the tree `show` lists."""
    shown = json.loads(m.cli("--json", "show", "--all", str(cid)).stdout)  # (.git too)
    reply = m.ctl({"cmd": "restore", "id": cid, "what": "code"})
    assert reply.get("ok"), f"restore {cid}: {reply}"
    tree = tree_digest(str(m.mnt))
    listed = {f["path"]: f for f in shown["files"]}
    assert set(listed) == set(tree), (f"checkpoint {cid}: show and restored tree differ: "
                                      f"{sorted(set(listed) ^ set(tree))[:10]}")
    for path, f in listed.items():
        kind = tree[path][0]
        assert {"dir": "d", "symlink": "l", "file": "f"}[f["type"]] == kind, (cid, path)
        if kind == "f":
            assert f["size"] == tree[path][2], (cid, path, f, tree[path])
            assert stat.S_IMODE(f["mode"]) == tree[path][1], (cid, path)
    # and one file's content through show equals what the restored mount reads
    files = [p for p, f in listed.items() if f["type"] == "file"]
    if files:
        p = random.Random(cid).choice(files)
        data = subprocess.run(CLI + ["--mount", str(m.mnt), "show", str(cid), p],
                              capture_output=True, timeout=120).stdout
        assert data == (m.mnt / p).read_bytes(), (cid, p)


def verify_every_checkpoint(m: Mount, limit: int | None = None, seed: int = 0) -> int:
    """Restore every checkpoint (or a random sample of `limit`) and come back."""
    base = m.ctl({"cmd": "checkpoint", "name": f"verify-{time.monotonic_ns()}"})
    assert base.get("ok"), base
    before = tree_digest(str(m.mnt))
    ids = sorted(c["id"] for c in log_of(m))
    if limit is not None and len(ids) > limit:
        ids = sorted(random.Random(seed).sample(ids, limit))
    for cid in ids:
        show_matches_tree(m, cid)
    assert m.ctl({"cmd": "restore", "id": base["id"], "what": "code"}).get("ok")
    assert tree_digest(str(m.mnt)) == before
    return len(ids)


# -- 1. crash harness ----------------------------------------------------------

STORM = r'''
import hashlib, os, random, sys
root, seed, nops, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(seed)
storm = os.path.join(root, "storm", tag)
acked = os.path.join(root, "acked", tag)
os.makedirs(storm)
os.makedirs(acked)
files, dirs = [], [storm]

def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

say("READY")
for i in range(nops):
    op = rng.choices(["create", "overwrite", "append", "rename", "unlink", "mkdir", "mvdir", "ack"],
                     [3, 3, 3, 2, 1, 1, 1, 3])[0]
    if op in ("overwrite", "append", "rename", "unlink") and not files:
        op = "create"
    if op == "mvdir" and len(dirs) == 1:
        op = "mkdir"
    if op == "create":
        p = os.path.join(rng.choice(dirs), "f%d" % i)
        with open(p, "wb") as f:
            f.write(rng.randbytes(rng.randrange(0, 20000)))
        files.append(p)
    elif op == "overwrite":
        fd = os.open(rng.choice(files), os.O_WRONLY)
        os.pwrite(fd, rng.randbytes(rng.randrange(1, 9000)), rng.randrange(0, 20000))
        if rng.random() < 0.3:
            os.fsync(fd)
        os.close(fd)
    elif op == "append":
        with open(rng.choice(files), "ab") as f:
            f.write(b"appended %d\n" % i * rng.randrange(1, 400))
    elif op == "rename":
        j = rng.randrange(len(files))
        new = os.path.join(rng.choice(dirs), "r%d" % i)
        os.rename(files[j], new)
        files[j] = new
    elif op == "unlink":
        os.unlink(files.pop(rng.randrange(len(files))))
    elif op == "mkdir":
        d = os.path.join(rng.choice(dirs), "d%d" % i)
        os.mkdir(d)
        dirs.append(d)
    elif op == "mvdir":
        old = rng.choice(dirs[1:])
        new = os.path.join(os.path.dirname(old), "D%d" % i)
        os.rename(old, new)
        fix = lambda p: new + p[len(old):] if p == old or p.startswith(old + "/") else p
        files[:] = [fix(p) for p in files]
        dirs[:] = [fix(p) for p in dirs]
    elif op == "ack":
        data = rng.randbytes(rng.randrange(1, 30000))
        p = os.path.join(acked, "a%d" % i)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        say("ACK %s %s" % (os.path.relpath(p, root), hashlib.blake2b(data).hexdigest()))
say("DONE")
'''


def storm_until(m: Mount, seed: int, tag: str, kill_after: int, nops: int = 600) -> list[tuple[str, str]]:
    """Run a write storm in a child; kill -9 the daemon after `kill_after` fsync acks.

    Returns every (path, blake2b) the child saw acknowledged before it died."""
    child = subprocess.Popen([sys.executable, "-c", STORM, str(m.mnt), str(seed), str(nops), tag],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert child.stdout is not None  # (stdout=PIPE)
    acked: list[tuple[str, str]] = []
    killed = False
    buf = b""
    try:
        sel = selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + DEADLINE
        fd = child.stdout.fileno()
        while True:
            assert time.monotonic() < deadline, "the storm stalled"
            if not sel.select(timeout=1):
                continue
            chunk = os.read(fd, 65536)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                parts = line.decode().split()
                if parts[:1] == ["ACK"]:
                    acked.append((parts[1], parts[2]))
                if not killed and (len(acked) >= kill_after or parts[:1] == ["DONE"]):
                    kill_daemon(m)
                    killed = True
            if not chunk:
                break
        if not killed:  # the child died before the kill point: a bug in its own right
            raise AssertionError(f"storm child exited early with status {child.wait()}")
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
    return acked


def assert_acked_present(m: Mount, acked: list[tuple[str, str]]) -> None:
    lost = []
    for rel, digest in acked:
        try:
            data = (m.mnt / rel).read_bytes()
        except OSError as e:
            lost.append(f"{rel}: {e}")
            continue
        if hashlib.blake2b(data).hexdigest() != digest:
            lost.append(f"{rel}: content differs ({len(data)} bytes)")
    assert not lost, f"{len(lost)} of {len(acked)} fsync-acknowledged writes lost: {lost[:5]}"


def crash_rounds(tmp: Path, rounds: int, seed: int, verify_limit: int | None = None) -> dict[str, Any]:
    """The crash harness: `rounds` kill points in a write storm, each followed by a remount."""
    rng = random.Random(seed)
    repo = make_repo(tmp / "repo")
    repo_before = tree_digest(str(repo))
    m = Mount(repo, tmp / "mnt", tmp / "store")
    acked: list[tuple[str, str]] = []
    stats = {"kill_points": 0, "acked": 0}
    try:
        mount(repo, m.mnt, m.store)
        for r in range(rounds):
            kill_after = rng.randrange(1, 12)
            got = storm_until(m, rng.randrange(1 << 30), f"r{r}", kill_after)
            assert len(got) >= min(kill_after, 1)
            acked += got
            stats["kill_points"] += 1
            # the mount is stale; a command on it fails with one line (that it says
            # "stale" is test_stale_mount_is_reported_and_cleared's business)
            assert stale(m.mnt)
            assert_one_line_error(run_cli("--mount", str(m.mnt), "status", check=False))
            # mount again on the same store: clears the stale mount, resumes the session
            mount(repo, m.mnt, m.store)
            assert not stale(m.mnt)
            assert_acked_present(m, acked)
            fsck_clean(["--mount", str(m.mnt)])
            tree_digest(str(m.mnt))  # the whole tree is readable
        stats["acked"] = len(acked)
        stats["checkpoints_verified"] = verify_every_checkpoint(m, verify_limit, seed)
        assert_acked_present(m, acked)
        cleanup_mount(m)
        fsck_clean(["--store", str(m.store)])
        offline_log = json.loads(run_cli("--store", str(m.store), "--json", "log").stdout)
        assert offline_log["checkpoints"], "the session lost its timeline"
        assert tree_digest(str(repo)) == repo_before, "a separate mount changed the repo"
    finally:
        cleanup_mount(m)
    return stats


def test_crash_write_storm_quick(tmp_path: Path) -> None:
    stats = crash_rounds(tmp_path, rounds=4, seed=7)
    assert stats["kill_points"] == 4 and stats["acked"] >= 4


def big_change(m: Mount, files: int = 400, big_mib: int = 24) -> None:
    """Many entries and many blocks of change, so a restore or gc has real work."""
    d = m.mnt / "big"
    d.mkdir()
    for i in range(files):
        (d / f"f{i}").write_bytes(b"%d\n" % i * 50)
    block = os.urandom(1 << 20)
    with open(m.mnt / "big.bin", "wb") as f:
        for i in range(big_mib):
            f.write(block[i:] + block[:i])
        os.fsync(f.fileno())


def kill_during(m: Mount, cmd: dict, rng: random.Random, max_delay: float) -> dict | None:
    """Send cmd through ctl in a thread; kill -9 the daemon at a random point while it runs.

    Returns the command's reply if it finished before the kill, else None."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["reply"] = m.ctl(cmd)
        except (OSError, ValueError) as e:
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    # a random kill point, not a wait for something: the checks hold at every point
    time.sleep(rng.uniform(0, max_delay))
    kill_daemon(m)
    t.join(DEADLINE)
    assert not t.is_alive(), "the ctl client hung after the daemon died"
    return result.get("reply")


def test_crash_during_restore(tmp_path: Path, rounds: int = 2, seed: int = 11) -> None:
    rng = random.Random(seed)
    repo = make_repo(tmp_path / "repo")
    m = Mount(repo, tmp_path / "mnt", tmp_path / "store")
    try:
        mount(repo, m.mnt, m.store)
        small = m.ctl({"cmd": "checkpoint", "name": "small"})["id"]
        small_tree = tree_digest(str(m.mnt))
        big_change(m, files=150, big_mib=12)
        m.ctl({"cmd": "checkpoint", "name": "big"})
        big_tree = tree_digest(str(m.mnt))
        t0 = time.monotonic()
        assert m.ctl({"cmd": "restore", "id": small, "what": "code"})["ok"]
        restore_time = time.monotonic() - t0
        assert tree_digest(str(m.mnt)) == small_tree
        assert m.ctl({"cmd": "restore", "id": "big", "what": "code"})["ok"]
        outcomes = []
        for r in range(rounds):
            before = log_of(m)
            reply = kill_during(m, {"cmd": "restore", "id": small, "what": "code"}, rng,
                                restore_time * 1.5)
            mount(repo, m.mnt, m.store)
            tree = tree_digest(str(m.mnt))
            after = log_of(m)
            restored = len(after) > len(before) and after[0]["kind"] == "restore"
            outcomes.append("finished" if reply else "restored" if restored else "not restored")
            # one transaction: either the old state or the restored one, never a mix
            assert tree == (small_tree if restored else big_tree), f"round {r}: {outcomes[-1]}"
            if reply:
                assert restored
            fsck_clean(["--mount", str(m.mnt)])
            assert m.ctl({"cmd": "restore", "id": "big", "what": "code"})["ok"]
            assert tree_digest(str(m.mnt)) == big_tree
        verify_every_checkpoint(m, limit=6, seed=seed)
        print("kill during restore:", outcomes)
    finally:
        cleanup_mount(m)
    fsck_clean(["--store", str(m.store)])


def add_garbage_blocks(store: Path, n: int) -> None:
    """Unreferenced blocks, put straight into an unmounted store, for gc to reclaim."""
    from overlayckpt.store.lmdbstore import Store
    s = Store.open(str(store), create=False)
    try:
        rng = random.Random(n)
        s.write(lambda w: [w.put_block(rng.randbytes(s.block_size)) for _ in range(n)])
    finally:
        s.close()


def block_count(m: Mount) -> int:
    return m.ctl({"cmd": "status"})["blocks"]


def test_crash_during_gc(tmp_path: Path, rounds: int = 2, seed: int = 13) -> None:
    rng = random.Random(seed)
    repo = make_repo(tmp_path / "repo")
    m = Mount(repo, tmp_path / "mnt", tmp_path / "store")
    garbage = 4000
    try:
        mount(repo, m.mnt, m.store)
        big_change(m, files=50, big_mib=8)
        tree = tree_digest(str(m.mnt))
        cleanup_mount(m)
        add_garbage_blocks(m.store, garbage)
        mount(repo, m.mnt, m.store)
        t0 = time.monotonic()
        assert m.ctl({"cmd": "gc"})["removed_blocks"] == garbage
        gc_time = time.monotonic() - t0
        cleanup_mount(m)
        outcomes = []
        for r in range(rounds):
            add_garbage_blocks(m.store, garbage)
            mount(repo, m.mnt, m.store)
            full = block_count(m)
            reply = kill_during(m, {"cmd": "gc"}, rng, gc_time * 1.5)
            mount(repo, m.mnt, m.store)
            left = block_count(m)
            outcomes.append("finished" if reply else "collected" if left < full else "not collected")
            # gc is one transaction: all the garbage or none of it
            assert left in (full, full - garbage), (r, full, left)
            if reply:
                assert reply["ok"] and left == full - garbage
            assert tree_digest(str(m.mnt)) == tree
            fsck_clean(["--mount", str(m.mnt)])
            assert m.ctl({"cmd": "gc"})["ok"]
            assert block_count(m) == full - garbage
            cleanup_mount(m)
        print("kill during gc:", outcomes)
    finally:
        cleanup_mount(m)
    fsck_clean(["--store", str(m.store)])


def test_stale_mount_is_reported_and_cleared(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with session(tmp_path, repo) as m:
        (m.mnt / "new.txt").write_text("x")  # the root's attributes are now cached
        os.stat(m.mnt)
        kill_daemon(m)
        proc = run_cli("--mount", str(m.mnt), "status", check=False)
        assert_one_line_error(proc)
        mount(repo, m.mnt, m.store)
        assert (m.mnt / "new.txt").read_text() == "x"
        assert "stale" in proc.stderr, proc.stderr
        assert mount_count(m.mnt) == 1, "the stale mount is still there under the new one"


def test_cli_fsck_on_a_mount(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with session(tmp_path, repo) as m:
        proc = m.cli("fsck", check=False)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "clean" in proc.stdout


# -- 2. full disk ----------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "20m") -> Iterator[Path]:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
        if is_mounted(str(path)):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def write_file(path: Path, data: bytes) -> OSError | None:
    """Write and close a file in the mount; return the error, if any."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
    except OSError as e:
        return e
    return None


def fill_disk(m: Mount, rng: random.Random) -> tuple[dict[str, bytes], OSError]:
    """Write incompressible files into the mount until a write fails."""
    written: dict[str, bytes] = {}
    for i in range(200):  # 200 x 256 KiB is far beyond the 20 MiB tmpfs
        data = rng.randbytes(256 << 10)
        err = write_file(m.mnt / f"w{i}", data)
        if err is not None:
            return written, err
        written[f"w{i}"] = data
    raise AssertionError("the disk never filled")


def test_full_disk_damages_nothing_and_recovers(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with small_tmpfs(tmp_path / "disk") as disk:
        filler = disk / "filler"
        filler.write_bytes(b"\1" * (6 << 20))  # space to give back later
        m = Mount(repo, tmp_path / "mnt", disk / "store")
        try:
            mount(repo, m.mnt, m.store)
            rng = random.Random(5)
            written, err = fill_disk(m, rng)
            # ENOSPC is right; EIO is test_full_disk_gives_enospc's bug, tolerated here
            assert err.errno in (errno.ENOSPC, errno.EIO), f"a full disk gave {err!r}"
            assert written, "not even one file fit"
            daemon = daemon_pid(m.store)
            assert daemon is not None and proc_alive(daemon), "the daemon died on a full disk"
            # small operations on a full disk: each fails or works, the daemon lives
            last = sorted(written)[-1]
            for op in (lambda: (m.mnt / "small").write_text("s"), lambda: (m.mnt / "d").mkdir(),
                       lambda: os.rename(m.mnt / "w0", m.mnt / "w0-renamed"),
                       lambda: os.rename(m.mnt / "w0-renamed", m.mnt / "w0"),
                       lambda: os.unlink(m.mnt / last),  # (answered only where it can be stored)
                       lambda: m.ctl({"cmd": "checkpoint", "name": "while-full"})):
                try:
                    op()
                except OSError as e:
                    assert e.errno in (errno.ENOSPC, errno.EIO), f"{e!r} on a full disk"
            if not (m.mnt / last).exists():
                del written[last]
            daemon = daemon_pid(m.store)
            assert daemon is not None and proc_alive(daemon), "the daemon died on a full disk"
            # nothing already written is damaged
            for name, data in written.items():
                assert (m.mnt / name).read_bytes() == data, f"{name} damaged by the full disk"
            fsck_clean(["--mount", str(m.mnt)])
            # give space back: the session continues
            filler.unlink()
            more = rng.randbytes(1 << 20)
            assert write_file(m.mnt / "after", more) is None
            assert (m.mnt / "after").read_bytes() == more
            ck = m.ctl({"cmd": "checkpoint", "name": "after-full"})
            assert ck["ok"], ck
            for name, data in written.items():
                assert (m.mnt / name).read_bytes() == data
            fsck_clean(["--mount", str(m.mnt)])
            # and all of it survives an unmount and a remount
            cleanup_mount(m)
            fsck_clean(["--store", str(m.store)])
            mount(repo, m.mnt, m.store)
            assert (m.mnt / "after").read_bytes() == more
            assert all((m.mnt / n).read_bytes() == d for n, d in written.items())
            assert m.ctl({"cmd": "restore", "id": "after-full", "what": "code"})["ok"]
            assert (m.mnt / "after").read_bytes() == more
        finally:
            cleanup_mount(m)


def test_full_disk_gives_enospc(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with small_tmpfs(tmp_path / "disk") as disk:
        m = Mount(repo, tmp_path / "mnt", disk / "store")
        try:
            mount(repo, m.mnt, m.store)
            _, err = fill_disk(m, random.Random(6))
            assert err.errno == errno.ENOSPC, f"a full disk gave {err!r}, not ENOSPC"
        finally:
            cleanup_mount(m)


# -- 3. bad input everywhere -------------------------------------------------------

@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Iterator[Mount]:
    """One mounted session with history, shared by the bad-input tests (none may change it)."""
    tmp = tmp_path_factory.mktemp("hostile")
    repo = make_repo(tmp / "repo")
    (repo / "outdir").symlink_to("/etc")
    (repo / "outfile").symlink_to("/etc/passwd")
    m = Mount(repo, tmp / "mnt", tmp / "store")
    try:
        mount(repo, m.mnt, m.store)
        assert m.ctl({"cmd": "checkpoint", "name": "base"})["ok"]
        (m.mnt / "README.md").write_text("changed\n")
        (m.mnt / "added.txt").write_text("added\n")
        assert m.ctl({"cmd": "checkpoint", "name": "edited"})["ok"]
        with open(m.mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
            f.write(json.dumps({"role": "user", "content": "hello"}) + "\n")
        yield m
    finally:
        cleanup_mount(m)
    fsck_clean(["--store", str(m.store)])


def snapshot(m: Mount) -> tuple:
    log = [(c["id"], c["kind"], c["name"], c["seq"]) for c in log_of(m)]
    conv = (m.mnt / ".overlayckpt" / "conversation.jsonl").read_bytes()
    return tree_digest(str(m.mnt)), tree_digest(str(m.repo)), log, conv


@contextlib.contextmanager
def changes_nothing(m: Mount) -> Iterator[None]:
    before = snapshot(m)
    yield
    after = snapshot(m)
    for what, a, b in zip(("mount tree", "repo tree", "log", "conversation"), before, after):
        assert a == b, f"bad input changed the {what}"


BIG = 1 << 20
CTL_BAD = {
    "malformed": b'{"cmd": "checkpoint", \n',
    "array": b"[1, 2]\n",
    "string": b'"status"\n',
    "number": b"42\n",
    "null": b"null\n",
    "no-cmd": b'{"name": "x"}\n',
    "cmd-int": b'{"cmd": 5}\n',
    "cmd-null": b'{"cmd": null}\n',
    "unknown-cmd": b'{"cmd": "format-disk"}\n',
    "restore-id-list": b'{"cmd": "restore", "id": [1]}\n',
    "restore-id-float": b'{"cmd": "restore", "id": 1.5}\n',
    "restore-id-null": b'{"cmd": "restore", "id": null}\n',
    "restore-id-bool": b'{"cmd": "restore", "id": true}\n',
    "restore-id-object": b'{"cmd": "restore", "id": {"id": 1}}\n',
    "restore-id-negative": b'{"cmd": "restore", "id": -1}\n',
    "restore-id-huge": b'{"cmd": "restore", "id": 18446744073709551616}\n',
    "restore-id-unknown": b'{"cmd": "restore", "id": 999}\n',
    "restore-name-unknown": b'{"cmd": "restore", "id": "nosuch"}\n',
    "restore-no-id": b'{"cmd": "restore"}\n',
    "restore-what-bad": b'{"cmd": "restore", "id": 0, "what": "everything"}\n',
    "restore-what-int": b'{"cmd": "restore", "id": 0, "what": 7}\n',
    "restore-paths-string": b'{"cmd": "restore", "id": 0, "what": "code", "paths": "README.md"}\n',
    "restore-paths-ints": b'{"cmd": "restore", "id": 0, "what": "code", "paths": [1]}\n',
    "restore-paths-dotdot": b'{"cmd": "restore", "id": 0, "what": "code", "paths": ["../x"]}\n',
    "restore-paths-absolute": b'{"cmd": "restore", "id": 0, "what": "code", "paths": ["/etc/passwd"]}\n',
    "restore-paths-symlink-out": b'{"cmd": "restore", "id": 0, "what": "code", "paths": ["outdir/passwd"]}\n',
    "checkpoint-name-int": b'{"cmd": "checkpoint", "name": 5}\n',
    "checkpoint-name-slash": b'{"cmd": "checkpoint", "name": "a/b"}\n',
    "checkpoint-name-empty": b'{"cmd": "checkpoint", "name": ""}\n',
    "checkpoint-name-digits": b'{"cmd": "checkpoint", "name": "123"}\n',
    "checkpoint-name-at": b'{"cmd": "checkpoint", "name": "@x"}\n',
    "checkpoint-name-taken": b'{"cmd": "checkpoint", "name": "base"}\n',
    "checkpoint-message-list": b'{"cmd": "checkpoint", "message": [1]}\n',
    "log-limit-string": b'{"cmd": "log", "limit": "x"}\n',
    "log-limit-negative": b'{"cmd": "log", "limit": -1}\n',
    "log-file-int": b'{"cmd": "log", "file": 5}\n',
    "show-id-list": b'{"cmd": "show", "id": [1]}\n',
    "show-no-id": b'{"cmd": "show"}\n',
    "show-path-int": b'{"cmd": "show", "id": 0, "path": 5}\n',
    "show-path-dotdot": b'{"cmd": "show", "id": 0, "path": "../../etc/passwd"}\n',
    "show-path-symlink-out": b'{"cmd": "show", "id": 0, "path": "outdir/passwd"}\n',
    "show-path-nul": b'{"cmd": "show", "id": 0, "path": "src/a\\u0000b"}\n',
    "diff-a-list": b'{"cmd": "diff", "a": [1]}\n',
    "diff-b-unknown": b'{"cmd": "diff", "a": 0, "b": 999}\n',
    "diff-paths-dotdot": b'{"cmd": "diff", "paths": ["../x"]}\n',
    "conversation-at-list": b'{"cmd": "conversation", "at": [1]}\n',
    "conversation-at-unknown": b'{"cmd": "conversation", "at": 999}\n',
    "conversation-at-negative": b'{"cmd": "conversation", "at": -1}\n',
    "set-apply-string": b'{"cmd": "set_apply", "apply": "yes"}\n',
    "apply-checkpoint-list": b'{"cmd": "apply", "checkpoint": [1]}\n',
    "apply-checkpoint-unknown": b'{"cmd": "apply", "checkpoint": 999}\n',
    "binary": b"\xff\xfe\x00\x01\x80garbage\x00\n",
    "control-chars": b"\x1b[2J\x07\x00\n",
    "deep-nesting": b"[" * 200000 + b"\n",
    "huge-line": b'{"cmd": "checkpoint", "name": "huge", "message": "' + b"a" * (BIG + 4096) + b'"}\n',
    "huge-line-padded": b" " * (BIG + 200000) + b'{"cmd": "checkpoint", "name": "smuggled"}\n',
}


@pytest.mark.parametrize("case", list(CTL_BAD))
def test_bad_control_input(hostile: Mount, case: str) -> None:
    with changes_nothing(hostile):
        err, replies = ctl_raw(hostile, CTL_BAD[case])
        assert isinstance(err, OSError) and err.errno == errno.EINVAL, \
            f"the write gave {err!r}, not EINVAL (replies {str(replies)[:300]})"
        assert replies, "no reply says why"
        last = replies[-1]
        assert last["ok"] is False and isinstance(last.get("error"), str) and last["error"], last
        assert "\n" not in last["error"]
        assert all(not r["ok"] for r in replies), replies
    # the daemon is still fine
    assert hostile.ctl({"cmd": "status"})["ok"]


def test_control_channel_survives_a_bad_line(hostile: Mount) -> None:
    """A bad line and then a good one on the same handle: the good one still runs."""
    with changes_nothing(hostile):
        err, replies = ctl_raw(hostile, b"nonsense\n")
        assert err is not None and err.errno == errno.EINVAL
        fd = os.open(hostile.mnt / ".overlayckpt" / "ctl", os.O_RDWR)
        try:
            with pytest.raises(OSError) as e:
                os.write(fd, b"garbage\n")
            assert e.value.errno == errno.EINVAL
            os.write(fd, b'{"cmd": "status"}\n')
            lines = os.read(fd, 1 << 20).decode().splitlines()
        finally:
            os.close(fd)
        assert [json.loads(x)["ok"] for x in lines] == [False, True]


CLI_BAD = [
    ["show", "999"], ["show", "nosuch"], ["show", "-1"],
    ["restore", "999"], ["restore", "nosuch"], ["restore", "@before-last"],
    ["diff", "999"], ["diff", "0", "999"], ["diff", "0", "1", "2"],
    ["conversation", "--at", "999"], ["apply", "--checkpoint", "999"],
    ["restore", "0", "--", "../x"], ["restore", "0", "--", "/etc/passwd"],
    ["restore", "0", "--", "src/../../x"], ["restore", "0", "--", "outdir/passwd"],
    ["restore", "0", "--", "nosuch/file"],
    ["diff", "0", "--", "../x"], ["diff", "0", "--", "/etc/passwd"],
    ["show", "0", "/etc/passwd"], ["show", "0", "../etc/passwd"], ["show", "0", "src/../../etc"],
    ["show", "0", "outdir/passwd"], ["show", "0", "nosuch"],
    ["checkpoint", "a/b"], ["checkpoint", "base"], ["checkpoint", "123"], ["checkpoint", "@x"],
    ["checkpoint", ""], ["log", "--limit", "-1"],
]


@pytest.mark.parametrize("args", CLI_BAD, ids=[" ".join(a) or "''" for a in CLI_BAD])
def test_bad_cli_arguments(hostile: Mount, args: list[str]) -> None:
    with changes_nothing(hostile):
        assert_one_line_error(hostile.cli(*args, check=False))


USAGE_BAD = [[], ["bogus"], ["log", "--limit", "x"], ["restore"], ["show"], ["mount"],
             ["restore", "1", "--code", "--both"], ["log", "--nope"], ["hook", "other-agent"],
             ["diff", "--stat", "--stat=3"]]


@pytest.mark.parametrize("args", USAGE_BAD, ids=[" ".join(a) or "no-args" for a in USAGE_BAD])
def test_usage_errors_exit_2(hostile: Mount, args: list[str]) -> None:
    with changes_nothing(hostile):
        assert_one_line_error(run_cli("--mount", str(hostile.mnt), *args, check=False), code=2)


def test_symlinks_pointing_out_are_never_followed(hostile: Mount) -> None:
    """show of a symlink gives its target string, never the file outside."""
    with changes_nothing(hostile):
        out = hostile.cli("show", "0", "outfile").stdout
        assert out == "/etc/passwd"
        assert os.readlink(hostile.mnt / "outfile") == "/etc/passwd"
        assert_one_line_error(hostile.cli("show", "0", "outdir/passwd", check=False))


def _unmounted_session(tmp: Path) -> Mount:
    repo = make_repo(tmp / "repo")
    m = Mount(repo, tmp / "mnt", tmp / "store")
    try:
        mount(repo, m.mnt, m.store)
        (m.mnt / "x.txt").write_text("x\n")
        assert m.ctl({"cmd": "checkpoint", "name": "one"})["ok"]
    finally:
        cleanup_mount(m)
    return m


def offline_snapshot(m: Mount) -> Any:
    return run_cli("--store", str(m.store), "--json", "log").stdout


@pytest.mark.parametrize("args", [["show", "999"], ["restore", "nosuch"], ["show", "0", "../x"],
                                  ["restore", "0", "--", "/etc/passwd"], ["checkpoint", "one"],
                                  ["diff", "0", "999"], ["conversation", "--at", "999"]],
                         ids=lambda a: " ".join(a))
def test_bad_cli_arguments_offline(tmp_path: Path, args: list[str]) -> None:
    m = _unmounted_session(tmp_path)
    before = offline_snapshot(m)
    assert_one_line_error(run_cli("--store", str(m.store), *args, check=False))
    assert offline_snapshot(m) == before


def test_store_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "store"
    for args in (["log"], ["fsck"], ["gc"], ["status"], ["show", "0"]):
        assert_one_line_error(run_cli("--store", str(missing), *args, check=False))
    assert not missing.exists() and not missing.parent.exists()


def test_store_not_a_store(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("not a store\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for store in (afile, empty):
        for args in (["log"], ["fsck"], ["gc"]):
            assert_one_line_error(run_cli("--store", str(store), *args, check=False))
    assert afile.read_text() == "not a store\n"
    assert list(empty.iterdir()) == [], "a failed command wrote into a directory that is no store"


def test_store_unwritable(tmp_path: Path) -> None:
    """chmod 000: root bypasses it, so run the CLI as nobody."""
    m = _unmounted_session(tmp_path)
    before = offline_snapshot(m)
    if not shutil.which("setpriv"):
        pytest.skip("no setpriv")
    os.chmod(m.store, 0o000)
    try:
        probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                sys.executable, "-c", "import overlayckpt.cli"],
                               capture_output=True, text=True, cwd="/")
        if probe.returncode != 0:
            pytest.skip(f"nobody cannot import overlayckpt here: {probe.stderr.strip()[-200:]}")
        for args in (["log"], ["fsck"], ["gc"]):
            proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
                                  + CLI + ["--store", str(m.store)] + args,
                                  capture_output=True, text=True, cwd="/", timeout=120)
            assert_one_line_error(proc)
    finally:
        os.chmod(m.store, 0o700)
    assert offline_snapshot(m) == before


def test_store_locked_by_another_daemon(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    with session(tmp_path, repo) as m:
        (m.mnt / "first.txt").write_text("first\n")
        before = snapshot(m)
        second = tmp_path / "mnt2"
        second.mkdir()
        proc = run_cli("mount", str(repo), str(second), "--store", str(m.store), check=False)
        assert_one_line_error(proc)
        assert not is_mounted(str(second)), "the refused mount was left mounted"
        # the same mountpoint again
        assert_one_line_error(run_cli("mount", str(repo), str(m.mnt), "--store", str(m.store),
                                      check=False))
        assert mount_count(m.mnt) == 1
        # the first mount still works and lost nothing
        assert snapshot(m) == before
        (m.mnt / "second.txt").write_text("still works\n")
        assert m.ctl({"cmd": "checkpoint"})["ok"]


def test_store_locked_without_session_info(tmp_path: Path) -> None:
    """Another process holds the store's lock, though session.json names no daemon."""
    import fcntl
    m = _unmounted_session(tmp_path)
    before = offline_snapshot(m)
    fd = os.open(m.store / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for args in (["log"], ["gc"], ["checkpoint", "locked"]):
            assert_one_line_error(run_cli("--store", str(m.store), *args, check=False))
        proc = run_cli("mount", str(m.repo), str(m.mnt), "--store", str(m.store), check=False)
        try:
            assert_one_line_error(proc)
            assert not is_mounted(str(m.mnt))
        finally:
            cleanup_mount(m)
    finally:
        os.close(fd)
    assert offline_snapshot(m) == before


def test_store_from_a_newer_format(tmp_path: Path) -> None:
    from overlayckpt.store.lmdbstore import Store
    m = _unmounted_session(tmp_path)
    s = Store.open(str(m.store))
    try:
        s.write(lambda w: w.set_meta_int(b"format", 99))
    finally:
        s.close()
    data = (m.store / "data.mdb").read_bytes()
    for args in (["log"], ["fsck"], ["gc"], ["show", "0"]):
        proc = run_cli("--store", str(m.store), *args, check=False)
        assert_one_line_error(proc)
        assert "format" in proc.stderr
    proc = run_cli("mount", str(m.repo), str(m.mnt), "--store", str(m.store), check=False)
    try:
        assert_one_line_error(proc)
        assert "format" in proc.stderr and "Traceback" not in proc.stderr
        assert not is_mounted(str(m.mnt))
    finally:
        cleanup_mount(m)
    assert (m.store / "data.mdb").read_bytes() == data, "a refused store was written"


def test_bad_repos_and_mountpoints(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    afile = tmp_path / "file"
    afile.write_text("x")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    store = tmp_path / "store"
    before = tree_digest(str(repo))
    cases = [
        [str(tmp_path / "missing"), str(mnt)],         # repo missing
        [str(afile), str(mnt)],                        # repo is a file
        [str(repo), str(tmp_path / "no-mnt")],         # mountpoint missing
        [str(repo), str(afile)],                       # mountpoint is a file
    ]
    try:
        for args in cases:
            proc = run_cli("mount", *args, "--store", str(store), check=False)
            assert_one_line_error(proc)
            assert not is_mounted(str(mnt)) and not is_mounted(str(repo))
        # a store that belongs to another repo
        other = make_repo(tmp_path / "other")
        with session(tmp_path, other, name="o") as m:
            pass
        proc = run_cli("mount", str(repo), str(mnt), "--store", str(m.store), check=False)
        assert_one_line_error(proc)
        assert not is_mounted(str(mnt))
    finally:
        force_unmount(str(mnt))
        force_unmount(str(repo))
    assert tree_digest(str(repo)) == before
    assert afile.read_text() == "x"


def test_repo_with_odd_entries(tmp_path: Path) -> None:
    """FIFOs, dangling and looping symlinks, an unreadable file: mount, list, leave untouched."""
    repo = make_repo(tmp_path / "repo")
    os.mkfifo(repo / "fifo")
    (repo / "dangling").symlink_to("nowhere")
    (repo / "loop").symlink_to("loop")
    (repo / "secret").write_text("s")
    os.chmod(repo / "secret", 0)
    before = tree_digest(str(repo))
    with session(tmp_path, repo) as m:
        assert tree_digest(str(m.mnt)) == before
        assert m.ctl({"cmd": "checkpoint", "name": "odd"})["ok"]
        shown = {f["path"] for f in json.loads(m.cli("--json", "show", "odd").stdout)["files"]}
        assert {"fifo", "dangling", "loop", "secret"} <= shown
    assert tree_digest(str(repo)) == before


# -- 4. concurrency -------------------------------------------------------------------

WORKER = r'''
import hashlib, os, random, sys
sys.path.insert(0, sys.argv[5])
from conftest import tree_digest
root, wid, nops, trace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "trace"
rng = random.Random(1000 + wid)
sub = os.path.join(root, "w%d" % wid)
shared = os.fd_open = os.open(os.path.join(root, "shared.log"), os.O_WRONLY | os.O_APPEND)
files, dirs, appends = [], [sub], 0

def digest():
    return hashlib.sha256(repr(sorted(tree_digest(sub).items())).encode()).hexdigest()

def listing():
    return [(p, v[2] if v[0] == "f" else v[0]) for p, v in sorted(tree_digest(sub).items())]

if trace:
    print(digest(), appends, repr(listing()).replace(" ", ""), flush=True)
for i in range(nops):
    # every step is exactly one mutating system call, so any checkpoint (taken
    # between two requests) shows each worker's subdir after some prefix of steps
    op = rng.choice(["create", "pwrite", "pwrite", "rename", "unlink", "mkdir", "truncate",
                     "append", "append", "read"])
    if op in ("pwrite", "rename", "unlink", "truncate", "read") and not files:
        op = "create"
    if op == "create":
        p = os.path.join(rng.choice(dirs), "f%d_%d" % (wid, i))
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        files.append(p)
    elif op == "pwrite":
        fd = os.open(rng.choice(files), os.O_WRONLY)
        # inside one 4 KiB page: a write across a page boundary may reach the daemon as two
        # requests, and a checkpoint between them is right to show the first half
        start = rng.randrange(0, 2048)
        os.pwrite(fd, ((b"%d-%d " % (wid, i)) * 900)[:rng.randrange(1, 2048)],
                  rng.randrange(0, 3) * 4096 + start)
        os.close(fd)
    elif op == "rename":
        j = rng.randrange(len(files))
        new = os.path.join(rng.choice(dirs), "r%d_%d" % (wid, i))
        os.rename(files[j], new)
        files[j] = new
    elif op == "unlink":
        os.unlink(files.pop(rng.randrange(len(files))))
    elif op == "mkdir":
        d = os.path.join(rng.choice(dirs), "d%d_%d" % (wid, i))
        os.mkdir(d)
        dirs.append(d)
    elif op == "truncate":
        os.truncate(rng.choice(files), rng.randrange(0, 12000))
    elif op == "append":
        rec = ("w%d %06d " % (wid, appends)).encode()
        os.write(shared, rec + b"." * (63 - len(rec)) + b"\n")
        appends += 1
    elif op == "read":
        with open(rng.choice(files), "rb") as f:
            f.read()
    if trace:
        print(digest(), appends, repr(listing()).replace(" ", ""), flush=True)
'''

TESTS_DIR = str(Path(__file__).parent)


def sub_digest(root: Path, wid: int) -> str:
    return hashlib.sha256(repr(sorted(tree_digest(str(root / f"w{wid}")).items())).encode()).hexdigest()


def shared_records(path: Path, workers: int) -> dict[int, int]:
    """Check shared.log holds whole 64-byte records, each writer's in order; count them."""
    data = path.read_bytes()
    assert len(data) % 64 == 0, f"a torn record in shared.log ({len(data)} bytes)"
    counts = dict.fromkeys(range(workers), 0)
    for k in range(0, len(data), 64):
        rec = data[k:k + 64]
        assert rec.endswith(b"\n"), f"torn record at {k}: {rec!r}"
        tag, n = rec.split()[:2]
        w = int(tag[1:])
        assert int(n) == counts[w], f"writer {w}: record {int(n)} where {counts[w]} was due"
        counts[w] += 1
    return counts


def run_workers(root: Path, workers: int, nops: int, trace: bool = False) -> list[list[tuple[str, int, str]]]:
    """Each worker's trace (trace: True): its subdir's digest, its appends so far and its
    listing after each step."""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(w), str(nops),
                               "trace" if trace else "run", TESTS_DIR],
                              stdout=subprocess.PIPE, text=True) for w in range(workers)]
    traces = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"worker failed with {p.returncode}"
        traces.append([(d, int(n), listing) for d, n, listing in (line.split() for line in out.splitlines())])
    return traces


class Checkpointer:
    """Takes named checkpoints through ctl, back to back, until stopped."""

    def __init__(self, m: Mount) -> None:
        self.m = m
        self.ids: list[int] = []
        self.errors: list[dict[str, Any] | str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                reply = self.m.ctl({"cmd": "checkpoint"})
                self.ids.append(reply["id"]) if reply.get("ok") else self.errors.append(reply)
            except Exception as e:  # reported by the test
                self.errors.append(repr(e))

    def __enter__(self) -> Checkpointer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(DEADLINE)


def test_concurrent_writers_renamers_readers(tmp_path: Path) -> None:
    workers, nops = 4, 200
    native = tmp_path / "native"
    native.mkdir()
    (native / "shared.log").write_bytes(b"")
    for w in range(workers):
        (native / f"w{w}").mkdir()
    # the native run, serial, with each worker's state after every step
    traces = run_workers(native, workers, nops, trace=True)
    allowed = [{t[:2] for t in trace} for trace in traces]
    repo = make_repo(tmp_path / "repo")
    with session(tmp_path, repo) as m:
        (m.mnt / "shared.log").write_bytes(b"")
        for w in range(workers):
            (m.mnt / f"w{w}").mkdir()
        with Checkpointer(m) as cp:
            run_workers(m.mnt, workers, nops)
        assert not cp.errors, cp.errors[:3]
        assert cp.ids, "no checkpoint was taken while the workers ran"
        final = {w: sub_digest(m.mnt, w) for w in range(workers)}
        # the same result as the native directory
        for w in range(workers):
            assert final[w] == sub_digest(native, w), f"worker {w}'s subdir differs from native"
        assert shared_records(m.mnt / "shared.log", workers) == shared_records(native / "shared.log", workers)
        fsck_clean(["--mount", str(m.mnt)])
        # every checkpoint taken meanwhile restores to a consistent tree: each worker's
        # subdir after some prefix of its steps, with exactly that prefix's appends
        autos = [c["id"] for c in log_of(m) if c["kind"] == "auto"]
        ids = sorted(set(cp.ids[:: max(1, len(cp.ids) // 12)]
                         + random.Random(3).sample(autos, min(6, len(autos)))))
        last = m.ctl({"cmd": "checkpoint", "name": "after-workers"})["id"]
        for cid in ids:
            assert m.ctl({"cmd": "restore", "id": cid, "what": "code"})["ok"]
            counts = shared_records(m.mnt / "shared.log", workers) if (m.mnt / "shared.log").exists() \
                else dict.fromkeys(range(workers), 0)
            for w in range(workers):
                if not (m.mnt / f"w{w}").exists():
                    continue  # a checkpoint from before the subdirs existed
                state = (sub_digest(m.mnt, w), counts[w])
                foreign = [p for p in tree_digest(str(m.mnt / f"w{w}"))
                           if not all(part[1:].startswith(f"{w}_") for part in p.split("/"))]
                assert not foreign, f"checkpoint {cid}: worker {w}'s subdir holds {foreign[:5]}"
                if state not in allowed[w]:
                    stale_pages = [p for p, v in tree_digest(str(m.mnt / f"w{w}")).items() if v[0] == "f"
                                   and (m.mnt / f"w{w}" / p).read_bytes() != subprocess.run(
                                       CLI + ["--mount", str(m.mnt), "show", str(cid), f"w{w}/{p}"],
                                       capture_output=True).stdout]
                    assert not stale_pages, (f"checkpoint {cid}: after the restore the mount reads "
                                             f"other bytes than `show` gives for {stale_pages}")
                assert state in allowed[w], (
                    f"checkpoint {cid}: worker {w} in a state no prefix gives: its subdir is that "
                    f"after steps {[k for k, t in enumerate(traces[w]) if t[0] == state[0]]}, with "
                    f"{counts[w]} appends where the native run had "
                    f"{sorted({t[1] for t in traces[w] if t[0] == state[0]})}; mount: "
                    f"{[(p, v[2] if v[0] == 'f' else v[0]) for p, v in sorted(tree_digest(str(m.mnt / f'w{w}')).items())]}"  # noqa: E501  (built on failure only)
                    f"; native with as many appends: {[t[2] for t in traces[w] if t[1] == counts[w]]}")
        fsck_clean(["--mount", str(m.mnt)])
        assert m.ctl({"cmd": "restore", "id": last, "what": "code"})["ok"]
        assert {w: sub_digest(m.mnt, w) for w in range(workers)} == final
        print(f"concurrency: {len(cp.ids)} checkpoints taken meanwhile, {len(ids)} restored")


def test_two_writers_on_one_file(tmp_path: Path) -> None:
    script = r'''
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
w = int(sys.argv[2])
for k in range(w, 400, 2):
    os.pwrite(fd, bytes([65 + w]) * 4000 + b"%05d" % k + b"\n" * 91, k * 4096)
os.close(fd)
'''
    expected = b"".join(bytes([65 + k % 2]) * 4000 + b"%05d" % k + b"\n" * 91 for k in range(400))
    repo = make_repo(tmp_path / "repo")
    with session(tmp_path, repo) as m:
        target = m.mnt / "both.bin"
        target.write_bytes(b"")
        procs = [subprocess.Popen([sys.executable, "-c", script, str(target), str(w)]) for w in (0, 1)]
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
        assert target.read_bytes() == expected
        fsck_clean(["--mount", str(m.mnt)])


MAKEFILE = """\
SRCS := $(wildcard src/*.c)
OBJS := $(SRCS:src/%.c=build/%.o)
GEN := $(patsubst data/%.in,gen/%.txt,$(wildcard data/*.in))
all: build/prog result.txt $(GEN) gen/all.txt
build gen:
\tmkdir -p $@
build/%.o: src/%.c | build
\t$(CC) -O1 -c -o $@ $<
build/prog: $(OBJS)
\t$(CC) -o $@ $^
result.txt: build/prog
\t./build/prog > $@.tmp && mv $@.tmp $@
gen/%.txt: data/%.in | gen
\tsed 's/x/y/g' $< | sort > $@
gen/all.txt: $(GEN)
\tcat $^ > $@
"""


def make_project(root: Path) -> None:
    (root / "src").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "Makefile").write_text(MAKEFILE)
    names = [f"f{i}" for i in range(8)]
    for n in names:
        (root / "src" / f"{n}.c").write_text(f"int {n}(int x) {{ return x * {len(n)} + {ord(n[-1])}; }}\n")
    decls = "".join(f"int {n}(int);\n" for n in names)
    calls = "".join(f'  printf("%d\\n", {n}({i}));\n' for i, n in enumerate(names))
    (root / "src" / "main.c").write_text(f"#include <stdio.h>\n{decls}int main(void) {{\n{calls}  return 0;\n}}\n")
    for i in range(24):
        (root / "data" / f"d{i}.in").write_text("".join(f"x{(i * 7 + k) % 13} line {k}\n" for k in range(200)))


@pytest.mark.skipif(not (shutil.which("make") and shutil.which("cc")), reason="needs make and cc")
def test_make_j4(tmp_path: Path) -> None:
    native = tmp_path / "native"
    make_project(native)
    subprocess.run(["make", "-j4", "-s"], cwd=native, check=True, capture_output=True)
    repo = tmp_path / "repo"
    make_project(repo)
    with session(tmp_path, repo) as m:
        with Checkpointer(m) as cp:
            proc = subprocess.run(["make", "-j4", "-s"], cwd=m.mnt, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert not cp.errors, cp.errors[:3]
        built = tree_digest(str(m.mnt))
        assert built == tree_digest(str(native)), "make -j4 built something else than natively"
        assert subprocess.run(["make", "-q"], cwd=m.mnt).returncode == 0, "make thinks it is out of date"
        fsck_clean(["--mount", str(m.mnt)])
        last = m.ctl({"cmd": "checkpoint", "name": "built"})["id"]
        for cid in sorted(set(cp.ids[:: max(1, len(cp.ids) // 8)])):
            show_matches_tree(m, cid)
        assert m.ctl({"cmd": "restore", "id": last, "what": "code"})["ok"]
        assert tree_digest(str(m.mnt)) == built
        print(f"make -j4: {len(cp.ids)} checkpoints taken meanwhile")


GIT_ENV = {"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@x", "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2020-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "core.fsync=all", *args],
                          cwd=cwd, capture_output=True, text=True, env={**os.environ, **GIT_ENV})


def git_scenario(root: Path) -> dict[str, str]:
    """git add while git status, log and diff run alongside; then commit."""
    for i in range(60):
        (root / "pkg" / f"new{i}.py").write_text(f"value = {i}\n" * (i + 1))
    (root / "README.md").write_text("rewritten\n")
    readers = [subprocess.Popen(["git", "--no-optional-locks", *args], cwd=root, env={**os.environ, **GIT_ENV},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for args in (["status", "--porcelain"], ["log", "--oneline"], ["diff", "--stat"],
                            ["status", "--porcelain"])]
    add = git(root, "add", "-A")
    for r in readers:
        r.communicate(timeout=300)
        assert r.returncode == 0
    assert add.returncode == 0, add.stderr
    commit = git(root, "commit", "-q", "-m", "second")
    assert commit.returncode == 0, commit.stderr
    # two more in parallel on a clean tree: results are deterministic
    a = subprocess.Popen(["git", "--no-optional-locks", "status", "--porcelain"], cwd=root,
                         env={**os.environ, **GIT_ENV}, stdout=subprocess.PIPE, text=True)
    b = git(root, "log", "--format=%H %s")
    out_a, _ = a.communicate(timeout=300)
    fsck = git(root, "fsck", "--full", "--strict")
    assert fsck.returncode == 0, fsck.stderr
    return {"head": git(root, "rev-parse", "HEAD").stdout, "status": out_a, "log": b.stdout,
            "ls": git(root, "ls-files", "-s").stdout}


def make_git_repo(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    for i in range(40):
        (root / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (root / "README.md").write_text("hello\n")
    assert git(root, "init", "-q").returncode == 0
    assert git(root, "add", "-A").returncode == 0
    assert git(root, "commit", "-q", "-m", "first").returncode == 0


@pytest.mark.skipif(not shutil.which("git"), reason="needs git")
def test_parallel_git(tmp_path: Path) -> None:
    native = tmp_path / "native"
    make_git_repo(native)
    expected = git_scenario(native)
    repo = tmp_path / "repo"
    make_git_repo(repo)
    with session(tmp_path, repo) as m:
        with Checkpointer(m) as cp:
            got = git_scenario(m.mnt)
        assert not cp.errors, cp.errors[:3]
        assert got == expected
        fsck_clean(["--mount", str(m.mnt)])
        last = m.ctl({"cmd": "checkpoint", "name": "committed"})["id"]
        for cid in sorted(set(cp.ids[:: max(1, len(cp.ids) // 6)])):
            show_matches_tree(m, cid)
            # git's own view of a checkpoint taken mid-way: objects written so far are whole
            if (m.mnt / ".git" / "HEAD").exists():
                objs = git(m.mnt, "fsck", "--connectivity-only", "--no-dangling")
                assert "corrupt" not in objs.stderr and "bad object" not in objs.stderr, objs.stderr
        assert m.ctl({"cmd": "restore", "id": last, "what": "code"})["ok"]
        assert git(m.mnt, "rev-parse", "HEAD").stdout == expected["head"]


def conversation_of(m: Mount) -> list[str]:
    text = (m.mnt / ".overlayckpt" / "conversation.jsonl").read_text()
    return [json.loads(line)["content"] for line in text.splitlines()]


def test_restore_both_is_both_or_neither_when_killed(tmp_path: Path, rounds: int = 2, seed: int = 17) -> None:
    """Code and conversation move back in one transaction: a kill leaves both or neither."""
    rng = random.Random(seed)
    repo = make_repo(tmp_path / "repo")
    m = Mount(repo, tmp_path / "mnt", tmp_path / "store")
    conv = m.mnt / ".overlayckpt" / "conversation.jsonl"
    try:
        mount(repo, m.mnt, m.store)
        with open(conv, "a") as f:
            f.write(json.dumps({"role": "user", "content": "before"}) + "\n")
        small = m.ctl({"cmd": "checkpoint", "name": "small"})["id"]
        small_state = (tree_digest(str(m.mnt)), conversation_of(m))
        big_change(m, files=150, big_mib=12)
        with open(conv, "a") as f:
            f.write(json.dumps({"role": "assistant", "content": "after"}) + "\n")
        m.ctl({"cmd": "checkpoint", "name": "big"})
        big_state = (tree_digest(str(m.mnt)), conversation_of(m))
        t0 = time.monotonic()
        assert m.ctl({"cmd": "restore", "id": small, "what": "both"})["ok"]
        restore_time = time.monotonic() - t0
        assert (tree_digest(str(m.mnt)), conversation_of(m)) == small_state
        assert m.ctl({"cmd": "restore", "id": "big", "what": "both"})["ok"]
        for r in range(rounds):
            kill_during(m, {"cmd": "restore", "id": small, "what": "both"}, rng, restore_time * 1.5)
            mount(repo, m.mnt, m.store)
            state = (tree_digest(str(m.mnt)), conversation_of(m))
            assert state in (small_state, big_state), f"round {r}: a mix of code and conversation"
            assert m.ctl({"cmd": "restore", "id": "big", "what": "both"})["ok"]
            assert (tree_digest(str(m.mnt)), conversation_of(m)) == big_state
    finally:
        cleanup_mount(m)
    fsck_clean(["--store", str(m.store)])


def waiting_on_daemon(tid: int) -> bool:
    """Thread tid of this process waits for the answer to a FUSE request."""
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            return f.read() == "request_wait_answer"
    except FileNotFoundError:  # the thread has ended
        return False


@contextlib.contextmanager
def daemon_busy(mnt: Path) -> Iterator[Callable[[], None]]:
    """Keep the daemon's Python busy (an fsck --repair of 96 MiB of blocks: a repair
    writes, so it runs on the loop's thread) while the body runs: writes made
    meanwhile are acknowledged by C and wait in its queue. The body calls what it is
    given, before it stops the daemon, to check that fsck still ran all along."""
    with open(mnt / "ballast.bin", "wb") as f:
        f.write(random.Random(8).randbytes(96 << 20))
        # Writing it may have got the store too far ahead of a slow disk, which pauses
        # write-behind until a write Python handles finds the disk caught up: the body's
        # writes would then wait for fsck. The fsync catches the disk up, the byte after
        # it turns write-behind on again if it was paused, and the second fsync stores
        # the byte (the body counts the acknowledged writes a kill leaves in the log).
        for last in (b"", b"\0"):
            f.write(last)
            f.flush()
            os.fsync(f.fileno())
    ctl = os.open(mnt / ".overlayckpt" / "ctl", os.O_RDWR)
    tid: list[int] = []

    def fsck() -> None:
        tid.append(threading.get_native_id())
        with contextlib.suppress(OSError):  # the daemon may die or stop under it
            os.write(ctl, b'{"cmd": "fsck", "repair": true}\n')
    checker = threading.Thread(target=fsck)
    checker.start()
    try:
        wait_for(lambda: tid and waiting_on_daemon(tid[0]), "fsck to start")
        # (a wait that lasts is fsck's: C answers the others in microseconds)
        wait_for(lambda: all(waiting_on_daemon(tid[0]) for _ in range(50)), "fsck to run")

        def still_busy() -> None:
            assert waiting_on_daemon(tid[0]), "fsck ended too soon: give it more to check"
        yield still_busy
    finally:
        checker.join(timeout=DEADLINE)
        os.close(ctl)


def test_requests_are_served_while_a_slow_command_runs(tmp_path: Path) -> None:
    """A read-only command (here fsck over 96 MiB of blocks) runs off the request loop:
    creating, writing and stat-ing a new file (requests only Python answers) return
    while it still runs."""
    repo = make_repo(tmp_path / "repo")
    m = Mount(repo, tmp_path / "mnt", tmp_path / "store")
    try:
        mount(repo, m.mnt, m.store)
        (m.mnt / "ballast.bin").write_bytes(random.Random(9).randbytes(96 << 20))
        ctl = os.open(m.mnt / ".overlayckpt" / "ctl", os.O_RDWR)
        tid: list[int] = []

        def fsck() -> None:
            tid.append(threading.get_native_id())
            os.write(ctl, b'{"cmd": "fsck"}\n')
        checker = threading.Thread(target=fsck)
        checker.start()
        try:
            wait_for(lambda: tid and waiting_on_daemon(tid[0]), "fsck to start")
            served = 0  # probes answered while fsck still ran (however loaded the machine)
            for i in range(20):
                probe = m.mnt / f"probe{i}.txt"
                probe.write_text(f"served {i}\n")  # lookup, create, write, release
                assert os.stat(probe).st_size == len(f"served {i}\n")
                if not waiting_on_daemon(tid[0]):
                    break
                served += 1
            assert served >= 3, f"fsck ended after {served} probes: give it more to check"
        finally:
            checker.join(timeout=DEADLINE)
        assert json.loads(os.pread(ctl, 1 << 20, 0))["clean"]
        os.close(ctl)
    finally:
        cleanup_mount(m)


def test_writes_acknowledged_before_they_were_stored_survive_kill(tmp_path: Path) -> None:
    """C answers a write before Python stores it (write-behind); the write-behind
    log makes it survive kill -9 all the same: the next mount stores it."""
    repo = make_repo(tmp_path / "repo")
    m = Mount(repo, tmp_path / "mnt", tmp_path / "store")
    try:
        mount(repo, m.mnt, m.store)
        pid = daemon_pid(m.store)
        assert pid is not None
        # everything that needs Python first: the new file, the lookups
        burst = os.open(m.mnt / "burst.bin", os.O_CREAT | os.O_WRONLY, 0o644)
        readme = os.open(m.mnt / "README.md", os.O_WRONLY)  # (a repo file, never written)
        blocks = [(b"%07d\n" % i) * 512 for i in range(200)]
        with daemon_busy(m.mnt) as still_busy:
            for i, block in enumerate(blocks):
                assert os.pwrite(burst, block, i * 4096) == 4096
            assert os.write(readme, b"# DEMO") == 6
            os.close(burst)
            os.close(readme)
            still_busy()  # (before the kill: a killed daemon answers no more)
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not proc_alive(pid), f"daemon {pid} to die")
        force_unmount(str(m.mnt))
        mount(repo, m.mnt, m.store)
        assert (m.mnt / "burst.bin").read_bytes() == b"".join(blocks)
        assert (m.mnt / "README.md").read_bytes() == b"# DEMO\n\nhello\n"
        log = (m.store / "daemon.log").read_text()
        # those still queued when it died: Python takes (and stores) the first of the 201
        # once the repair waits for its sync point, so how many depends on the machine;
        # the contents above say that none was lost
        stored = re.search(r"stored (\d+) writes that a stopped daemon had acknowledged", log)
        assert stored and 1 <= int(stored[1]) <= 201, log
        fsck_clean(["--mount", str(m.mnt)])
    finally:
        cleanup_mount(m)


def test_creates_and_removals_answered_before_they_were_stored_survive_kill(tmp_path: Path) -> None:
    """Python answers a create, unlink or rmdir once checked and stores it with the
    changes around it (core/answered.py); its log makes it survive kill -9 all the
    same, and the writes C acknowledged to the files made find them. The killer is the
    process that made and removed, at once: what was answered since the last store
    (FOLD_WAIT ago at most) is still deferred, unless the machine paused it for that
    long, which a next round undoes."""
    repo = make_repo(tmp_path / "repo")
    m = Mount(repo, tmp_path / "mnt", tmp_path / "store")
    replayed: list[str] = []
    try:
        for attempt in range(4):
            mount(repo, m.mnt, m.store)
            pid = daemon_pid(m.store)
            assert pid is not None
            gen = m.mnt / f"gen{attempt}"
            for d in range(30):
                (gen / f"pkg{d}").mkdir(parents=True)
                for i in range(10):
                    (gen / f"pkg{d}" / f"m{i}.js").write_bytes(b"module.exports = %d;\n" % i)
            (gen / "kept.txt").write_bytes(b"kept")
            (gen / "made").mkdir()
            for d in range(30):
                for i in range(10):
                    os.unlink(gen / f"pkg{d}" / f"m{i}.js")
                os.rmdir(gen / f"pkg{d}")
                (gen / "made" / f"n{d}.js").write_bytes(b"made %d\n" % d)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not proc_alive(pid), f"daemon {pid} to die")
            force_unmount(str(m.mnt))
            mount(repo, m.mnt, m.store)
            assert sorted(os.listdir(gen)) == ["kept.txt", "made"]  # nothing came back
            assert {p.name: p.read_bytes() for p in (gen / "made").iterdir()} == {
                f"n{d}.js": b"made %d\n" % d for d in range(30)}
            fsck_clean(["--mount", str(m.mnt)])
            replayed = re.findall(r"stored (\d+) creates and removals that a stopped daemon had answered",
                                  (m.store / "daemon.log").read_text())
            cleanup_mount(m)
            if replayed:
                break
        assert replayed, "no round killed the daemon while an answered change was unstored"
    finally:
        cleanup_mount(m)


def test_sigterm_stores_acknowledged_writes_before_it_applies(tmp_path: Path) -> None:
    """SIGTERM stops pyfuse3's loop with acknowledged writes still queued: the daemon
    stores them from the log before it applies an in-place mount to the repo."""
    repo = make_repo(tmp_path / "repo")
    store = tmp_path / "store"
    run_cli("mount", str(repo), "--store", str(store))
    try:
        pid = daemon_pid(store)
        assert pid is not None
        burst = os.open(repo / "burst.bin", os.O_CREAT | os.O_WRONLY, 0o644)
        blocks = [(b"%07d\n" % i) * 512 for i in range(200)]
        with daemon_busy(repo) as still_busy:
            for i, block in enumerate(blocks):
                assert os.pwrite(burst, block, i * 4096) == 4096
            os.close(burst)
            still_busy()  # (before the signal: a stopping daemon cuts fsck short)
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not proc_alive(pid), f"daemon {pid} to exit")
    finally:
        force_unmount(str(repo))
    assert (repo / "burst.bin").read_bytes() == b"".join(blocks)


# -- 5. apply never drops content (offline: a real Session over tmp_path) ----------

@contextlib.contextmanager
def offline_session(tmp_path: Path, repo: Path) -> Iterator[Any]:
    from overlayckpt.service.session import Session
    s = Session.open(str(tmp_path / "store"), str(repo), create=True)
    try:
        yield s
    finally:
        s.close()


def test_apply_writes_a_sparse_file_over_1_gib(tmp_path: Path) -> None:
    from overlayckpt.core.apply import apply_live
    from overlayckpt.core.journal import Caller
    from overlayckpt.records import ROOT_INO
    repo = tmp_path / "repo"
    repo.mkdir()
    end = (1 << 30) + 5
    with offline_session(tmp_path, repo) as s:
        me = Caller(os.getpid(), "test")
        ino, _ = s.overlay.create(me, ROOT_INO, b"big.img", 0o100644, 0, 0)
        s.overlay.write(me, ino, 0, b"head")
        s.overlay.write(me, ino, end, b"tail!")
        stats = apply_live(s.ctx)
    assert stats["written"] == 1
    st = os.stat(repo / "big.img")
    assert st.st_size == end + 5
    assert st.st_blocks * 512 <= 4 << 20  # the hole stayed a hole (apply writes 1 MiB pieces)
    with open(repo / "big.img", "rb") as f:
        assert f.read(4) == b"head"
        f.seek(end - 3)
        assert f.read() == b"\0\0\0tail!"
    assert sorted(os.listdir(repo)) == ["big.img"]  # no temporary file left behind


def test_apply_streams_a_file_of_many_blocks_with_mixed_content(tmp_path: Path) -> None:
    from overlayckpt.core.apply import apply_live
    from overlayckpt.core.journal import Caller
    repo = tmp_path / "repo"
    repo.mkdir()
    rng = random.Random(5)
    original = rng.randbytes(3 * (1 << 20) + 777)  # more than one apply piece, a partial last block
    (repo / "mixed.bin").write_bytes(original)
    want = bytearray(original)
    with offline_session(tmp_path, repo) as s:
        me = Caller(os.getpid(), "test")
        ino = s.overlay.live(lambda r: s.overlay.resolve(r, "mixed.bin"))
        edits = [(0, rng.randbytes(10)),                   # inside the first block
                 ((1 << 20) - 3, rng.randbytes(4096 + 6)),  # across a piece boundary
                 (2 * (1 << 20), bytes(64 * 4096)),         # zero blocks amid the repo's bytes
                 (len(original) - 5, b"0123456789")]        # past the old end
        for off, data in edits:
            s.overlay.write(me, ino, off, data)
            want[off:off + len(data)] = data
        s.overlay.setattr(me, ino, size=len(want) + 3 * 4096 + 1)  # a zero tail, a hole
        want += bytes(3 * 4096 + 1)
        assert apply_live(s.ctx)["written"] == 1
        assert (repo / "mixed.bin").read_bytes() == want
        assert apply_live(s.ctx)["written"] == 0  # compared piece by piece: nothing differs now
