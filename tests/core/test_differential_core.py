"""Differential test: one seeded random sequence of operations on a native directory (os.*)
and through the Overlay API must give the same results, errnos and trees; and every named
checkpoint taken on the way must later show the native tree as it was then."""
from __future__ import annotations

import ctypes
import errno
import os
import random
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from overlayckpt.core.overlay import RENAME_EXCHANGE, RENAME_NOREPLACE, Overlay
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import FsError
from overlayckpt.service.session import Session

from .helpers_core import ME, ino, make_small_repo, native_tree, tree_of

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
POOL = ["a", "b", "d", "e", "README.md", "hardlink.md", "link", "src", "docs", "empty",
        "d/a", "d/b", "e/a", "e/d", "src/main.py", "src/pkg", "src/pkg/util.py", "src/x",
        "docs/guide.txt", "empty/a", "a/x"]
FILE_MODES = [0o600, 0o640, 0o644, 0o755]
DIR_MODES = [0o700, 0o750, 0o755]
# more seeds for a longer hunt: OVERLAYCKPT_DIFF_SEEDS=500 make test-fast
SEEDS = int(os.environ.get("OVERLAYCKPT_DIFF_SEEDS", "12"))


def renameat2(old: str, new: str, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Native:
    def __init__(self, root: Path) -> None:
        self.root = root

    def p(self, path: str) -> str:
        return str(self.root / path)

    def create(self, path: str, mode: int) -> None:
        os.close(os.open(self.p(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode))
        os.chmod(self.p(path), mode)  # whatever the umask

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self.p(path), mode)
        os.chmod(self.p(path), mode)

    def symlink(self, path: str, target: bytes) -> None:
        os.symlink(target, self.p(path))

    def write(self, path: str, off: int, data: bytes) -> None:
        fd = os.open(self.p(path), os.O_WRONLY)
        try:
            os.pwrite(fd, data, off)
        finally:
            os.close(fd)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(self.p(path), size)

    def unlink(self, path: str) -> None:
        os.unlink(self.p(path))

    def rmdir(self, path: str) -> None:
        os.rmdir(self.p(path))

    def rename(self, a: str, b: str, flags: int) -> None:
        renameat2(self.p(a), self.p(b), flags)

    def link(self, a: str, b: str) -> None:
        os.link(self.p(a), self.p(b), follow_symlinks=False)

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self.p(path), mode)

    def setxattr(self, path: str, name: str, value: bytes | None) -> None:
        if value is None:
            os.removexattr(self.p(path), name)
        else:
            os.setxattr(self.p(path), name, value)


class ThroughOverlay:
    """The same operations, by path, as the FUSE adapter would make them by inode."""

    def __init__(self, ov: Overlay) -> None:
        self.ov = ov

    def _parent(self, path: str) -> tuple[int, bytes]:
        """The parent's inode, as the kernel's path walk finds it: a directory, or ENOTDIR
        (FUSE never receives a request under a parent that is not one)."""
        parent, _, name = path.rpartition("/")
        i = ino(self.ov, parent)
        if not self.ov.live(lambda r: self.ov.node(r, i)).is_dir:
            raise FsError(errno.ENOTDIR)
        return i, os.fsencode(name)

    def create(self, path: str, mode: int) -> None:
        self.ov.create(ME, *self._parent(path), stat.S_IFREG | mode, 0, 0)

    def mkdir(self, path: str, mode: int) -> None:
        self.ov.create(ME, *self._parent(path), stat.S_IFDIR | mode, 0, 0)

    def symlink(self, path: str, target: bytes) -> None:
        self.ov.create(ME, *self._parent(path), stat.S_IFLNK | 0o777, 0, 0, target=target)

    def write(self, path: str, off: int, data: bytes) -> None:
        self.ov.write(ME, ino(self.ov, path), off, data)

    def truncate(self, path: str, size: int) -> None:
        self.ov.setattr(ME, ino(self.ov, path), size=size)

    def unlink(self, path: str) -> None:
        self.ov.remove(ME, *self._parent(path), False)

    def rmdir(self, path: str) -> None:
        self.ov.remove(ME, *self._parent(path), True)

    def rename(self, a: str, b: str, flags: int) -> None:
        pa, pb = self._parent(a), self._parent(b)  # the kernel resolves both parents first
        self.ov.rename(ME, pa[0], pa[1], pb[0], pb[1], flags)

    def link(self, a: str, b: str) -> None:
        src = ino(self.ov, a)
        self.ov.link(ME, src, *self._parent(b))

    def chmod(self, path: str, mode: int) -> None:
        self.ov.setattr(ME, ino(self.ov, path), mode=mode)

    def setxattr(self, path: str, name: str, value: bytes | None) -> None:
        self.ov.setxattr(ME, ino(self.ov, path), name.encode(), value)


def errname(e: int | None) -> str | int | None:
    """An outcome's errno by name (as it is if unnamed; None: it succeeded)."""
    return None if e is None else errno.errorcode.get(e, e)


def outcome(fn: Callable[..., None], *args: Any) -> int | None:
    try:
        fn(*args)
    except FsError as e:
        return e.errno
    except OSError as e:
        return e.errno
    return None


