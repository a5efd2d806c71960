"""Differential POSIX tests: the same operations on a native directory and on the mount.

The hypothesis state machines apply random operation sequences to a native copy of
the sample repo and to the same repo seen through the mount, and after every step
compare the trees (names, types, modes, sizes, contents, file link counts, symlink
targets, user.* xattrs) and the outcome (value or errno) of every operation.

Mounting is slow, so there is one mount per test function: its lower holds many
copies of the sample repo and every hypothesis example works on a fresh one (a
lower copy, so renames and copy-up of lower directories are exercised). At the
end the mount is unmounted and mounted again, and every example's final tree must
have survived (the data reached the store, not only the kernel's page cache).

Set OVERLAYCKPT_HYPOTHESIS_RANDOM=1 to explore new random sequences (and
OVERLAYCKPT_HYPOTHESIS_EXAMPLES=N for more of them); by default the examples are
derandomized so that the suite gives the same answer every run. Run with -s to
see how often each operation succeeded or failed with which errno.
"""
from __future__ import annotations

import errno
import mmap
import os
import random
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from conftest import Mount, force_unmount, make_repo, run_cli, tree_digest, wait_daemon_gone
from helpers_diff import RENAME_EXCHANGE, RENAME_NOREPLACE, outcome, renameat2, unmount

N_LOWER = 60

HYPOTHESIS_SETTINGS = settings(
    max_examples=int(os.environ.get("OVERLAYCKPT_HYPOTHESIS_EXAMPLES", "20")),
    stateful_step_count=25,
    deadline=None,
    derandomize=not os.environ.get("OVERLAYCKPT_HYPOTHESIS_RANDOM"),
    database=None,
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)

# names the random paths are made of: the sample repo's own names (so that new
# paths collide with existing ones) plus a few fresh ones
NAMES = ["a", "b", "c", "d", "e", "README.md", "hardlink.md", "link", "src", "pkg", "main.py",
         "util.py", "docs", "guide.txt", "empty", "bin.dat", "run.sh"]
FILE_MODES = st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o444, 0o640])
DIR_MODES = st.sampled_from([0o755, 0o700, 0o777, 0o750, 0o555])
CHMOD_MODES = st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o444, 0o000, 0o777, 0o1777, 0o640])
OFFSETS = st.one_of(
    st.integers(0, 20000),
    st.sampled_from([4095, 4096, 4097, 8191, 65535, 65536, 65537, 131077, 1 << 20, (1 << 20) + 4095]),
)
SIZES = st.one_of(st.integers(0, 20000), st.sampled_from([0, 1, 4095, 4096, 4097, 65536, 300000]))
CONTENT = st.one_of(st.binary(max_size=600), st.binary(min_size=4000, max_size=9000))
XATTR_NAMES = st.sampled_from(["user.a", "user.b", "user.long.name"])
# ext4 keeps all of a file's xattrs in one 4 KiB block (ENOSPC beyond): stay well below that
XATTR_VALUES = st.one_of(st.binary(max_size=40), st.just(b""), st.binary(min_size=500, max_size=1000))


def decorate(root: Path) -> Path:
    """The sample repo plus what make_repo lacks: lower xattrs, a read-only file, a deeper dir."""
    os.setxattr(root / "bin.dat", "user.a", b"lower value")
    os.setxattr(root / "docs", "user.b", b"on a dir")
    os.setxattr(root / "README.md", "user.long.name", b"x" * 600)
    (root / "src" / "pkg" / "sub").mkdir()
    (root / "src" / "pkg" / "sub" / "leaf.txt").write_text("leaf\n")
    os.chmod(root / "src" / "pkg" / "util.py", 0o444)
    return root


class DiffWorld:
    """One mount for a whole test function, plus its native twin."""

    def __init__(self, tmp_path: Path, mount_factory) -> None:
        self.lower = tmp_path / "lower"
        for i in range(N_LOWER):
            decorate(make_repo(self.lower / f"ex{i:03d}"))
        self.lower_before = tree_digest(str(self.lower))
        self.native = tmp_path / "native"
        self.native.mkdir()
        self.mount_factory = mount_factory
        self.m: Mount = mount_factory(self.lower)
        self.used: list[str] = []
        self.stats: Counter[str] = Counter()  # "rule: ok|ERRNO" -> count, printed with -s

    def fresh(self) -> tuple[Path, Path]:
        """A fresh copy of the sample repo on both sides, for one hypothesis example."""
        i = len(self.used)
        name = f"ex{i:03d}"
        if i < N_LOWER:  # a copy already in the mount's lower
            subprocess.run(["cp", "-a", str(self.lower / name), str(self.native / name)], check=True)
        else:  # out of lower copies: build the sample through the mount and natively
            decorate(make_repo(self.m.mnt / name))
            decorate(make_repo(self.native / name))
        self.used.append(name)
        return self.native / name, self.m.mnt / name

    def check_after_remount(self) -> None:
        unmount(self.m.mnt)
        assert tree_digest(str(self.lower)) == self.lower_before, "the lower changed"
        self.m = self.mount_factory(self.lower)
        for name in self.used:
            assert tree_digest(str(self.m.mnt / name)) == tree_digest(str(self.native / name)), (
                f"{name} differs from native after unmount and mount again")


