"""Apply never escapes the repo and never grants more (issue 32: points 1, 2, 8, 10).

The session's store is treated as hostile (a crafted bundle's rows, a damaged store: rows
are put straight into its tables here), and so is the repo while apply runs (a thread
swapping a directory for a symlink to outside). Each test hashes everything around the
repo and the store before and after: nothing outside may change.

In-process where the kernel is not needed (a real Store, Lower and Overlay over tmp_path);
real mounts, the real CLI and a second user for setuid bits, fifos, device nodes and
owners made through FUSE, and a real 1 MiB tmpfs for ENOSPC.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Mount, force_unmount, make_repo, run_cli, wait_daemon_gone, wait_for
from core.helpers_core import ME, ino, put
from helpers_users import User
from overlayckpt.core.apply import TEMP_PREFIX, Applier, apply_checkpoint, apply_live
from overlayckpt.errors import PartlyDone, UserError
from overlayckpt.records import ROOT_INO, Node, dirent_key, u64
from overlayckpt.service.session import Session
from overlayckpt.tables import DIRENTS, NODES

from .conftest import assert_one_line, surroundings

REG = stat.S_IFREG | 0o644
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(repo, store, outside): a small repo, where its session's store goes, and a
    directory beside them holding files a hostile name would aim at."""
    repo = make_repo(tmp_path / "repo")
    (repo / "a" / "b").mkdir(parents=True)
    (repo / "a" / "b" / "f").write_text("repo's f\n")
    outside = tmp_path / "outside"
    (outside / "b").mkdir(parents=True)
    (outside / "victim.txt").write_text("outside: must never change\n")
    (outside / "b" / "f").write_text("outside's f: must never gain a name in the repo\n")
    (outside / "b" / "new").write_text("outside's new: must never gain a name in the repo\n")
    return repo, tmp_path / "store", outside


@pytest.fixture
def opened(world: tuple[Path, Path, Path]) -> Iterator[Session]:
    repo, store, _ = world
    s = Session.open(str(store), str(repo), create=True, window=1e9)
    yield s
    s.close()


def no_temp_files(root: Path) -> None:
    left = [p for p in root.rglob("*") if p.name.startswith(os.fsdecode(TEMP_PREFIX))]
    assert not left, left


def set_node(s: Session, i: int, **fields: Any) -> None:
    """Rewrite inode i's record as a crafted bundle or a damaged store would hold it."""
    raw = s.store.read(lambda r: r.get(NODES, u64(i)))
    assert raw is not None
    node = dataclasses.replace(Node.unpack(raw), **fields)
    s.store.write(lambda w: w.put(NODES, u64(i), node.pack()))


# -- names that are not one component --------------------------------------------------

HOSTILE = [b"../evil-link", b"..", b".", b"a/../../outside/victim.txt", b"x/../../../../tmp/pwned",
           b"nul\0byte", b"", b"n" * 256]


@pytest.mark.parametrize("name", HOSTILE, ids=repr)
@pytest.mark.parametrize("which", ["live", "checkpoint"])
def test_a_name_that_is_not_one_component_is_refused_before_anything_is_written(
        opened: Session, world: tuple[Path, Path, Path], tmp_path: Path, name: bytes,
        which: str) -> None:
    repo, store, outside = world
    s = opened
    put(s.overlay, ME, "README.md", b"changed\n")  # something apply would write
    victim = ino(s.overlay, "README.md")
    key = dirent_key(ROOT_INO, name)
    s.store.write(lambda w: w.put(DIRENTS, key, u64(victim)))  # as a crafted bundle holds it
    before = surroundings(tmp_path, store)
    try:
        with pytest.raises(UserError) as e:
            apply_live(s.ctx) if which == "live" else apply_checkpoint(s.ctx, latest(s))
    finally:
        s.store.write(lambda w: w.delete(DIRENTS, key))
    msg = str(e.value)
    assert "\n" not in msg and "not a single path component" in msg and "nothing was written" in msg
    assert surroundings(tmp_path, store) == before  # the repo and its neighbours alike
    assert (outside / "victim.txt").read_text() == "outside: must never change\n"


