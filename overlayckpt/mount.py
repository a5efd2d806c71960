"""The daemon's composition root: build the parts, mount, serve, unmount, apply.

Every part gets its callbacks at construction: the kernel hooks (Kernel) go to
the session's core context and to the adapter, the C library's read-ahead and
status to the session. Order matters for in-place mounts: the repo is opened as
a directory fd (Session.open -> Lower) before the overlay is mounted on top of it.

Stopping (a signal, or `overlayckpt unmount`, which interrupts the commands first)
takes well under a second whatever runs: the commands running are cut short (their
clients read one line saying so), the loop ends, the mount goes. A command's
worker thread still reading the store after WORKERS_WAIT is abandoned: the store
is synced but not closed (LMDB must not close under a live read transaction; a
store that was not closed is checked at the next open), and the process exits.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from overlayckpt.core import writebehind
from overlayckpt.fuse import fastpath

fastpath.preload()  # before pyfuse3 binds libfuse (see fastpath.py)

import pyfuse3
import trio

from overlayckpt.core.answered import Answered
from overlayckpt.core.apply import apply_live
from overlayckpt.core.latency import Captures
from overlayckpt.core.maintenance import DEFAULT_BUDGET
from overlayckpt.core.overlay import make_durable
from overlayckpt.core.timeline import Timeline
from overlayckpt.core.workers import wait_idle
from overlayckpt.errors import UserError
from overlayckpt.fuse.control import ControlFs
from overlayckpt.fuse.forgotten import Forgotten
from overlayckpt.fuse.mounterr import reason, stderr_lines
from overlayckpt.fuse.ops import Operations
from overlayckpt.fuse.views import CheckpointViews
from overlayckpt.messages import KernelStatus
from overlayckpt.service.reader import Readers
from overlayckpt.service.session import Session
from overlayckpt.store.info import read_info, write_info

log = logging.getLogger(__name__)

# seconds: what a power cut can cost of writes nobody fsync'd (fsync syncs at once). Short,
# also because the sync point's pin keeps LMDB from reusing the pages freed since the last
SYNC_INTERVAL = 1.0
GIL_SWITCH_INTERVAL = 0.0005  # seconds (see run_daemon)
RETENTION_EVERY = 150  # sync intervals between retention checks
WORKERS_WAIT = 0.5  # seconds a stopping daemon waits for its commands' worker threads
UNMOUNT_HOLD = 2.0  # seconds SIGUSR1 (sent by `unmount`) refuses new commands for


def mount_options(allow_other: bool) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=overlayckpt", "subtype=overlayckpt", "default_permissions"}
    if allow_other:
        opts.add("allow_other")
    return opts


# A restore that changed more names than this drops every name the kernel holds at
# once (FUSE_NOTIFY_INC_EPOCH) rather than one notification per name. Below it, names
# go one by one: 3.5-6 us each in the kernel, where the epoch would have the next
# walk look every name of the tree up again, 20-50 us each (at 100,000 files, across
# 20,000 atomic saves: restore 1.04 s and walk after 3.77 s by names, 0.85 and 5.74 s
# by the epoch). The epoch bounds the restore's own time when the change is huge.
EPOCH_ABOVE = 100_000
# "entries": never the epoch (older kernels' path); "epoch": the epoch for any restore
# that changed a name (to test that path on a small tree)
INVALIDATION_ENV = "OVERLAYCKPT_KERNEL_INVALIDATION"


T = TypeVar("T")


def _drop(what: str, items: list[T], in_c: Callable[[list[T]], int | None],
          one: Callable[[T], None]) -> None:
    """Have the kernel drop what it caches of items: in C, in one call, or one by one
    through pyfuse3 without the library, or if C failed (the mount went away: pyfuse3
    then says the same per item)."""
    try:
        if in_c(items) is not None:
            return
    except OSError as e:
        log.warning("invalidating %d %s in C failed: %s", len(items), what, e)
    for item in items:
        try:
            one(item)
        except OSError:
            pass  # the kernel never cached it


class Kernel:
    """The kernel hooks of the core (core/context.py) for the mount at mountpoint."""

    def __init__(self, mountpoint: str, forgotten: Forgotten) -> None:
        self.mountpoint = mountpoint
        self.epoch = False  # whether the kernel takes FUSE_NOTIFY_INC_EPOCH (probe_epoch)
        self.forced = os.environ.get(INVALIDATION_ENV)  # "entries", "epoch" or None
        self.epoch_above = 0 if self.forced == "epoch" else EPOCH_ABOVE
        self.forgotten = forgotten  # the inodes whose attributes it made the kernel drop

    def probe_epoch(self) -> None:
        """Once mounted: whether this kernel (6.16+) drops every name at once. The probe
        is a real epoch bump, which costs nothing before anything is looked up."""
        if self.forced == "entries":
            return
        err = fastpath.notify_inc_epoch()
        self.epoch = err == 0
        if err and err != errno.ENOTCONN:
            log.info("kernel refuses FUSE_NOTIFY_INC_EPOCH (%s): names are invalidated one "
                     "by one", os.strerror(err))

    def status(self) -> KernelStatus:
        """What the status command shows of the kernel side (fuse/fastpath.py)."""
        return {"kernel_dir_cache": fastpath.active(), "repo_read_ahead": fastpath.read_ahead(),
                "dir_attrs_from_c": fastpath.counter("dir_attrs_answered"),
                "names_from_c": fastpath.counter("names_answered"),
                "absent_from_c": fastpath.counter("absent_answered"),
                "listings_from_c": fastpath.counter("listings_answered"),
                "repo_dirs_listed_in_c": fastpath.counter("lower_listed"),
                "repo_reads_in_c": fastpath.counter("lower_reads"),
                "repo_attrs_in_c": fastpath.counter("lower_attrs"),
                "attrs_from_c": fastpath.counter("attrs_answered"),
                "kernel_invalidation": "epoch" if self.epoch else "entries"}

    async def invalidate(self, inodes: list[int], entries: list[tuple[int, bytes]]) -> None:
        """Drop kernel caches of what a restore changed (in a thread: the kernel may
        have to write dirty pages back to us before it can drop them), and the
        directory attributes C answers with.

        Names: one by one (in C, one system call each, without the GIL), or for a huge
        change all at once by bumping the connection's epoch (every dentry, negative
        ones too, is looked up again at its next use).
        The epoch leaves attributes, pages and listings alone, so every inode whose
        attributes, content or listing changed is still invalidated (in C, one system
        call each, without the GIL). A walk asks next for the attributes the kernel
        dropped: Python has C answer most of them (fuse/forgotten.py)."""
        fastpath.drop_dir_attrs()
        self.forgotten.add(inodes)

        def run() -> None:
            names = entries
            if self.epoch and len(entries) > self.epoch_above:
                err = fastpath.notify_inc_epoch()
                if err == 0:
                    names = []
                else:  # (not expected once the probe passed: back to names, for good)
                    log.warning("FUSE_NOTIFY_INC_EPOCH failed (%s): names are invalidated "
                                "one by one", os.strerror(err))
                    self.epoch = False
            _drop("names", names, fastpath.notify_inval_entries,
                  lambda entry: pyfuse3.invalidate_entry(*entry))
            _drop("inodes", inodes, fastpath.notify_inval_inodes, pyfuse3.invalidate_inode)
        await trio.to_thread.run_sync(run)

    async def flush_kernel(self) -> None:
        """Have the kernel send us every dirty page before a restore."""
        await trio.to_thread.run_sync(pyfuse3.syncfs, self.mountpoint)


class Daemon:
    """Serves the mount: pyfuse3's loop, the sync points and retention, the signals."""

    def __init__(self, session: Session, control: ControlFs) -> None:
        self.session = session
        self.control = control

    async def _sync_loop(self) -> None:
        while True:
            await trio.sleep(SYNC_INTERVAL)
            await make_durable(self.session.store)

    async def _retention_loop(self) -> None:
        while True:  # (a task of its own: a long thinning never delays a sync point)
            await trio.sleep(SYNC_INTERVAL * RETENTION_EVERY)
            try:
                await self.session.maintain(DEFAULT_BUDGET)
            except Exception as e:  # ENOSPC, EIO: the next round tries again
                log.warning("thinning the history failed: %s", e)

    async def _signals(self) -> None:
        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        with trio.open_signal_receiver(*stops, signal.SIGUSR1) as sigs:
            async for signum in sigs:
                if signum == signal.SIGUSR1:  # an unmount is coming (cli/daemon.py)
                    await self.control.interrupt(UNMOUNT_HOLD)
                    continue
                log.info("signal received: unmounting")
                await self.control.stop()
                pyfuse3.terminate()
                return

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sync_loop)
            nursery.start_soon(self._retention_loop)
            nursery.start_soon(self._signals)
            if self.session.readers is not None:
                nursery.start_soon(self.session.readers.warm)
            # the file lists of restores a stopped daemon answered but had not listed
            nursery.start_soon(Timeline(self.session.ctx).complete_restores_later)
            await pyfuse3.main(min_tasks=2, max_tasks=16)
            nursery.cancel_scope.cancel()