def full_native(root: Path) -> dict[str, tuple]:
    """native_tree plus what it leaves out: link counts of files and user xattrs."""
    out = {}
    for path, v in native_tree(root).items():
        p = root / path
        st = os.lstat(p)
        nlink = st.st_nlink if stat.S_ISREG(st.st_mode) else None
        xa = () if stat.S_ISLNK(st.st_mode) else tuple(sorted(
            (n.encode(), os.getxattr(p, n)) for n in os.listxattr(p) if n.startswith("user.")))
        out[path] = (*v, nlink, xa)
    return out


def full_overlay(ov: Overlay) -> dict[str, tuple]:
    base = tree_of(ov)

    def fn(r: Any) -> dict[str, tuple]:
        out = {}
        for path, i, n in ov.walk(r):
            xa = () if n.is_link else tuple(sorted(
                (k, v) for k, v in ov.xattrs(r, i, n).items() if k.startswith(b"user.")))
            out[path] = (*base[path], n.nlink if n.is_reg else None, xa)
        return out
    return ov.live(fn)


def random_op(rng: random.Random, native: Native) -> tuple[str, tuple] | None:
    """An operation and its arguments, or None where the kernel (not the overlay) would
    decide: paths through a symlink, writes to what open(2) would refuse, renames into
    the source's own subtree, xattrs on symlinks."""
    path = rng.choice(POOL)
    parts = path.split("/")
    for i in range(1, len(parts)):
        if os.path.islink(native.p("/".join(parts[:i]))):
            return None
    kind = rng.choices(["create", "mkdir", "symlink", "write", "truncate", "unlink", "rmdir",
                        "rename", "link", "chmod", "setxattr", "removexattr"],
                       [3, 2, 1, 6, 2, 2, 1, 4, 1, 1, 1, 1])[0]
    try:
        st: os.stat_result | None = os.lstat(native.p(path))
    except OSError:
        st = None
    is_reg = st is not None and stat.S_ISREG(st.st_mode)
    is_link = st is not None and stat.S_ISLNK(st.st_mode)
    if kind == "create":
        return kind, (path, rng.choice(FILE_MODES))
    if kind == "mkdir":
        return kind, (path, rng.choice(DIR_MODES))
    if kind == "symlink":
        return kind, (path, rng.choice([b"README.md", b"../a", b"nowhere", b"d/a"]))
    if kind == "write":
        if not is_reg:
            return None
        size = rng.choice([1, 10, 4096, 5000])
        data = bytes([rng.randrange(256)]) * size if rng.random() < 0.5 else rng.randbytes(size)
        return kind, (path, rng.choice([0, 1, 4095, 4096, 8000, 20000]), data)
    if kind == "truncate":
        return (kind, (path, rng.choice([0, 1, 100, 4096, 5000, 30000]))) if is_reg else None
    if kind in ("unlink", "rmdir"):
        return kind, (path,)
    if kind in ("rename", "link"):
        other = rng.choice(POOL)
        if other.startswith(path + "/") or path.startswith(other + "/"):
            return None
        oparts = other.split("/")
        if any(os.path.islink(native.p("/".join(oparts[:i]))) for i in range(1, len(oparts))):
            return None
        if kind == "link":
            return kind, (path, other)
        return kind, (path, other, rng.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]))
    if kind == "chmod":
        if st is None or is_link:
            return None
        return kind, (path, rng.choice(DIR_MODES if stat.S_ISDIR(st.st_mode) else FILE_MODES))
    if st is None or is_link:
        return None
    name = rng.choice(["user.one", "user.two"])
    return "setxattr", (path, name, rng.randbytes(rng.randrange(1, 20)) if kind == "setxattr" else None)


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_random_operations_match_a_native_directory(seed: int, open_session: Callable[..., Session],
                                                          tmp_path: Path) -> None:
    repo = make_small_repo(tmp_path / "repo")
    native_root = make_small_repo(tmp_path / "native")  # the same tree, made the same way
    s = open_session(repo, window=0)
    native, through = Native(native_root), ThroughOverlay(s.overlay)
    origin = full_native(native_root)
    assert full_overlay(s.overlay) == origin
    rng = random.Random(seed)
    history: list[str] = []
    recorded: dict[str, dict[str, tuple]] = {}
    steps = 0
    while steps < 150:
        op = random_op(rng, native)
        if op is None:
            continue
        steps += 1
        kind, args = op
        history.append(f"{kind}{tuple(a if not isinstance(a, bytes) or len(a) < 12 else a[:8] for a in args)}")
        want = outcome(getattr(native, kind), *args)
        got = outcome(getattr(through, kind), *args)
        assert got == want, (f"seed {seed}, step {steps}: native {errname(want)}, "
                             f"overlay {errname(got)}; last ops:\n" + "\n".join(history[-8:]))
        if steps % 25 == 0:
            assert full_overlay(s.overlay) == full_native(native_root), f"seed {seed}: {history[-8:]}"
            name = f"step{steps}"
            Timeline(s.ctx).checkpoint(name, None, ME)
            recorded[name] = native_tree(native_root)
    assert full_overlay(s.overlay) == full_native(native_root)
    # the recorded checkpoints: each still shows the native tree as it was then
    tl = Timeline(s.ctx)
    for name, tree in recorded.items():
        assert tree_of(s.overlay, lambda r: tl.state(r, tl.get(r, name))) == tree, name
    # and a restore to the origin gives back the repo's tree (with counts and xattrs)
    await tl.restore(0, ME)
    assert full_overlay(s.overlay) == origin