def latest(s: Session) -> int:
    from overlayckpt.core.timeline import Timeline
    tl = Timeline(s.ctx)
    tl.seal()
    ck = tl.latest()
    assert ck is not None  # (the origin at least)
    return ck.id


class _AtUseOnly(Applier):
    """The real Applier without its first look at the whole store: what the check where
    each name is used does alone (a store changed between the two, say)."""

    def check_state(self, state: object) -> None:
        pass


@pytest.mark.parametrize("name", [b"../evil", b"sub/../../../outside/victim.txt"], ids=repr)
def test_a_bad_name_is_refused_where_it_is_used_too(opened: Session, world: tuple[Path, Path, Path],
                                                   tmp_path: Path, name: bytes) -> None:
    repo, store, outside = world
    s = opened
    put(s.overlay, ME, "a/b/f", b"session's f\n")
    key = dirent_key(ROOT_INO, name)
    s.store.write(lambda w: w.put(DIRENTS, key, u64(ino(s.overlay, "a/b/f"))))
    before_outside = surroundings(outside)
    try:
        from overlayckpt.core.apply import _LiveState
        with pytest.raises(PartlyDone) as e:
            _AtUseOnly(s.ctx).apply(_LiveState(s.ctx), [], [], force=True)
    finally:
        s.store.write(lambda w: w.delete(DIRENTS, key))
    assert "not a single path component" in str(e.value) and "\n" not in str(e.value)
    assert surroundings(outside) == before_outside
    assert not (tmp_path / "evil").exists() and not os.path.lexists(repo.parent / "evil")
    no_temp_files(repo)


# -- modes: setuid, setgid, device nodes, fifos, unknown types ------------------------------

def test_setuid_and_setgid_bits_from_the_store_are_never_granted(
        opened: Session, world: tuple[Path, Path, Path], tmp_path: Path) -> None:
    repo, store, _ = world
    s = opened
    put(s.overlay, ME, "tool", b"#!/bin/sh\nid\n")
    put(s.overlay, ME, "README.md", b"# now setgid\n")
    set_node(s, ino(s.overlay, "tool"), mode=stat.S_IFREG | 0o4777, uid=0, gid=0)
    set_node(s, ino(s.overlay, "README.md"), mode=stat.S_IFREG | 0o2755)
    before = surroundings(tmp_path, store, repo)
    result = apply_live(s.ctx)
    assert stat.S_IMODE(os.lstat(repo / "tool").st_mode) == 0o777
    assert stat.S_IMODE(os.lstat(repo / "README.md").st_mode) == 0o755
    assert sorted(result["setid_dropped"]) == ["README.md", "tool"]
    assert surroundings(tmp_path, store, repo) == before


def test_a_setuid_bit_the_repo_file_had_is_kept(opened: Session, world: tuple[Path, Path, Path]) -> None:
    repo, _, _ = world
    os.chmod(repo / "run.sh", 0o4755)
    s = Session.open(str(world[1]) + "-2", str(repo), create=True, window=1e9)
    try:
        put(s.overlay, ME, "run.sh", b"#!/bin/sh\necho changed\n")
        result = apply_live(s.ctx)
    finally:
        s.close()
    assert stat.S_IMODE(os.lstat(repo / "run.sh").st_mode) == 0o4755
    assert result["setid_dropped"] == []


@ROOT_ONLY
@pytest.mark.parametrize("kind", [stat.S_IFBLK, stat.S_IFCHR, stat.S_IFIFO, stat.S_IFSOCK])
def test_special_files_are_refused_unless_asked(opened: Session, world: tuple[Path, Path, Path],
                                               tmp_path: Path, kind: int) -> None:
    repo, store, _ = world
    s = opened
    put(s.overlay, ME, "disk", b"")
    put(s.overlay, ME, "plain.txt", b"plain\n")
    set_node(s, ino(s.overlay, "disk"), mode=kind | 0o6666, rdev=os.makedev(7, 0), size=0)
    before = surroundings(tmp_path, store, repo)
    result = apply_live(s.ctx)
    assert not os.path.lexists(repo / "disk")
    assert [r["path"] for r in result["refused"]] == ["disk"]
    assert "--special" in result["refused"][0]["why"]
    assert (repo / "plain.txt").read_text() == "plain\n"
    assert result["written"] == 1  # the count is honest: plain.txt only
    result = apply_live(s.ctx, special=True)
    st = os.lstat(repo / "disk")
    assert stat.S_IFMT(st.st_mode) == kind and stat.S_IMODE(st.st_mode) == 0o666  # no setid
    if kind in (stat.S_IFBLK, stat.S_IFCHR):
        assert st.st_rdev == os.makedev(7, 0)
    assert result["written"] == 1 and result["refused"] == []
    assert surroundings(tmp_path, store, repo) == before