def run_daemon(repo: str, mountpoint: str, store_dir: str, *, block_size: int | None,
               window: float | None, apply_on_exit: bool, allow_other: bool,
               sandboxed: bool = False) -> NoReturn:
    # A command's worker thread (log, diff, a restore's preparation) holds the GIL until
    # the interpreter's switch interval (5 ms) makes it let go: each request the loop's
    # thread answers meanwhile would wait that long. 0.5 ms bounds the wait to a tenth.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    forgotten = Forgotten()
    kernel = Kernel(os.path.abspath(mountpoint), forgotten)
    captures = Captures()  # recorded by the adapter, reported by the session (stats)
    session = Session.open(store_dir, repo, create=True, block_size=block_size, window=window,
                           mountpoint=os.path.abspath(mountpoint), apply_on_exit=apply_on_exit,
                           invalidate=kernel.invalidate, flush_kernel=kernel.flush_kernel,
                           warm=fastpath.warm_tree, kernel_status=kernel.status,
                           sandboxed=sandboxed, request_stats=fastpath.request_latency,
                           captures=captures)
    session.readers = Readers(store_dir, session.repo, session.lower.fd)
    control = ControlFs(session, CheckpointViews(session.ctx))
    daemon = Daemon(session, control)
    # names are made and removed before they are stored where C answers what follows
    answered = Answered(session.overlay) if fastpath.loaded() else None
    ops = Operations(session.overlay, control, invalidate=kernel.invalidate,
                     kernel_handles=fastpath.active, capture=captures, forgotten=forgotten,
                     answered=answered)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # an unmount's, before the loop takes it
    try:
        with stderr_lines() as said:  # libfuse says why only there
            pyfuse3.init(ops, mountpoint, mount_options(allow_other))
    except RuntimeError as e:
        session.close()
        raise UserError(f"cannot mount on {mountpoint}: {reason(said, str(e))}") from None
    kernel.probe_epoch()
    fastpath.speed_up_loop(pyfuse3)
    fastpath.serve_promptly()  # (the readers and worker threads it starts keep the default)
    seq, offset = writebehind.position(session.store)
    fastpath.write_behind(writebehind.open_log(store_dir), writebehind.LOG_SIZE, seq, offset)
    info = read_info(store_dir)
    info.update({"pid": os.getpid(), "mountpoint": os.path.abspath(mountpoint)})
    write_info(store_dir, info)
    try:
        trio.run(daemon.serve)
    finally:
        session.readers.close()
        pyfuse3.close(unmount=True)
        result: dict[str, object] = {"applied": False}  # (session.json's last_unmount)
        try:
            # the writes Python took and deferred first (Store.defer), then, after a
            # signal, those still queued: pyfuse3's loop stops before the queue is empty,
            # and C acknowledged writes until the unmount; they are in the log only
            session.store.store_deferred()
            writebehind.recover(session.overlay, store_dir)
            if session.apply_on_exit:
                stats = apply_live(session.ctx)
                result = {"applied": True, **stats}
                if stats["refused"]:  # (device nodes, fifos, other users' files: listed)
                    log.info("apply at unmount left %d entries as the repo has them: %s",
                             len(stats["refused"]), stats["refused"][:5])
        except Exception as e:
            if isinstance(e, UserError):  # a refusal (the repo changed too): one line
                log.error("apply at unmount refused: %s", e)
            else:
                log.exception("apply at unmount failed")
            result = {**getattr(e, "details", {}),  # what an apply stopped part way wrote
                      "applied": False, "error": f"applying to {repo} failed: {e}; the session is "
                                                 f"kept: run 'overlayckpt --store {store_dir} apply'"}
        finally:
            abandoned = not wait_idle(WORKERS_WAIT)
            if abandoned:
                log.warning("a command's worker thread is still reading the store: it is "
                            "synced and left unclosed (the next mount checks it)")
                session.store.sync()
            else:
                session.close()
            info = read_info(store_dir)
            info.pop("pid", None)
            info.pop("mountpoint", None)
            info["last_unmount"] = result
            write_info(store_dir, info)
    # no interpreter teardown: an abandoned thread would read LMDB's map as it is freed,
    # and otherwise freeing what the process drops anyway cost each unmount 30 ms
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # (a closed pipe: nothing to lose)
                stream.flush()
    os._exit(0)