class NativeVsMount(RuleBasedStateMachine):
    """Data operations on files; subclasses add the namespace operations."""

    world: DiffWorld  # set by the test function before running

    def __init__(self) -> None:
        super().__init__()
        self.native, self.mnt = self.world.fresh()

    # -- helpers --------------------------------------------------------------

    def existing(self) -> list[str]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.native):
            for n in dirnames + filenames:
                out.append(os.path.relpath(os.path.join(dirpath, n), self.native))
        return sorted(out)

    def dirs(self) -> list[str]:
        return [""] + [p for p in self.existing()
                       if stat.S_ISDIR(os.lstat(self.native / p).st_mode)]

    def pick(self, data, label: str = "path") -> str:
        """A path: mostly an existing one, else a (maybe colliding) new name in a directory."""
        existing = self.existing()
        new = st.tuples(st.sampled_from(self.dirs()), st.sampled_from(NAMES)).map(
            lambda t: os.path.join(*t) if t[0] else t[1])
        if not existing or data.draw(st.integers(0, 2), label=f"{label} is new") == 0:
            return data.draw(new, label=label)
        return data.draw(st.sampled_from(existing), label=label)

    def both(self, fn) -> object:
        """Run fn(root) natively and in the mount; outcomes must match."""
        want = outcome(lambda: fn(self.native))
        got = outcome(lambda: fn(self.mnt))
        assert got == want, f"mount gave {got!r}, native gave {want!r}"
        caller = sys._getframe(1).f_code.co_name
        self.world.stats[f"{caller}: {want[0] if want[0] == 'ok' else want[1]}"] += 1
        return want

    @invariant()
    def trees_equal(self) -> None:
        native = tree_digest(str(self.native))
        mounted = tree_digest(str(self.mnt))
        if native != mounted:
            diff = {k: (native.get(k), mounted.get(k)) for k in sorted(set(native) | set(mounted))
                    if native.get(k) != mounted.get(k)}
            raise AssertionError(f"trees differ (path: (native, mount)): {diff}")

    # -- data rules ----------------------------------------------------------

    @rule(data=st.data(), content=CONTENT, excl=st.booleans(), mode=FILE_MODES)
    def create_write(self, data, content, excl, mode):
        p = self.pick(data)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if excl else os.O_TRUNC)

        def f(root):
            fd = os.open(root / p, flags, mode)
            try:
                return os.write(fd, content), os.fstat(fd).st_size
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=st.binary(max_size=200))
    def open_trunc(self, data, content):
        """O_TRUNC on an existing file: size 0 and nothing of the old content left."""
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_RDWR | os.O_TRUNC)
            try:
                size0 = os.fstat(fd).st_size
                os.write(fd, content)
                return size0, os.pread(fd, 1 << 20, 0)
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=CONTENT, off=OFFSETS)
    def pwrite(self, data, content, off):
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_WRONLY)
            try:
                return os.pwrite(fd, content, off), os.fstat(fd).st_size
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=CONTENT, off=OFFSETS)
    def pwrite_then_pread_same_fd(self, data, content, off):
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_RDWR)
            try:
                os.pwrite(fd, content, off)
                return os.pread(fd, len(content) + 100, max(0, off - 50))
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=st.binary(max_size=5000), create=st.booleans())
    def append(self, data, content, create):
        p = self.pick(data)
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)

        def f(root):
            fd = os.open(root / p, flags, 0o644)
            try:
                os.write(fd, content)
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), size=SIZES, via_fd=st.booleans())
    def truncate(self, data, size, via_fd):
        p = self.pick(data)

        def f(root):
            if not via_fd:
                return os.truncate(root / p, size)
            fd = os.open(root / p, os.O_WRONLY)
            try:
                os.ftruncate(fd, size)
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), off=OFFSETS, n=st.integers(0, 70000))
    def read(self, data, off, n):
        """Also covers opening a missing path (ENOENT) and reading a directory (EISDIR)."""
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_RDONLY)
            try:
                return os.pread(fd, n, off)
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=st.binary(min_size=1, max_size=3000))
    def unlink_while_open(self, data, content):
        """The open fd outlives the name: it still reads and writes, fstat says nlink-1."""
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_RDWR)
            try:
                os.unlink(root / p)
                os.pwrite(fd, content, 10)
                st_ = os.fstat(fd)
                return st_.st_nlink, st_.st_size, os.pread(fd, 1 << 20, 0)
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=st.binary(max_size=3000))
    def write_fsync(self, data, content):
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, content)
                os.fsync(fd)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=st.binary(max_size=3000), excl=st.booleans())
    def exclusive_create(self, data, content, excl):
        """O_CREAT|O_EXCL on an existing name (file, dir, symlink, dangling symlink) is EEXIST."""
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                return os.write(fd, content)
            finally:
                os.close(fd)
        self.both(f)