@pytest.mark.parametrize("fields,words", [
    ({"mode": 0o170777}, "unknown type"),
    ({"mode": 0o010000 | 0o644 | 0o160000}, "unknown type"),
    ({"size": 1 << 62}, "more than any file system holds"),
])
def test_a_damaged_node_is_refused_before_anything_is_written(
        opened: Session, world: tuple[Path, Path, Path], tmp_path: Path, fields: dict,
        words: str) -> None:
    repo, store, _ = world
    s = opened
    put(s.overlay, ME, "README.md", b"changed\n")
    put(s.overlay, ME, "odd", b"x")
    i = ino(s.overlay, "odd")
    raw = s.store.read(lambda r: r.get(NODES, u64(i)))
    assert raw is not None
    set_node(s, i, **fields)
    before = surroundings(tmp_path, store)
    try:
        with pytest.raises(UserError) as e:
            apply_live(s.ctx)
    finally:
        s.store.write(lambda w: w.put(NODES, u64(i), raw))
    assert words in str(e.value) and "nothing was written" in str(e.value)
    assert "\n" not in str(e.value)
    assert surroundings(tmp_path, store) == before


def test_a_malformed_node_record_is_one_line(opened: Session, world: tuple[Path, Path, Path],
                                            tmp_path: Path) -> None:
    repo, store, _ = world
    s = opened
    put(s.overlay, ME, "odd", b"x")
    i = ino(s.overlay, "odd")
    raw = s.store.read(lambda r: r.get(NODES, u64(i)))
    assert raw is not None
    s.store.write(lambda w: w.put(NODES, u64(i), b"\x93\x01\x02\x03"))  # 3 fields, not 14
    before = surroundings(tmp_path, store)
    try:
        with pytest.raises(UserError) as e:
            apply_live(s.ctx)
    finally:
        s.store.write(lambda w: w.put(NODES, u64(i), raw))
    assert "damaged file record" in str(e.value) and "run fsck" in str(e.value)
    assert surroundings(tmp_path, store) == before


# -- owners ------------------------------------------------------------------------------

@ROOT_ONLY
def test_root_keeps_each_files_owner(opened: Session, world: tuple[Path, Path, Path]) -> None:
    repo, _, _ = world
    s = opened
    ov = s.overlay
    i, _ = ov.create(ME, ROOT_INO, b"secret", stat.S_IFREG | 0o600, 12345, 23456)
    ov.write(ME, i, 0, b"another user's secret\n")
    d, _ = ov.create(ME, ROOT_INO, b"theirs", stat.S_IFDIR | 0o700, 12345, 23456)
    ov.create(ME, d, b"ln", stat.S_IFLNK | 0o777, 12345, 23456, target=b"../secret")
    apply_live(s.ctx)
    for name in ("secret", "theirs", "theirs/ln"):
        st = os.lstat(repo / name)
        assert (st.st_uid, st.st_gid) == (12345, 23456), name
    assert stat.S_IMODE(os.lstat(repo / "secret").st_mode) == 0o600


