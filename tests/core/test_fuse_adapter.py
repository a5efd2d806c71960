"""The FUSE adapter against a small fake core, without a mount (as borg's fuse_test.py does).

The fake stands in for the Overlay only to check the adapter's one job besides
dispatch: FsError(e) becomes FUSEError(e), an OSError keeps its errno, and any
other exception is logged and answered with EIO (never a dead mount).
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest

from overlayckpt.errors import FsError
from overlayckpt.fuse.control import VIEW_INO_BASE
from overlayckpt.fuse.ops import KERNEL_HANDLE, Operations
from overlayckpt.records import CONTROL_INO_BASE, ROOT_INO, Node


class FakeCore:
    """Every core method raises `exc` (or, with exc None, returns `value`); calls are recorded."""

    bs = 4096

    def __init__(self, exc: BaseException | None = None, value: Any = None) -> None:
        self.exc, self.value = exc, value
        self.parents: dict[int, tuple[int, bytes]] = {}
        # a store never ahead of its disk (no write waits: keep_up), with no deferred writes
        self.store = SimpleNamespace(writes_wait=True, too_far_ahead=lambda: False,
                                     deferring=lambda ino: False, store_deferred=lambda: None,
                                     deferred=lambda: 0)
        self.calls: list[tuple[str, tuple]] = []

    def live(self, fn: Any) -> Any:
        return fn(None)  # the state argument: the fake's methods ignore it

    peek = live

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            if self.exc is not None:
                raise self.exc
            return self.value
        return method


class FakeCtx(pyfuse3.RequestContext):
    """A RequestContext with its fields given: pyfuse3's own has them read-only, set by
    pyfuse3 alone for a request (this one overrides their properties)."""

    def __init__(self, pid: int, uid: int, gid: int, umask: int) -> None:
        self._fields = (pid, uid, gid, umask)

    @property
    def pid(self) -> int:
        return self._fields[0]

    @property
    def uid(self) -> int:
        return self._fields[1]

    @property
    def gid(self) -> int:
        return self._fields[2]

    @property
    def umask(self) -> int:
        return self._fields[3]


CTX = FakeCtx(pid=0, uid=1000, gid=1000, umask=0o022)
FILE = Node(stat.S_IFREG | 0o644, 0, 0, 3, 1, 1, 1, 1, 0, None, 0, 0, None)


def ops(core: FakeCore) -> Operations:
    return Operations(core, control=None)  # type: ignore[arg-type]  # FakeCore: the core's methods ops calls


def setattr_fields(**set_: bool) -> Any:
    """pyfuse3's SetattrFields is read-only from Python: the same fields, settable."""
    names = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid",
             "update_gid", "update_size")
    return SimpleNamespace(**{n: set_.get(n, False) for n in names})


# every handler that reaches the core, called with plain arguments
CALLS = {
    "getattr": lambda o: o.getattr(5, CTX),
    "lookup": lambda o: o.lookup(ROOT_INO, b"x", CTX),
    "setattr": lambda o: o.setattr(5, pyfuse3.EntryAttributes(), setattr_fields(update_size=True),
                                   None, CTX),
    "readlink": lambda o: o.readlink(5, CTX),
    "mknod": lambda o: o.mknod(ROOT_INO, b"n", stat.S_IFIFO | 0o644, 0, CTX),
    "mkdir": lambda o: o.mkdir(ROOT_INO, b"d", 0o755, CTX),
    "symlink": lambda o: o.symlink(ROOT_INO, b"l", b"target", CTX),
    "create": lambda o: o.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, CTX),
    "unlink": lambda o: o.unlink(ROOT_INO, b"f", CTX),
    "rmdir": lambda o: o.rmdir(ROOT_INO, b"d", CTX),
    "rename": lambda o: o.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0, CTX),
    "link": lambda o: o.link(5, ROOT_INO, b"b", CTX),
    "open_trunc": lambda o: o.open(5, os.O_WRONLY | os.O_TRUNC, CTX),
    "read": lambda o: o.read(KERNEL_HANDLE | 5, 0, 10),
    "readdir": lambda o: o.readdir(KERNEL_HANDLE | 5, 0, None),
    "getxattr": lambda o: o.getxattr(5, b"user.x", CTX),
    "listxattr": lambda o: o.listxattr(5, CTX),
    "setxattr": lambda o: o.setxattr(5, b"user.x", b"v", CTX),
    "removexattr": lambda o: o.removexattr(5, b"user.x", CTX),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("err", [errno.EEXIST, errno.ESTALE])