class NamespaceMachine(NativeVsMount):
    """Everything, with the namespace operations on top of the data ones."""

    @rule(data=st.data())
    def unlink(self, data):
        p = self.pick(data)
        self.both(lambda root: os.unlink(root / p))

    @rule(data=st.data(), mode=DIR_MODES)
    def mkdir(self, data, mode):
        p = self.pick(data)
        self.both(lambda root: os.mkdir(root / p, mode))

    @rule(data=st.data())
    def rmdir(self, data):
        """Includes non-empty directories (ENOTEMPTY), files (ENOTDIR), missing (ENOENT)."""
        p = self.pick(data)
        self.both(lambda root: os.rmdir(root / p))

    @rule(data=st.data(), flags=st.sampled_from([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
    def rename(self, data, flags):
        src = self.pick(data, "src")
        dst = self.pick(data, "dst")
        if flags == 0:
            self.both(lambda root: os.rename(root / src, root / dst))
        else:
            self.both(lambda root: renameat2(root / src, root / dst, flags))

    @rule(data=st.data(), flags=st.sampled_from([0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
    def rename_dir(self, data, flags):
        """A directory (often a lower one with children) renamed somewhere, maybe over a dir."""
        dirs = [d for d in self.dirs() if d]
        if not dirs:
            return
        src = data.draw(st.sampled_from(dirs), label="src")
        dst = data.draw(st.one_of(st.sampled_from(dirs), st.sampled_from(NAMES)), label="dst")
        self.both(lambda root: renameat2(root / src, root / dst, flags))

    @rule(data=st.data(), content=st.binary(min_size=1, max_size=300))
    def rename_open_file(self, data, content):
        """A file renamed while open: the fd keeps working on the renamed file."""
        src = self.pick(data, "src")
        dst = self.pick(data, "dst")

        def f(root):
            fd = os.open(root / src, os.O_RDWR)
            try:
                os.rename(root / src, root / dst)
                os.pwrite(fd, content, 0)
                return os.pread(fd, 1 << 20, 0)
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), follow=st.booleans())
    def link(self, data, follow):
        src = self.pick(data, "src")
        dst = self.pick(data, "dst")
        self.both(lambda root: os.link(root / src, root / dst, follow_symlinks=follow))

    @rule(data=st.data())
    def symlink(self, data):
        # targets stay inside the example: relative, no "..", so following one never
        # leads out of the example directory (on either side)
        existing = self.existing()
        target = data.draw(st.one_of(st.sampled_from(NAMES), st.sampled_from(existing))
                           if existing else st.sampled_from(NAMES), label="target")
        p = self.pick(data)
        self.both(lambda root: os.symlink(target, root / p))

    @rule(data=st.data(), mode=CHMOD_MODES)
    def chmod(self, data, mode):
        p = self.pick(data)
        self.both(lambda root: os.chmod(root / p, mode))

    @rule(data=st.data(), mtime=st.integers(0, 2**33 * 10**9), follow=st.booleans())
    def utime(self, data, mtime, follow):
        """Only the outcome is compared: timestamps are not part of the tree comparison."""
        p = self.pick(data)
        self.both(lambda root: os.utime(root / p, ns=(mtime, mtime), follow_symlinks=follow))

    @rule(data=st.data(), name=XATTR_NAMES, value=XATTR_VALUES,
          flags=st.sampled_from([0, 0, os.XATTR_CREATE, os.XATTR_REPLACE]), follow=st.booleans())
    def setxattr(self, data, name, value, flags, follow):
        p = self.pick(data)
        self.both(lambda root: os.setxattr(root / p, name, value, flags, follow_symlinks=follow))

    @rule(data=st.data(), name=XATTR_NAMES, follow=st.booleans())
    def removexattr(self, data, name, follow):
        p = self.pick(data)
        self.both(lambda root: os.removexattr(root / p, name, follow_symlinks=follow))

    @rule(data=st.data(), name=XATTR_NAMES)
    def getxattr(self, data, name):
        p = self.pick(data)
        self.both(lambda root: os.getxattr(root / p, name))

    @rule(data=st.data())
    def listxattr(self, data):
        p = self.pick(data)
        self.both(lambda root: sorted(n for n in os.listxattr(root / p) if n.startswith("user.")))

    @rule(data=st.data())
    def listdir(self, data):
        p = self.pick(data)
        self.both(lambda root: sorted(os.listdir(root / p)))

    @rule(data=st.data())
    def readlink(self, data):
        p = self.pick(data)
        self.both(lambda root: os.readlink(root / p))

    @rule(data=st.data())
    def stat_follow(self, data):
        p = self.pick(data)

        def f(root):
            s = os.stat(root / p)
            if stat.S_ISDIR(s.st_mode):
                return s.st_mode
            return s.st_mode, s.st_size, s.st_nlink
        self.both(f)


class DataMachine(NativeVsMount):
    """File contents only, on a few files: offsets across blocks, holes, truncates."""

    def pick(self, data, label: str = "path") -> str:
        return data.draw(st.sampled_from(["README.md", "hardlink.md", "bin.dat", "docs/guide.txt",
                                          "f0", "f1"]), label=label)

    @rule(data=st.data())
    def drop_page_cache(self, data):
        """Evict clean cached pages so that reads go to the daemon, not the page cache."""
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.both(f)

    @rule(data=st.data(), content=st.binary(min_size=1, max_size=70000), off=OFFSETS)
    def big_pwrite(self, data, content, off):
        p = self.pick(data)

        def f(root):
            fd = os.open(root / p, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                return os.pwrite(fd, content, off), os.fstat(fd).st_size
            finally:
                os.close(fd)
        self.both(f)


def _run_machine(machine: type[NativeVsMount], tmp_path: Path, mount_factory) -> None:
    world = DiffWorld(tmp_path, mount_factory)
    machine_cls = type(machine.__name__, (machine,), {"world": world})
    run_state_machine_as_test(machine_cls, settings=HYPOTHESIS_SETTINGS)
    print(f"\n{machine.__name__}: {len(world.used)} examples, "
          f"{sum(world.stats.values())} compared operations")
    for key, n in sorted(world.stats.items()):
        print(f"  {key:45s} {n}")
    world.check_after_remount()


def test_differential_namespace_and_data(tmp_path: Path, mount_factory) -> None:
    _run_machine(NamespaceMachine, tmp_path, mount_factory)


def test_differential_file_data(tmp_path: Path, mount_factory) -> None:
    _run_machine(DataMachine, tmp_path, mount_factory)


# -- specific behaviours, one at a time -----------------------------------------
#
# Tests that need no remount share one mount (mounting costs over a second): each
# gets its own copy of the sample repo, already in that mount's lower, as `sample`
# (a Mount whose repo and mnt are that copy's lower and mounted paths).


class SharedMount:
    COPIES = 40

    def __init__(self, base: Path) -> None:
        self.lower = base / "lower"
        for i in range(self.COPIES):
            make_repo(self.lower / f"s{i:02d}")
        self.lower_before = tree_digest(str(self.lower))
        self.mnt = base / "mnt"
        self.mnt.mkdir()
        self.store = base / "store"
        run_cli("mount", str(self.lower), str(self.mnt), "--store", str(self.store))
        self.next = 0

    def sample(self) -> Mount:
        assert self.next < self.COPIES, "raise SharedMount.COPIES"
        name = f"s{self.next:02d}"
        self.next += 1
        return Mount(self.lower / name, self.mnt / name, self.store)


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory) -> Iterator[SharedMount]:
    base = tmp_path_factory.mktemp("shared")
    try:  # also when the mount fails half-way
        shared = SharedMount(base)
        yield shared
    finally:
        force_unmount(str(base / "mnt"))
        wait_daemon_gone(base / "store")
    assert tree_digest(str(shared.lower)) == shared.lower_before, "the lower changed while mounted"
    wait_daemon_gone(shared.store)
    proc = run_cli("--store", str(shared.store), "fsck", check=False)
    assert proc.returncode == 0, f"fsck after the tests:\n{proc.stdout}{proc.stderr}"


@pytest.fixture
def sample(shared_mount: SharedMount) -> Mount:
    return shared_mount.sample()


def test_unlinked_open_file_still_readable(sample: Mount) -> None:
    p = sample.mnt / "src" / "main.py"
    want = p.read_bytes()
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert not p.exists()
        assert "main.py" not in os.listdir(sample.mnt / "src")
        assert os.fstat(fd).st_nlink == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # reads come from the daemon
        assert os.pread(fd, 1 << 16, 0) == want
        os.pwrite(fd, b"more", len(want))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 1 << 16, 0) == want + b"more"
        assert os.fstat(fd).st_size == len(want) + 4
    finally:
        os.close(fd)
    assert not p.exists()
    # a new file of that name is a different file
    p.write_bytes(b"new")
    assert p.read_bytes() == b"new"


def test_unlink_one_hard_link_of_open_file(sample: Mount) -> None:
    a, b = sample.mnt / "README.md", sample.mnt / "hardlink.md"
    assert os.stat(a).st_nlink == 2
    fd = os.open(a, os.O_RDWR)
    try:
        os.unlink(a)
        assert os.fstat(fd).st_nlink == 1
        os.pwrite(fd, b"X", 0)
    finally:
        os.close(fd)
    assert b.read_bytes() == b"X demo\n\nhello\n"
    assert os.stat(b).st_nlink == 1


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_o_trunc_really_truncates(mounted: Mount, mount_factory) -> None:
    """FACTS.md: under writeback cache, an ignored O_TRUNC shows size 0 but keeps the data."""
    p = mounted.mnt / "docs" / "guide.txt"
    assert p.stat().st_size == 25000
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert p.stat().st_size == 0
    assert p.read_bytes() == b""
    _drop_cache(p)
    assert p.read_bytes() == b""
    # a short write after O_TRUNC: nothing of the old content may come back
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"short\n")
    os.close(fd)
    assert p.read_bytes() == b"short\n"
    # and the same after the daemon has served it from its store
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    assert (m.mnt / "docs" / "guide.txt").read_bytes() == b"short\n"
    assert (m.mnt / "docs" / "guide.txt").stat().st_size == 6


def test_o_trunc_on_new_upper_file(mounted: Mount, mount_factory) -> None:
    p = mounted.mnt / "new.bin"
    p.write_bytes(os.urandom(100_000))
    with open(p, "wb") as f:  # O_WRONLY|O_CREAT|O_TRUNC
        f.write(b"x")
    assert p.stat().st_size == 1
    assert p.read_bytes() == b"x"
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    assert (m.mnt / "new.bin").read_bytes() == b"x"


def test_mmap_shared_write_then_fresh_open(mounted: Mount, mount_factory) -> None:
    p = mounted.mnt / "bin.dat"
    orig = p.read_bytes()
    with open(p, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        assert mm[:256] == bytes(range(256))
        mm[0:5] = b"HELLO"
        mm[20000:20003] = b"ABC"
        mm.flush()
        mm.close()
    want = b"HELLO" + orig[5:20000] + b"ABC" + orig[20003:]
    with open(p, "rb") as f:
        assert f.read() == want
    # mmap read of a file written with write()
    q = mounted.mnt / "src" / "pkg" / "util.py"
    with open(q, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
        assert mm[:] == b"def answer():\n    return 42\n"
        mm.close()
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    assert (m.mnt / "bin.dat").read_bytes() == want
    assert (mounted.repo / "bin.dat").read_bytes() == orig


def test_mmap_shared_write_new_file_grown_by_ftruncate(sample: Mount) -> None:
    p = sample.mnt / "mapped.bin"
    with open(p, "w+b") as f:
        f.truncate(3 * 4096)
        mm = mmap.mmap(f.fileno(), 3 * 4096, mmap.MAP_SHARED)
        mm[4096:4100] = b"page"
        mm.flush()
        mm.close()
    _drop_cache(p)  # read back from the daemon, not from the pages the mapping wrote
    data = p.read_bytes()
    assert len(data) == 3 * 4096
    assert data[4096:4100] == b"page"
    assert data.count(0) == 3 * 4096 - 4


def test_sparse_200mib(mounted: Mount, mount_factory) -> None:
    p = mounted.mnt / "sparse.bin"
    off = 200 * 1024 * 1024
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert os.pwrite(fd, b"Z", off) == 1
    finally:
        os.close(fd)
    assert p.stat().st_size == off + 1
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == b"\0" * 4096
        assert os.pread(fd, 1 << 20, 100 * 1024 * 1024) == b"\0" * (1 << 20)
        assert os.pread(fd, 10, off - 5) == b"\0" * 5 + b"Z"
        assert os.pread(fd, 10, off + 1) == b""
    finally:
        os.close(fd)
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    q = m.mnt / "sparse.bin"
    assert q.stat().st_size == off + 1
    fd = os.open(q, os.O_RDONLY)
    try:
        assert os.pread(fd, 1 << 20, 150 * 1024 * 1024) == b"\0" * (1 << 20)
        assert os.pread(fd, 2, off - 1) == b"\0Z"
    finally:
        os.close(fd)


def test_fsync_and_fdatasync_make_writes_durable_in_the_store(mounted: Mount, mount_factory) -> None:
    """What fsync, fdatasync and a directory fsync acknowledged is in the store: it
    survives kill -9 of the daemon (no clean shutdown) even without the write-behind
    log, which is emptied before the mount comes back."""
    m = mounted.mnt
    fd = os.open(m / "synced.txt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"durable\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(m / "docs" / "guide.txt", os.O_WRONLY)
    try:
        os.pwrite(fd, b"DATASYNC", 4096)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.mkdir(m / "newdir")
    os.rename(m / "run.sh", m / "newdir" / "run.sh")
    dfd = os.open(m / "newdir", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    mounted.kill_daemon()
    with open(mounted.store / "behind.log", "r+b") as f:
        f.truncate(0)  # writes acknowledged in C and not yet stored: only fsync can have stored them
    again = mount_factory(mounted.repo)
    assert (again.mnt / "synced.txt").read_bytes() == b"durable\n"
    want = bytearray(b"line\n" * 5000)
    want[4096:4104] = b"DATASYNC"
    assert (again.mnt / "docs" / "guide.txt").read_bytes() == want
    assert not (again.mnt / "run.sh").exists()
    assert (again.mnt / "newdir" / "run.sh").read_text() == "#!/bin/sh\necho run\n"


def test_statfs_reports_the_store_file_system(sample: Mount) -> None:
    """statfs answers for the file system the store fills (sandwiched between two
    looks at it, as the free counts move), in blocks of the store's block size."""
    before = os.statvfs(sample.store)
    s = os.statvfs(sample.mnt)
    after = os.statvfs(sample.store)
    root = Mount(sample.repo, sample.mnt.parent, sample.store)  # the shared mount's control dir
    assert s.f_bsize == root.ctl_ok({"cmd": "status"})["block_size"]
    assert (s.f_frsize, s.f_blocks, s.f_files) == (before.f_frsize, before.f_blocks, before.f_files)
    slack = 256  # blocks or inodes another process may take or give back meanwhile
    for field in ("f_bfree", "f_bavail", "f_ffree"):
        lo, hi = sorted((getattr(before, field), getattr(after, field)))
        assert lo - slack <= getattr(s, field) <= hi + slack, field
    assert s.f_namemax == 255
    df = subprocess.run(["df", "-P", "-B", str(s.f_frsize), str(sample.mnt)], capture_output=True,
                        text=True, check=True).stdout.splitlines()
    assert int(df[1].split()[1]) == s.f_blocks


def test_large_file_roundtrip(mounted: Mount, mount_factory) -> None:
    data = random.Random(1234).randbytes(8 * 1024 * 1024 + 123)
    p = mounted.mnt / "big.bin"
    with open(p, "wb") as f:
        # odd-sized writes, so nothing arrives page-aligned by accident
        for i in range(0, len(data), 100_003):
            f.write(data[i:i + 100_003])
    assert p.stat().st_size == len(data)
    assert p.read_bytes() == data
    _drop_cache(p)
    with open(p, "rb") as f:
        f.seek(3_000_001)
        assert f.read(1_000_000) == data[3_000_001:4_000_001]
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    assert (m.mnt / "big.bin").read_bytes() == data


def test_many_files_in_one_dir(sample: Mount, tmp_path: Path) -> None:
    native = tmp_path / "native-many"
    native.mkdir()
    d = sample.mnt / "many"
    d.mkdir()
    for root in (native, d):
        for i in range(2000):
            (root / f"file-{i:05d}.txt").write_bytes(f"{i}\n".encode())
    assert sorted(os.listdir(d)) == sorted(os.listdir(native))
    assert len(os.listdir(d)) == 2000
    # readdir with a fresh directory handle, through scandir and through ls
    assert sorted(e.name for e in os.scandir(d)) == sorted(os.listdir(native))
    ls = subprocess.run(["ls", "-1", "-f", str(d)], capture_output=True, text=True, check=True)
    assert sorted(ls.stdout.split()) == sorted(os.listdir(native) + [".", ".."])
    # removing every other file while listing stays consistent
    for i in range(0, 2000, 2):
        os.unlink(d / f"file-{i:05d}.txt")
        os.unlink(native / f"file-{i:05d}.txt")
    assert sorted(os.listdir(d)) == sorted(os.listdir(native))
    assert tree_digest(str(d)) == tree_digest(str(native))


def test_rename_lower_dir_with_children(sample: Mount) -> None:
    src = sample.mnt / "src"
    before = tree_digest(str(src))
    os.rename(src, sample.mnt / "source")
    assert not src.exists()
    assert tree_digest(str(sample.mnt / "source")) == before
    # the renamed directory is fully usable: new files, edits, listing
    (sample.mnt / "source" / "pkg" / "extra.py").write_text("x = 1\n")
    assert sorted(os.listdir(sample.mnt / "source" / "pkg")) == ["__init__.py", "extra.py", "util.py"]
    # a new directory at the old name is empty: nothing of the lower shows through
    src.mkdir()
    assert os.listdir(src) == []


def test_rename_errnos(sample: Mount) -> None:
    m = sample.mnt
    (m / "full").mkdir()
    (m / "full" / "x").write_text("x")

    def err(fn) -> str:
        return outcome(fn)[1] if outcome(fn)[0] == "err" else "ok"
    assert err(lambda: os.rename(m / "README.md", m / "docs")) == "EISDIR"
    assert err(lambda: os.rename(m / "docs", m / "README.md")) == "ENOTDIR"
    assert err(lambda: os.rename(m / "docs", m / "full")) == "ENOTEMPTY"
    assert err(lambda: os.rename(m / "src", m / "src" / "pkg" / "inner")) == "EINVAL"
    assert err(lambda: renameat2(m / "README.md", m / "bin.dat", RENAME_NOREPLACE)) == "EEXIST"
    assert err(lambda: renameat2(m / "README.md", m / "nope", RENAME_EXCHANGE)) == "ENOENT"
    assert err(lambda: renameat2(m / "a", m / "b", RENAME_NOREPLACE | RENAME_EXCHANGE)) == "EINVAL"
    # rename a dir over an empty dir works
    assert err(lambda: os.rename(m / "docs", m / "empty")) == "ok"
    assert (m / "empty" / "guide.txt").stat().st_size == 25000
    # exchange a file and a directory
    assert err(lambda: renameat2(m / "README.md", m / "src", RENAME_EXCHANGE)) == "ok"
    assert (m / "src").read_text() == "# demo\n\nhello\n"
    assert (m / "README.md" / "main.py").exists()


RENAME_WHITEOUT = 4


def test_rename_with_unknown_flags_is_einval(sample: Mount) -> None:
    m = sample.mnt
    before = tree_digest(str(m))
    # as root the kernel passes RENAME_WHITEOUT on to the file system: it must not rename
    assert outcome(lambda: renameat2(m / "README.md", m / "moved.md", RENAME_WHITEOUT)) == ("err", "EINVAL")
    assert outcome(lambda: renameat2(m / "README.md", m / "bin.dat", RENAME_WHITEOUT)) == ("err", "EINVAL")
    assert tree_digest(str(m)) == before


def test_overlay_rename_refuses_unknown_flags(tmp_path: Path) -> None:
    from overlayckpt.core.journal import Caller
    from overlayckpt.errors import FsError
    from overlayckpt.records import ROOT_INO
    from overlayckpt.service.session import Session
    repo = make_repo(tmp_path / "repo")
    s = Session.open(str(tmp_path / "store"), str(repo), create=True)
    try:
        me = Caller(os.getpid(), "test")
        for flags in (RENAME_WHITEOUT, 8, RENAME_NOREPLACE | RENAME_EXCHANGE):
            with pytest.raises(FsError) as e:
                s.overlay.rename(me, ROOT_INO, b"README.md", ROOT_INO, b"moved.md", flags)
            assert e.value.errno == errno.EINVAL
        assert s.overlay.live(lambda r: s.overlay.resolve(r, "README.md")) > 0
        assert s.store.read(lambda r: r.count(b"journal")) == 0  # nothing recorded: nothing changed
    finally:
        s.close()


def test_rmdir_errnos(sample: Mount) -> None:
    m = sample.mnt
    assert outcome(lambda: os.rmdir(m / "src"))[1] == "ENOTEMPTY"
    assert outcome(lambda: os.rmdir(m / "README.md"))[1] == "ENOTDIR"
    assert outcome(lambda: os.rmdir(m / "missing"))[1] == "ENOENT"
    assert outcome(lambda: os.rmdir(m / "empty")) == ("ok", None)
    # a lower directory whose children were all removed can go
    for n in os.listdir(m / "docs"):
        os.unlink(m / "docs" / n)
    os.rmdir(m / "docs")
    assert not (m / "docs").exists()
    (m / "docs").mkdir()
    assert os.listdir(m / "docs") == []


def test_exclusive_create_and_missing_open(sample: Mount) -> None:
    m = sample.mnt
    assert outcome(lambda: os.open(m / "README.md", os.O_CREAT | os.O_EXCL | os.O_WRONLY))[1] == "EEXIST"
    assert outcome(lambda: os.open(m / "link", os.O_CREAT | os.O_EXCL | os.O_WRONLY))[1] == "EEXIST"
    assert outcome(lambda: os.open(m / "nothing", os.O_RDONLY))[1] == "ENOENT"
    assert outcome(lambda: os.open(m / "no" / "thing", os.O_CREAT | os.O_WRONLY))[1] == "ENOENT"
    assert outcome(lambda: os.open(m / "README.md" / "x", os.O_RDONLY))[1] == "ENOTDIR"
    assert outcome(lambda: os.open(m / "src", os.O_WRONLY))[1] == "EISDIR"
    fd = os.open(m / "fresh", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    os.close(fd)
    assert stat.S_IMODE(os.stat(m / "fresh").st_mode) == 0o640 & ~_umask()


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def test_hard_links_and_symlinks(sample: Mount) -> None:
    m = sample.mnt
    os.link(m / "run.sh", m / "run2.sh")
    assert os.stat(m / "run.sh").st_nlink == 2
    assert os.stat(m / "run.sh").st_ino == os.stat(m / "run2.sh").st_ino
    with open(m / "run2.sh", "a") as f:
        f.write("echo more\n")
    assert (m / "run.sh").read_text() == "#!/bin/sh\necho run\necho more\n"
    assert stat.S_IMODE(os.stat(m / "run2.sh").st_mode) == 0o755
    os.chmod(m / "run2.sh", 0o700)
    assert stat.S_IMODE(os.stat(m / "run.sh").st_mode) == 0o700
    assert outcome(lambda: os.link(m / "src", m / "src2"))[1] == "EPERM"
    os.symlink("src/main.py", m / "sl")
    assert os.readlink(m / "sl") == "src/main.py"
    assert (m / "sl").read_text().startswith("import pkg.util")
    os.symlink("dangling", m / "dl")
    assert outcome(lambda: os.stat(m / "dl"))[1] == "ENOENT"
    assert os.lstat(m / "dl").st_size == len("dangling")
    # lower hard links stay linked after copy-up of one side
    (m / "hardlink.md").write_text("changed\n")
    assert (m / "README.md").read_text() == "changed\n"
    assert os.stat(m / "README.md").st_ino == os.stat(m / "hardlink.md").st_ino


def test_chmod_utime_xattr(sample: Mount) -> None:
    m = sample.mnt
    p = m / "README.md"
    os.chmod(p, 0o600)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    os.utime(p, ns=(1_000_000_000, 2_000_000_123))
    s = os.stat(p)
    assert s.st_mtime_ns == 2_000_000_123
    assert s.st_atime_ns == 1_000_000_000
    os.setxattr(p, "user.k", b"v1")
    assert os.getxattr(p, "user.k") == b"v1"
    assert outcome(lambda: os.setxattr(p, "user.k", b"v2", os.XATTR_CREATE))[1] == "EEXIST"
    assert outcome(lambda: os.setxattr(p, "user.z", b"v2", os.XATTR_REPLACE))[1] == "ENODATA"
    os.setxattr(p, "user.k", b"v2", os.XATTR_REPLACE)
    assert os.getxattr(m / "hardlink.md", "user.k") == b"v2"
    assert "user.k" in os.listxattr(p)
    os.removexattr(p, "user.k")
    assert outcome(lambda: os.getxattr(p, "user.k"))[1] == "ENODATA"
    assert outcome(lambda: os.removexattr(p, "user.k"))[1] == "ENODATA"
    assert outcome(lambda: os.setxattr(m / "link", "user.k", b"v", follow_symlinks=False))[1] == "EPERM"


def test_write_clears_setuid(sample: Mount, tmp_path: Path) -> None:
    """A write by anyone (root too) clears S_ISUID, as on a native filesystem."""
    results = []
    for root in (tmp_path, sample.mnt):
        p = root / "suid"
        p.write_bytes(b"#!/bin/sh\n")
        os.chmod(p, 0o4755)
        with open(p, "ab") as f:
            f.write(b"echo\n")
        results.append(stat.S_IMODE(os.stat(p).st_mode))
    assert results[1] == results[0]


def test_rename_over_open_file_keeps_victim_readable(sample: Mount) -> None:
    m = sample.mnt
    victim = os.open(m / "src" / "main.py", os.O_RDONLY)
    try:
        (m / "new.py").write_text("replacement\n")
        os.rename(m / "new.py", m / "src" / "main.py")
        assert (m / "src" / "main.py").read_text() == "replacement\n"
        assert os.pread(victim, 100, 0) == b"import pkg.util\nprint(pkg.util.answer())\n"
        assert os.fstat(victim).st_nlink == 0
    finally:
        os.close(victim)


def test_rename_onto_own_hard_link_is_a_no_op(sample: Mount, tmp_path: Path) -> None:
    results = []
    native = tmp_path / "native"
    subprocess.run(["cp", "-a", str(sample.repo), str(native)], check=True)
    for root in (native, sample.mnt):
        os.rename(root / "README.md", root / "hardlink.md")
        results.append((sorted(os.listdir(root)), os.stat(root / "README.md").st_nlink))
    assert results[1] == results[0]
    assert tree_digest(str(sample.mnt)) == tree_digest(str(native))


def test_mtime_and_ctime_move_forward(sample: Mount) -> None:
    """make and git rely on mtime changing on write and ctime on chmod."""
    p = sample.mnt / "src" / "main.py"
    os.utime(p, ns=(10**9, 10**9))
    assert os.stat(p).st_mtime_ns == 10**9
    with open(p, "a") as f:
        f.write("# more\n")
    after_write = os.stat(p)
    assert after_write.st_mtime_ns > 10**9
    assert after_write.st_ctime_ns >= after_write.st_mtime_ns  # a write changes both
    # the same after the daemon has served it (attributes were not only kernel-local)
    os.utime(p, ns=(10**9, 10**9))
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"#", 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_mtime_ns > 10**9
    before = os.stat(p)
    os.chmod(p, 0o600)
    after = os.stat(p)
    assert after.st_ctime_ns > before.st_ctime_ns  # a chmod changes ctime, not mtime
    assert after.st_mtime_ns == before.st_mtime_ns
    # creating an entry changes the directory's mtime
    d = sample.mnt / "docs"
    os.utime(d, ns=(10**9, 10**9))
    (d / "new.txt").write_text("x")
    assert os.stat(d).st_mtime_ns > 10**9


def test_mtime_survives_remount(mounted: Mount, mount_factory) -> None:
    p = mounted.mnt / "README.md"
    p.write_text("edited\n")
    os.utime(p, ns=(1_500_000_000_000_000_000, 1_600_000_000_123_456_789))
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    s = os.stat(m.mnt / "README.md")
    assert s.st_mtime_ns == 1_600_000_000_123_456_789
    assert (m.mnt / "README.md").read_text() == "edited\n"


def test_chown(sample: Mount, tmp_path: Path) -> None:
    results = []
    for root in (tmp_path, sample.mnt):
        p = root / "owned"
        p.write_text("x")
        os.chmod(p, 0o6755)
        os.chown(p, 1234, 5678)
        s = os.stat(p)
        os.lchown(root / "owned", 4321, -1)
        s2 = os.stat(p)
        results.append((s.st_uid, s.st_gid, s2.st_uid, s2.st_gid, stat.S_IMODE(s2.st_mode)))
    assert results[1] == results[0]


def test_posix_fallocate_and_o_append_pwrite(sample: Mount, tmp_path: Path) -> None:
    results = []
    for root in (tmp_path, sample.mnt):
        p = root / "alloc.bin"
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"head")
            os.posix_fallocate(fd, 0, 100_000)
            size = os.fstat(fd).st_size
            data = os.pread(fd, 200_000, 0)
        finally:
            os.close(fd)
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        try:
            os.pwrite(fd, b"TAIL", 0)  # Linux: O_APPEND wins over the offset
        finally:
            os.close(fd)
        results.append((size, data, p.read_bytes()))
    assert results[1] == results[0]


def test_bad_fd_modes(sample: Mount, tmp_path: Path) -> None:
    """Writing through a read-only fd and reading through a write-only one fail with the
    errnos of a native file system, and change nothing: no journal entry either."""
    native = tmp_path / "native"
    subprocess.run(["cp", "-a", str(sample.repo), str(native)], check=True)
    shared = Mount(sample.repo, sample.mnt.parent, sample.store)  # its control dir is at the root
    journal = shared.ctl_ok({"cmd": "status"})["journal"]
    results = []
    for root in (native, sample.mnt):
        p = root / "README.md"
        got = []
        fd = os.open(p, os.O_RDONLY)
        try:
            got += [outcome(lambda: os.write(fd, b"x")), outcome(lambda: os.pwrite(fd, b"x", 3)),
                    outcome(lambda: os.ftruncate(fd, 0)), outcome(lambda: os.pread(fd, 4, 0))]
        finally:
            os.close(fd)
        fd = os.open(p, os.O_WRONLY)
        try:
            got += [outcome(lambda: os.read(fd, 10)), outcome(lambda: os.pread(fd, 10, 0))]
        finally:
            os.close(fd)
        fd = os.open(p, os.O_PATH)
        try:
            got += [outcome(lambda: os.write(fd, b"x")), outcome(lambda: os.read(fd, 1))]
        finally:
            os.close(fd)
        results.append((got, p.read_bytes(), os.stat(p).st_size))
    assert results[1] == results[0]
    assert results[1][1] == b"# demo\n\nhello\n"
    assert shared.ctl_ok({"cmd": "status"})["journal"] == journal, "a failed call was recorded"


def test_fifo_and_exchange_of_lower_dirs(sample: Mount, tmp_path: Path) -> None:
    native = tmp_path / "native"
    subprocess.run(["cp", "-a", str(sample.repo), str(native)], check=True)
    for root in (native, sample.mnt):
        os.mkfifo(root / "fifo", 0o640)
        renameat2(root / "src", root / "docs", RENAME_EXCHANGE)
        (root / "docs" / "pkg" / "added.py").write_text("A = 1\n")
        os.rename(root / "src" / "guide.txt", root / "docs" / "pkg" / "guide.txt")
        os.rmdir(root / "src")
    assert tree_digest(str(sample.mnt)) == tree_digest(str(native))


def test_names_and_paths_at_the_limits_as_natively(sample: Mount, tmp_path: Path) -> None:
    """pjdfstest's 02.t and 03.t: a 256-byte name is ENAMETOOLONG for every call (a
    lookup as a create), and directories nest down to a path of 4,095 bytes, which is
    longer than a key of the store."""
    native = tmp_path / "native"
    native.mkdir()
    long_name = "n" * 256

    def calls(root: Path) -> list[tuple]:
        p = root / long_name
        out = [outcome(c) for c in (
            lambda: os.stat(p), lambda: os.chmod(p, 0o600), lambda: os.unlink(p),
            lambda: os.rmdir(p), lambda: os.truncate(p, 0), lambda: os.rename(root / "nope", p),
            lambda: os.link(root / "nope", p), lambda: os.mkdir(p), lambda: open(p, "w"),
            lambda: os.symlink("x", p))]
        # 128-byte names down to PATH_MAX (4,096 with its NUL): each call as natively
        here = root
        names: list[tuple] = []
        while len(str(here)) + 129 < 4095:
            here = here / (f"d{len(names):03d}" + "x" * 124)
            names.append(outcome(lambda: os.mkdir(here)))
        out.append(tuple(names))
        last = here / ("f" * (4094 - len(str(here)) - 1))
        for c in (lambda: last.write_text("x"), lambda: os.stat(last).st_size,
                  lambda: os.chmod(last, 0o600), lambda: os.rename(last, here / "g"),
                  lambda: os.link(here / "g", last), lambda: os.unlink(here / "g"),
                  lambda: os.stat(str(last) + "z"), lambda: os.mkfifo(here / "fifo"),
                  lambda: os.rmdir(here)):
            out.append(outcome(c))
        return out

    # the same lengths below both: each root is padded to one length
    length = max(len(str(native)), len(str(sample.mnt))) + 2
    roots = [r / ("m" * (length - len(str(r)) - 1)) for r in (native, sample.mnt)]
    for r in roots:
        r.mkdir()
    want = calls(roots[0])
    assert calls(roots[1]) == want
    assert ("ok", None) in want and ("err", "ENAMETOOLONG") in want