@ROOT_ONLY
def test_a_user_applying_refuses_other_users_files(user: User, tmp_path: Path) -> None:
    """Not root: an entry of another owner is refused and listed, never re-owned."""
    work = Path(tempfile.mkdtemp(prefix="ockt-apply-", dir=user.home))
    try:
        repo, store = make_repo(work / "repo"), work / "store"
        s = Session.open(str(store), str(repo), create=True, window=1e9)
        try:
            ov = s.overlay
            for name, uid in ((b"mine", user.uid), (b"theirs", 12345)):
                i, _ = ov.create(ME, ROOT_INO, name, stat.S_IFREG | 0o600, uid, user.gid)
                ov.write(ME, i, 0, name + b"\n")
        finally:
            s.close()
        user.chown(work)
        before = surroundings(tmp_path)
        code = ("import json, sys; from overlayckpt.service.session import Session; "
                "from overlayckpt.core.apply import apply_live; s = Session.open(sys.argv[1]); "
                "print(json.dumps(apply_live(s))); s.close()")
        proc = user.run("env", f"PYTHONPATH={Path(__file__).resolve().parents[2]}",
                        sys.executable, "-c", code, str(store))
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert [r["path"] for r in result["refused"]] == ["theirs"]
        assert "uid 12345" in result["refused"][0]["why"]
        assert not (repo / "theirs").exists()
        st = os.lstat(repo / "mine")
        assert st.st_uid == user.uid and (repo / "mine").read_bytes() == b"mine\n"
        assert surroundings(tmp_path) == before
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- hard links and a repo that changes under apply ----------------------------------------

def inodes(root: Path) -> set[tuple[int, int]]:
    """(dev, ino) of every regular file below root, by directory fds (fwalk: a directory
    swapped for a symlink while it walks is not followed)."""
    out = set()
    for _, _, names, dfd in os.fwalk(root):
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # (the swapper moved it)
            if stat.S_ISREG(st.st_mode):
                out.add((st.st_dev, st.st_ino))
    return out


SWAP = """
import ctypes, os, sys
ab, sym, target, count = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
os.symlink(target, sym)
n = 0
while True:  # a/b and a symlink beside the repo trade places, atomically, again and again
    libc.renameat2(-100, ab.encode(), -100, sym.encode(), 2)  # RENAME_EXCHANGE
    n += 1
    if n % 100 == 0:
        with open(count + ".new", "w") as f:
            f.write(str(n))
        os.replace(count + ".new", count)
"""


class Swapper:
    """A process (not a thread: no lock shared with apply) swapping repo/a/b for a symlink
    to outside/b and back (renameat2 RENAME_EXCHANGE) as fast as it can, until stopped."""

    def __init__(self, repo: Path, outside: Path) -> None:
        self.count = repo.parent / "swaps"
        self.proc = subprocess.Popen([sys.executable, "-c", SWAP, str(repo / "a" / "b"),
                                      str(repo.parent / "swap-link"), str(outside / "b"),
                                      str(self.count)])
        wait_for(self.count.exists, "the swapper to start")

    def stop(self) -> int:
        """Stop it (with a/b put back as a directory if it can be); the swaps it made."""
        self.proc.kill()
        self.proc.wait()
        for p in (self.count.parent / "repo" / "a" / "b", self.count.parent / "swap-link"):
            if os.path.islink(p):
                os.unlink(p)
        return int(self.count.read_text())