async def test_fs_errors_become_fuse_errors_with_the_same_errno(call: str, err: int) -> None:
    core = FakeCore(FsError(err))
    with pytest.raises(pyfuse3.FUSEError) as e:
        await CALLS[call](ops(core))
    assert e.value.errno == err
    assert core.calls, "the handler must have reached the core"


@pytest.mark.parametrize("call", sorted(CALLS))
async def test_an_unexpected_exception_is_logged_and_answered_with_eio(
        call: str, caplog: pytest.LogCaptureFixture) -> None:
    core = FakeCore(RuntimeError("core bug"))
    with caplog.at_level(logging.ERROR, logger="overlayckpt.fuse.ops"):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await CALLS[call](ops(core))
    assert e.value.errno == errno.EIO
    assert any(r.exc_info and "core bug" in str(r.exc_info[1]) for r in caplog.records)


async def test_an_oserror_keeps_its_errno_and_one_without_errno_is_eio() -> None:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops(FakeCore(OSError(errno.EACCES, "denied"))).unlink(ROOT_INO, b"f", CTX)
    assert e.value.errno == errno.EACCES
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops(FakeCore(OSError("no errno"))).unlink(ROOT_INO, b"f", CTX)
    assert e.value.errno == errno.EIO


async def test_lookup_of_a_missing_name_is_a_cached_negative_entry_not_an_error() -> None:
    entry = await ops(FakeCore(FsError(errno.ENOENT))).lookup(ROOT_INO, b"x", CTX)
    assert entry.st_ino == 0 and entry.entry_timeout > 0


async def test_write_through_an_open_handle_maps_errors() -> None:
    core = FakeCore(None)
    o = ops(core)
    fh = (await o.open(5, os.O_WRONLY, CTX)).fh
    core.exc = FsError(errno.ENOSPC)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await o.write(fh, 0, b"data")
    assert e.value.errno == errno.ENOSPC
    assert core.calls[-1] == ("write", (o.handles[fh].caller, 5, 0, b"data"))


@pytest.mark.parametrize("ino, err", [(CONTROL_INO_BASE + 3, errno.EPERM), (VIEW_INO_BASE + 1, errno.EROFS)])
async def test_no_changes_inside_the_control_directory_or_views(ino: int, err: int) -> None:
    core = FakeCore(None)
    o = ops(core)
    for call in (lambda: o.unlink(ino, b"f", CTX), lambda: o.mkdir(ino, b"d", 0o755, CTX),
                 lambda: o.rename(ROOT_INO, b"a", ino, b"b", 0, CTX),
                 lambda: o.setxattr(ino, b"user.x", b"v", CTX)):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await call()
        assert e.value.errno == err
    assert core.calls == []  # refused before the core


@pytest.mark.parametrize("name", [b"system.posix_acl_access", b"security.capability"])
async def test_acls_and_capabilities_are_not_supported(name: bytes) -> None:
    core = FakeCore(None)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops(core).setxattr(5, name, b"v", CTX)
    assert e.value.errno == errno.EOPNOTSUPP and core.calls == []


async def test_capability_lookups_answer_enodata_without_the_core() -> None:
    core = FakeCore(RuntimeError("must not be called"))
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops(core).getxattr(5, b"security.capability", CTX)
    assert e.value.errno == errno.ENODATA and core.calls == []


async def test_flush_is_enosys() -> None:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops(FakeCore(None)).flush(1)
    assert e.value.errno == errno.ENOSYS


async def test_handlers_pass_their_arguments_to_the_core() -> None:
    core = FakeCore(None, value=(1 << 48, FILE))
    o = ops(core)
    attrs = await o.mkdir(ROOT_INO, b"d", 0o40755, CTX)
    name, args = core.calls[-1]
    assert name == "create" and args[1:] == (ROOT_INO, b"d", stat.S_IFDIR | 0o755, 1000, 1000, 0, None)
    assert attrs.st_ino == 1 << 48 and attrs.st_size == 3
    core.value = None
    await o.rename(ROOT_INO, b"a", 7, b"b", 1, CTX)
    renamed = next(args for name, args in reversed(core.calls) if name == "rename")
    assert renamed[1:] == (ROOT_INO, b"a", 7, b"b", 1)
