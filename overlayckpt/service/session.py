"""One session: its parts (a core Context, built here once), and the answer to a command.

The same `Session` answers commands inside the daemon (through the control
file) and in the CLI for an unmounted session (`--store`), so both paths run
the same code. Commands take their requests (messages.py, checked on the way in) and
return JSON-able replies; they are registered in registry.py (by commands.py and export_commands.py, which this
package's __init__ imports). What the mount adds (kernel hooks, read-ahead,
kernel status) comes in as arguments of `Session.open`, never afterwards.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import trio

from overlayckpt.core.context import Context, FlushKernel, Invalidate, no_flush, no_invalidate
from overlayckpt.core.latency import Captures, Histogram, RequestLatency
from overlayckpt.core.lower import Lower
from overlayckpt.core.maintenance import thin
from overlayckpt.core.overlay import Overlay, make_durable
from overlayckpt.core.workers import off_loop
from overlayckpt.errors import ReaderFailed, UserError
from overlayckpt.messages import (
    GcReply,
    KernelStatus,
    Request,
    SetApplyReply,
    SetApplyRequest,
    StatusReply,
    StatusRequest,
    Summary,
    SummaryReply,
    SummaryRequest,
    parse,
)
from overlayckpt.records import Checkpoint, from_u64, iso_time, u64
from overlayckpt.service.registry import COMMANDS, DURABLE, REACHES_OUT, READINGS, SYNC_SOON, command
from overlayckpt.store.info import read_info, write_info
from overlayckpt.store.lmdbstore import ReaderStore, Store
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import APPLIED_KEY, BLOCKS, CKPTS, JOURNAL, META, NODES, REPO_KEY, SEQ_KEY

log = logging.getLogger(__name__)
R = TypeVar("R")

# What the status command adds of the mount's kernel side (fuse/fastpath.py), given by
# the mount at construction; a session opened without a mount has none of it.
StatusExtra = Callable[[], KernelStatus]


def no_kernel_status() -> KernelStatus:
    return {"kernel_dir_cache": False, "repo_read_ahead": None}


# What the stats command reads of the mount's request path, given by the mount at
# construction: the reply latency of reads and writes that the C library times
# (fuse/fastpath.py request_latency), None without it; a session opened without a mount
# has none.
RequestStats = Callable[[], RequestLatency | None]


def no_request_stats() -> RequestLatency | None:
    return None


# the commands whose time from arrival to answer stats reports (durability included)
TIMED_COMMANDS = ("checkpoint", "restore")


class Session:
    """A session's parts (ctx, handed to the core) and what only the service keeps:
    apply-on-unmount, the log's line counts, the mount's kernel status."""

    def __init__(self, ctx: Context, *, apply_on_exit: bool = False,
                 kernel_status: StatusExtra = no_kernel_status, sandboxed: bool = False,
                 request_stats: RequestStats = no_request_stats,
                 captures: Captures | None = None) -> None:
        self.ctx = ctx
        # the same objects as ctx's, for the service's own use; the core takes ctx itself
        self.store = ctx.store
        self.lower = ctx.lower
        self.overlay = ctx.overlay
        self.repo = ctx.repo
        self.mountpoint = ctx.mountpoint
        self.apply_on_exit = apply_on_exit
        # served to a sandboxed agent (run --private): what reaches outside is refused;
        # set by the daemon's own command line, never by anything the agent controls
        self.sandboxed = sandboxed
        self.line_counts: dict[tuple[int, int, bool], Any] = {}  # commands._by_content's
        # thin and gc one at a time: each plans in a snapshot, then writes what still holds
        self._maintenance = trio.Lock()
        self.kernel_status = kernel_status
        # overlayckpt stats: since this session was opened (by the daemon: its mount)
        self.request_stats = request_stats
        self.captures = captures if captures is not None else Captures()
        self.readers: Any = None  # the mount's reader processes (service/reader.py), if any
        ctx.elsewhere.read = self.reading  # (the core's long readings: a restore's file list)
        self.command_times = {name: Histogram() for name in TIMED_COMMANDS}
        self.opened_ns, self.opened_mono_ns = time.time_ns(), time.monotonic_ns()
        self._conversation: tuple[int, bytes] | None = None  # (head, live text): conversation_text
        # the sync point commands start as they answer (_sync_soon): one at a time, and
        # whether another was asked for while it ran (it covers only what came before it)
        self._syncing = False
        self._sync_again = False

    @classmethod
    def open(cls, store_dir: str, repo: str | None = None, *, create: bool = False,
             block_size: int | None = None, window: float | None = None,
             mountpoint: str | None = None, apply_on_exit: bool = False,
             invalidate: Invalidate = no_invalidate, flush_kernel: FlushKernel = no_flush,
             warm: Callable[[int], bool] | None = None,
             kernel_status: StatusExtra = no_kernel_status, sandboxed: bool = False,
             request_stats: RequestStats = no_request_stats,
             captures: Captures | None = None) -> Session:
        """Open (or create) the session in store_dir; the mount passes its kernel hooks,
        the read-ahead of the repo (warm), its kernel status and what stats reports of its
        requests (request_stats, and captures: where its adapter records capture times),
        everyone else none."""
        info = read_info(store_dir)
        if repo is None and not os.path.exists(os.path.join(store_dir, "data.mdb")):
            raise UserError(f"{store_dir} is not an overlayckpt session store")
        store = Store.open(store_dir, create=create, block_size=block_size)
        recorded = store.read(lambda r: r.get(META, REPO_KEY))
        if repo is None:
            repo = info.get("repo") or (os.fsdecode(recorded) if recorded else None)
            if not repo:
                store.close()
                raise UserError(f"{store_dir} is not an overlayckpt session store")
        try:
            from overlayckpt.core.pins import pin_lookup
            lower = Lower(repo, pin_lookup(store), warm=warm)
        except Exception:
            store.close()
            raise
        if window is None:
            window = float(info.get("window", 1.0))
        overlay = Overlay(store, lower, window=window)
        try:
            from overlayckpt.core import answered, writebehind
            if store.cache_lost:  # their pages may be a mix of old and new: never replayed
                answered.discard(store_dir)
                writebehind.discard(store_dir)
            else:  # what a killed daemon answered and never stored (names and writes commute)
                answered.recover(overlay, store_dir)
                writebehind.recover(overlay, store_dir)
            absrepo = os.fsencode(os.path.realpath(repo))
            if recorded != absrepo:
                store.write(lambda w: w.put(META, REPO_KEY, absrepo))
                store.sync()
        except Exception:
            store.close()
            lower.close()
            raise
        info.update({"repo": os.path.realpath(repo), "window": window, "block_size": store.block_size})
        if "created" not in info:  # (a store made before sessions were listed: its start)
            origin = store.read(lambda r: r.get(CKPTS, u64(0)))
            info["created"] = iso_time(Checkpoint.unpack(0, origin).time_ns if origin else time.time_ns())
        write_info(store_dir, info)
        ctx = Context(store, lower, overlay, os.path.realpath(repo), mountpoint,
                      invalidate=invalidate, flush_kernel=flush_kernel)
        return cls(ctx, apply_on_exit=apply_on_exit, kernel_status=kernel_status,
                   sandboxed=sandboxed, request_stats=request_stats, captures=captures)

    @classmethod
    def open_reader(cls, store_dir: str, repo: str, repo_fd: int) -> Session:
        """The session as a reader process sees it beside its daemon: read-only."""
        from overlayckpt.core.pins import pin_lookup
        store = ReaderStore(store_dir)
        lower = Lower(repo, pin_lookup(store), fd=repo_fd)
        overlay = Overlay(store, lower)
        return cls(Context(store, lower, overlay, repo))

    async def read_off_loop(self, cmd: Request[Any]) -> Mapping[str, object]:
        """The reading of a command (registry.READINGS) where no request of the mount
        waits for it: in a reader process of the mount, else a worker thread."""
        return await self.reading(cmd.CMD, cmd)

    async def reading(self, name: str, cmd: Any) -> Mapping[str, object]:
        """The reading name of cmd, as read_off_loop runs it (the daemon's own readings,
        which no command names, take None)."""
        if self.readers is not None:
            self.store.store_deferred()  # (another process reads only what is committed)
            try:
                return await self.readers.call(name, cmd)
            except (ReaderFailed, OSError) as e:  # (a bug, or a reader killed): still answered
                log.warning("the store's reader failed, %s runs in the daemon: %s", name,
                            str(e).strip().splitlines()[-1:])
        return await off_loop(self.store, lambda store: READINGS[name](self, store, cmd))

    def repo_changed(self) -> None:
        """apply or export wrote the repo: drop what was cached of it."""
        self.lower.forget_cached()
        if self.readers is not None:
            self.readers.reset()

    async def maintain(self, budget: int, then_gc: bool = False) -> GcReply:
        """Thin over budget (and gc), scanning off the request loop (maintenance.py)."""
        async with self._maintenance:
            return await thin(self.store, budget, then_gc)

    def close(self) -> None:
        self.lower.close()
        self.store.close()

    @overload
    async def command(self, cmd: Request[R]) -> R: ...

    @overload  # (a decoded line: what it asks is known only once it is checked)
    async def command(self, cmd: Mapping[str, object]) -> Any: ...

    async def command(self, cmd: Request[Any] | Mapping[str, object]) -> Any:
        """The reply to a request, or to a decoded line (checked here: UserError)."""
        if not isinstance(cmd, Request):
            cmd = parse(cmd)
        name = cmd.CMD
        handler = COMMANDS.get(name)
        if handler is None:  # (interrupt: the control directory's own)
            raise UserError(f"{name} is answered only by a mount's control file")
        if self.sandboxed and name in REACHES_OUT:
            raise UserError(f"{name} is refused: this session is sandboxed (run --private) and "
                            f"{name} reaches outside it; after the run its user can act on the "
                            f"session with 'overlayckpt --store {self.store.path}'")
        started = time.monotonic_ns()
        result = await handler(self, cmd)
        durable = DURABLE.get(name)
        if durable is not None and durable(cmd):
            await make_durable(self.store)
        elif durable is not None or name in SYNC_SOON:  # (a durable command's other calls)
            self._sync_soon()
        timed = self.command_times.get(name)
        if timed is not None:
            timed.record(time.monotonic_ns() - started)
        return result

    def _sync_soon(self) -> None:
        """Start a sync point after the reply; while one runs, one more after it: a burst of
        checkpoints costs two fdatasyncs and one worker thread, not one each, and no
        thread is started on the request loop while another waits to sync."""
        if self._syncing:
            self._sync_again = True
            return
        self._syncing = True
        trio.lowlevel.spawn_system_task(self._sync_now)

    async def _sync_now(self) -> None:
        try:
            while True:
                self._sync_again = False
                await make_durable(self.store)
                if not self._sync_again:
                    break
        except Exception as e:  # (a system task must not raise; the next sync point retries)
            log.warning("a sync point of the store failed: %s", e)
        finally:
            self._syncing = False

    def status(self) -> StatusReply:
        from overlayckpt.core.timeline import Timeline
        tl = Timeline(self.ctx)
        checkpoints, journal, blocks, nodes = self.store.read(lambda r: (
            r.count(CKPTS), r.count(JOURNAL), r.count(BLOCKS), r.count(NODES)))
        live = tl.latest()
        return {
            "repo": self.repo, "mountpoint": self.mountpoint, "store": self.store.path,
            "pid": os.getpid() if self.mountpoint else None,
            # never stat the mountpoint here: the daemon would wait on itself
            "in_place": self.mountpoint == self.repo,
            "apply_on_unmount": self.apply_on_exit,
            "sandboxed": self.sandboxed,
            **self.kernel_status(),  # kernel_dir_cache, repo_read_ahead
            "live_checkpoint": live.id if live else None,
            "block_size": self.store.block_size,
            "store_bytes": self.store.disk_bytes(), "checkpoints": checkpoints,
            "journal": journal, "blocks": blocks, "nodes": nodes,
        }

    def conversation_text(self) -> bytes:
        from overlayckpt.core.conversation import live_text_after
        # (every getattr of conversation.jsonl asks for its size: kept, and grown by the
        # lines appended since, rather than rebuilt)
        self._conversation = live_text_after(self.store, self._conversation)
        return self._conversation[1]

    def conversation_append(self, line: bytes) -> None:
        from overlayckpt.agents.lines import parse_line
        from overlayckpt.core.conversation import append_line
        obj = parse_line(line)
        if obj is not None:
            append_line(self.store, obj)


@command(StatusRequest)
async def _status(s: Session, cmd: StatusRequest) -> StatusReply:
    return s.status()


def summary(r: ReadTxn) -> Summary:
    """What `sessions` and a resumed mount show: checkpoints, and how many changes came
    after the state last applied to the repo (all but the start if none was): the
    checkpoints after it, and the changes not in a checkpoint yet (an open group)."""
    applied = r.meta_int(APPLIED_KEY, 0)
    unapplied = 0
    newest = None
    for k, v in r.range_from(CKPTS, reverse=True):
        ck = Checkpoint.unpack(from_u64(k), v)
        newest = newest or ck
        if ck.id == 0 or ck.seq <= applied:
            break
        unapplied += 1
    if r.meta_int(SEQ_KEY, 1) > max(applied, newest.seq if newest else 1):
        unapplied += 1
    return {"checkpoints": r.count(CKPTS), "unapplied": unapplied, "applied": applied > 0,
            "last_checkpoint": iso_time(newest.time_ns) if newest else None}


@command(SummaryRequest)
async def _summary(s: Session, cmd: SummaryRequest) -> SummaryReply:
    from overlayckpt.core.workers import read_off_loop
    found: Summary = await read_off_loop(s.store, summary)
    return {**found, "created": read_info(s.store.path).get("created")}


@command(SetApplyRequest, reaches_out=True)
async def _set_apply(s: Session, cmd: SetApplyRequest) -> SetApplyReply:
    s.apply_on_exit = cmd.apply
    return {"apply_on_unmount": cmd.apply}