def test_a_symlink_swapped_in_during_apply_is_never_followed(
        opened: Session, world: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Before: os.link through "a/b/f" followed a/b swapped for a symlink, and REPO/hl
    became a name of outside/b/f. Now a second name is linked from an fd of the first."""
    repo, store, outside = world
    s = opened
    ov = s.overlay
    put(ov, ME, "a/b/new", b"v0\n")  # (a dirent in a/b: apply visits a/b every time)
    f = ino(ov, "a/b/new")
    ov.link(ME, f, ROOT_INO, b"hl")
    put(ov, ME, "c.bin", os.urandom(4 << 20))  # written between a/b/new and hl: a wide window
    c = ino(ov, "c.bin")
    before, outside_files = surroundings(outside), inodes(outside)
    swapper = Swapper(repo, outside)
    outcomes = {"applied": 0, "stopped": 0}
    try:
        for n in range(100):
            ov.write(ME, f, 0, b"v%03d\n" % n)  # (by inode: the repo's a/b is in flux)
            ov.write(ME, c, 0, b"v%03d\n" % n)
            try:
                apply_live(s.ctx, force=True)
                outcomes["applied"] += 1
                # (each time: the next apply would replace a wrong link and hide it)
                assert not inodes(repo) & outside_files, f"iteration {n}: hl is outside's f"
            except UserError as e:
                assert "\n" not in str(e)
                outcomes["stopped"] += 1
    finally:
        swaps = swapper.stop()
    assert swaps > 1000, swaps  # it did race
    assert surroundings(outside) == before
    assert not inodes(repo) & inodes(outside), "a repo file shares an inode with a file outside"
    no_temp_files(repo)
    if os.path.lexists(repo / "a" / "b"):  # the last apply may have run after the last swap
        assert not os.path.islink(repo / "a" / "b") or outcomes["stopped"]


def test_hard_links_are_made_from_the_file_apply_wrote(opened: Session, world: tuple[Path, Path, Path]) -> None:
    repo, _, _ = world
    s = opened
    ov = s.overlay
    put(ov, ME, "a/b/new", b"linked\n")  # (new: see the report on a lower file's other names)
    ov.link(ME, ino(ov, "a/b/new"), ROOT_INO, b"hl")
    ov.link(ME, ino(ov, "a/b/new"), ino(ov, "a"), b"hl2")
    apply_live(s.ctx)
    ids = {(os.lstat(p).st_dev, os.lstat(p).st_ino) for p in (repo / "a/b/new", repo / "hl", repo / "a/hl2")}
    assert len(ids) == 1 and (repo / "hl").read_bytes() == b"linked\n"
    assert os.lstat(repo / "hl").st_nlink == 3
    no_temp_files(repo)


# -- a repo that runs out of space part way ------------------------------------------------

@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only), unmounted at the end whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_enospc_part_way_leaves_no_temp_file_and_names_what_was_written(
        small_fs: Path, tmp_path: Path) -> None:
    repo = small_fs / "repo"
    repo.mkdir()
    (repo / "keep.txt").write_text("kept\n")
    store = tmp_path / "store"
    s = Session.open(str(store), str(repo), create=True, window=1e9)
    try:
        for n in range(6):  # 6 x 300 KB into 1 MiB: the fourth cannot fit
            put(s.overlay, ME, f"f{n}.bin", os.urandom(300_000))
        want = {f"f{n}.bin": bytes(0) for n in range(6)}
        want = {p: s.overlay.live(lambda r: s.overlay.read_all(r, s.overlay.resolve(r, p)))
                for p in want}
    finally:
        s.close()
    before = surroundings(tmp_path, store, small_fs)
    proc = run_cli("--store", str(store), "apply", check=False)
    err = assert_one_line(proc, "No space left on device", "partly applied", "written")
    proc = run_cli("--store", str(store), "--json", "apply", check=False)
    assert proc.returncode == 1
    details = json.loads(proc.stdout)
    no_temp_files(repo)
    present = sorted(p.name for p in repo.iterdir() if p.name != "keep.txt")
    # (the second run wrote nothing more: the files the first wrote are the same now)
    assert 0 < len(present) < 6, present
    for name in present:
        assert (repo / name).read_bytes() == want[name]
    assert details["failed_at"] not in present
    first_written = err.split("written (", 1)[1]
    assert all(name in first_written for name in present[:3]), err
    assert (repo / "keep.txt").read_text() == "kept\n"
    assert surroundings(tmp_path, store, small_fs) == before


# -- through a real mount: a second user, --allow-other, and root's apply --------------------

@pytest.fixture
def shared(tmp_path: Path, torn_down: Callable) -> Iterator[tuple[Path, Path, Path]]:
    """(repo, mnt, store) where another user can reach them: the repo holds a directory
    anyone may write (as a shared checkout may)."""
    d = Path(tempfile.mkdtemp(prefix="ockt-shared-", dir="/tmp"))
    os.chmod(d, 0o755)
    repo, mnt, store = make_repo(d / "repo"), d / "mnt", tmp_path / "store"
    (repo / "shared").mkdir()
    os.chmod(repo / "shared", 0o1777)
    mnt.mkdir()
    torn_down(mnt, store)
    try:
        yield repo, mnt, store
    finally:
        force_unmount(str(mnt))
        shutil.rmtree(d, ignore_errors=True)


@ROOT_ONLY
def test_another_users_setuid_file_fifo_and_device_node_are_not_granted_by_roots_apply(
        user: User, shared: tuple[Path, Path, Path], tmp_path: Path) -> None:
    repo, mnt, store = shared
    run_cli("mount", str(repo), str(mnt), "--store", str(store), "--allow-other")
    sh = mnt / "shared"
    assert user.run("sh", "-c", "cp /bin/true tool && chmod 4755 tool && mkfifo pipe "
                    "&& echo secret > secret && chmod 600 secret", cwd=sh).returncode == 0
    os.mknod(sh / "disk", stat.S_IFBLK | 0o666, os.makedev(7, 0))  # (root, as an agent may)
    before = surroundings(tmp_path, store)
    proc = run_cli("--mount", str(mnt), "apply")
    assert "refused 2" in proc.stdout and "--special" in proc.stdout, proc.stdout
    assert "setuid/setgid bits dropped from 1" in proc.stdout, proc.stdout
    tool = os.lstat(repo / "shared" / "tool")
    assert stat.S_IMODE(tool.st_mode) == 0o755 and tool.st_uid == user.uid  # owner kept, no bit
    secret = os.lstat(repo / "shared" / "secret")
    assert (secret.st_uid, stat.S_IMODE(secret.st_mode)) == (user.uid, 0o600)
    assert not os.path.lexists(repo / "shared" / "pipe")
    assert not os.path.lexists(repo / "shared" / "disk")
    reply = json.loads(run_cli("--mount", str(mnt), "--json", "apply", "--special").stdout)
    assert reply["refused"] == [] and reply["written"] == 2
    assert stat.S_ISFIFO(os.lstat(repo / "shared" / "pipe").st_mode)
    assert os.lstat(repo / "shared" / "pipe").st_uid == user.uid
    assert stat.S_ISBLK(os.lstat(repo / "shared" / "disk").st_mode)
    again = json.loads(run_cli("--mount", str(mnt), "--json", "apply", "--special").stdout)
    assert again["written"] == 0 and again["setid_dropped"] == []  # the bit left out stays out
    assert surroundings(tmp_path, store) == before
    no_temp_files(repo)


@ROOT_ONLY
def test_the_apply_at_unmount_grants_nothing_either(user: User, shared: tuple[Path, Path, Path],
                                                    tmp_path: Path) -> None:
    repo, mnt, store = shared
    run_cli("mount", str(repo), str(mnt), "--store", str(store), "--allow-other", "--apply")
    sh = mnt / "shared"
    assert user.run("sh", "-c", "cp /bin/true tool && chmod 6755 tool && mkfifo pipe",
                    cwd=sh).returncode == 0
    before = surroundings(tmp_path, store)
    proc = run_cli("unmount", str(mnt))
    assert "refused 1" in proc.stdout and "pipe" in proc.stdout, proc.stdout
    wait_daemon_gone(store)
    tool = os.lstat(repo / "shared" / "tool")
    assert stat.S_IMODE(tool.st_mode) == 0o755 and tool.st_uid == user.uid
    assert not os.path.lexists(repo / "shared" / "pipe")
    assert surroundings(tmp_path, store) == before
    no_temp_files(repo)


@ROOT_ONLY
def test_a_symlink_swap_during_the_cli_apply_of_a_mount(mount_factory: Callable, world: tuple,
                                                        tmp_path: Path) -> None:
    repo, _, outside = world
    m: Mount = mount_factory(repo)
    (m.mnt / "a" / "b" / "f").write_text("from the mount\n")
    os.link(m.mnt / "a" / "b" / "f", m.mnt / "hl")
    before, outside_files = surroundings(outside), inodes(outside)
    swapper = Swapper(repo, outside)
    try:
        for n in range(15):
            (m.mnt / "a" / "b" / "f").write_text(f"v{n}\n")
            proc = m.cli("apply", "--force", check=False)
            if proc.returncode:
                assert_one_line(proc)
            assert not inodes(repo) & outside_files, f"iteration {n}: hl is outside's f"
    finally:
        swaps = swapper.stop()
    assert swaps > 15
    assert surroundings(outside) == before
    assert not inodes(repo) & inodes(outside)
    no_temp_files(repo)
