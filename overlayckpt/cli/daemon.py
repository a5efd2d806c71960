"""The commands on the daemon and the store: mount, unmount, run, status, recover.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback

from overlayckpt.cli import client
from overlayckpt.cli.target import Target, emit, find_mount
from overlayckpt.errors import FsError, UserError

# (types only: typing, and the messages, 14 ms of every CLI start: a mount's CLI
# starts the daemon before it imports them)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import NoReturn, TypedDict

    from overlayckpt.cli.sessions import Announced
    from overlayckpt.messages import Refused, StatusReply

    class Mounted(TypedDict):
        repo: str
        mountpoint: str
        store: str
        resumed: Announced | None  # the session resumed, if one was

    class UnmountReport(TypedDict):
        mountpoint: str
        repo: str
        store: str
        applied: bool  # (these three: the daemon's apply at unmount, from session.json)
        refused: list[Refused]
        setid_dropped: list[str]

    class Unmounted(StatusReply):
        applied: bool  # (these three: the daemon's apply at unmount, from session.json)
        refused: list[Refused]
        setid_dropped: list[str]

READY_TIMEOUT = 30.0

# -- mount / unmount / run --------------------------------------------------

def clear_stale(path: str) -> None:
    """A mount whose daemon died answers ENOTCONN: lazily unmount it so we can mount again."""
    if client.is_stale(path):
        logging.getLogger(__name__).info("clearing stale mount at %s", path)
        subprocess.run(["fusermount3", "-uz", path], check=False, capture_output=True)


def resolve_repo(repo: str) -> str:
    clear_stale(repo)
    if not os.path.exists(repo):
        raise UserError(f"repo {repo} does not exist: give the directory to overlay")
    if not os.path.isdir(repo):
        raise UserError(f"repo {repo} is not a directory: give the directory to overlay")
    if not os.access(repo, os.R_OK | os.X_OK):
        raise UserError(f"repo {repo} is not readable")
    return os.path.realpath(repo)


def prepare_mountpoint(mountpoint: str) -> None:
    clear_stale(mountpoint)
    if not os.path.isdir(mountpoint):
        raise UserError(f"mountpoint {mountpoint} is not a directory: create it first")
    if os.path.exists(os.path.join(mountpoint, ".overlayckpt", "ctl")):
        raise UserError(f"{mountpoint} is already an overlayckpt mount: unmount it first")


def check_places(repo: str, mountpoint: str, stores: list[str],
                 more: tuple[tuple[str, str], ...] = ()) -> None:
    """Refuse, before anything starts, a layout where the daemon would reach its own
    files through its own mount (it would wait on itself, and every process using the
    mount with it): a mountpoint inside the repo or holding it, a store inside the repo or
    the mountpoint; more: other (label, directory) a store and the mountpoint stay out of.
    Compared by name, resolved, and by the identity of ancestors (places.inside)."""
    from overlayckpt.store.places import inside, place_of
    the_repo, the_mount = place_of("the repo", repo), place_of("the mountpoint", mountpoint)
    others = [place_of(label, path) for label, path in more]
    if os.path.realpath(mountpoint) != os.path.realpath(repo):
        found = inside(mountpoint, [the_repo, *others])
        if found:
            raise UserError(f"mountpoint {mountpoint} is inside {found.label} {found.path}: the "
                            "mount would serve itself; pick a mountpoint outside it")
        if inside(repo, [the_mount]):
            raise UserError(f"the repo {repo} is inside the mountpoint {mountpoint}: the mount "
                            "would hide it; pick a mountpoint outside the repo's path")
    for store in stores:
        found = inside(store, [the_repo, the_mount, *others])
        if found:
            raise UserError(f"store {store} is inside {found.label} {found.path}: the daemon would "
                            "write it into what it serves; keep the store outside the repo and the "
                            "mountpoint (the default is under ~/.local/share/overlayckpt)")


def cmd_mount(args: argparse.Namespace) -> int:
    from overlayckpt.cli.sessions import store_for
    from overlayckpt.store.info import read_info
    repo = resolve_repo(args.repo)
    mountpoint = os.path.realpath(args.mountpoint) if args.mountpoint else repo
    store = store_for(repo, args.store, getattr(args, "new", False))
    check_places(repo, mountpoint, [store])
    prepare_mountpoint(mountpoint)
    info = read_info(store)
    if info.get("repo") and info["repo"] != repo:
        raise UserError(f"store {store} belongs to repo {info['repo']}, not {repo}: pick another --store")
    if info.get("pid") and client.pid_alive(info["pid"]):
        raise UserError(f"store {store} is in use by daemon {info['pid']} at {info.get('mountpoint')}: "
                        "unmount it first")
    apply = args.apply if args.apply is not None else mountpoint == repo
    if args.foreground:
        from overlayckpt.mount import run_daemon
        return run_daemon(repo, mountpoint, store, block_size=args.block_size, window=args.window,
                          apply_on_exit=apply, allow_other=args.allow_other,
                          sandboxed=getattr(args, "sandboxed", False))
    resumed = os.path.exists(os.path.join(store, "data.mdb"))
    spawn_daemon(repo, mountpoint, store, args, apply)
    result: Mounted = {"repo": repo, "mountpoint": mountpoint, "store": store,
                       "resumed": resumed_session(repo, mountpoint, store) if resumed else None}
    emit(args, result, lambda r: f"mounted {repo} at {mountpoint} (store {store})"
         + (f"\n{r['resumed']['text']}" if r["resumed"] is not None else ""))
    return 0


def resumed_session(repo: str, mountpoint: str, store: str) -> Announced | None:
    """What a mount says of the session it resumed (cli/sessions.py); None if the daemon
    cannot tell: the mount itself went well."""
    from overlayckpt.cli.sessions import announce
    try:
        return announce(repo, mountpoint, store)
    except UserError as e:
        logging.getLogger(__name__).info("no summary of the resumed session: %s", e)
        return None


def spawn_daemon(repo: str, mountpoint: str, store: str, args: argparse.Namespace, apply: bool,
                 started: Callable[[int], None] | None = None) -> None:
    """Start the daemon and wait until its mount answers. started(pid): told the daemon's
    pid as soon as it exists (a caller that must stop it, even if this is interrupted)."""
    from overlayckpt.store.places import check_store_dir, make_dirs, open_private, remove_store, secure
    check_store_dir(store)
    created = not os.path.exists(store)
    try:
        make_dirs(store)
    except OSError as e:
        raise UserError(f"cannot create store {store}: {e.strerror}") from None
    secure(store)  # before its log is written (a directory made with mkdir is 0755)
    logpath = os.path.join(store, "daemon.log")
    with os.fdopen(open_private(logpath, os.O_WRONLY | os.O_APPEND), "ab") as logf:
        start = logf.tell()
        for stream in (sys.stdout, sys.stderr):  # (else the child would write them again)
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
        pid = os.fork()  # (the CLI runs no thread: the child holds no lock another held)
        if pid == 0:
            _serve(logf.fileno(), repo, mountpoint, store, args, apply)
    if started is not None:
        started(pid)
    # the daemon imports for 0.1 s: meanwhile, on another core, what we ask it next
    import overlayckpt.messages  # noqa: F401
    deadline = time.monotonic() + READY_TIMEOUT
    ctl = os.path.join(mountpoint, ".overlayckpt", "ctl")
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # (SIGCHLD ignored by whoever started us: reaped already)
            done, status = pid, 1 << 8
        if done:
            why = _last_error(logpath, start) or f"daemon exited with status {os.waitstatus_to_exitcode(status)}"
            if created:  # a failed first mount leaves no session behind for the next to resume
                remove_store(store)
            raise UserError(why)
        if os.path.exists(ctl):
            return
        time.sleep(0.005)  # (a stat of a missing name: looking often costs nothing)
    os.kill(pid, signal.SIGTERM)
    raise UserError(f"mount did not answer within {READY_TIMEOUT:.0f} s; see {logpath}")


def _serve(log_fd: int, repo: str, mountpoint: str, store: str, args: argparse.Namespace,
           apply: bool) -> NoReturn:
    """The daemon, in the mount's child: a process of its own (its session, cwd /, stdin
    /dev/null, stdout and stderr the log, no other descriptor of the CLI's), then
    run_daemon, which exits. Forked, not started anew: a Python start and the CLI's
    imports again cost every mount 40 ms."""
    try:
        os.setsid()
        os.chdir("/")
        # (copies above 2 first: with the CLI's stdin or stdout closed, either may be 0 or 1)
        null = fcntl.fcntl(os.open(os.devnull, os.O_RDONLY), fcntl.F_DUPFD, 3)
        log = fcntl.fcntl(log_fd, fcntl.F_DUPFD, 3)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        _stdio_to_log()
        if not sys.flags.safe_path:  # (as -P: nothing imported from the cwd or the script's directory)
            sys.path.pop(0)
        from overlayckpt.mount import run_daemon
        run_daemon(repo, mountpoint, store, block_size=args.block_size, window=args.window,
                   apply_on_exit=apply, allow_other=args.allow_other,
                   sandboxed=getattr(args, "sandboxed", False))
    except (UserError, FsError) as e:  # (the mount reads it from the log's last line)
        print(f"overlayckpt: {e}", file=sys.stderr, flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)  # never back into the CLI's code, whatever happened above


def _stdio_to_log() -> None:
    """A CLI started with stdout or stderr closed has None for them, and so has its
    child: give it streams on descriptors 1 and 2 (the log), and the log handler too."""
    if sys.stdout is None:
        sys.stdout = open(1, "w", buffering=1, closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is None:
            handler.setStream(sys.stderr)


def _last_error(logpath: str, start: int) -> str:
    with open(logpath, "rb") as f:
        f.seek(start)
        lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1].removeprefix("overlayckpt: ") if lines else ""


def unmount(mountpoint: str, apply: bool | None) -> Unmounted:
    # A command running may hold ctl (without the C library the kernel lets one write at
    # a time through) and its client keeps the mount busy: read status.json, have the daemon
    # cut running commands short (SIGUSR1: they are told so), then ask through ctl
    from overlayckpt.messages import InterruptRequest, Refused, SetApplyRequest
    status = client.status(mountpoint)
    pid = status["pid"]
    if pid and status.get("interruptible"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    if apply is not None:
        client.send(mountpoint, SetApplyRequest(apply=apply))
    client.send(mountpoint, InterruptRequest())  # answers once their clients closed ctl
    proc = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "fusermount3 failed"
        raise UserError(f"cannot unmount {mountpoint}: {why} (close programs using it, e.g. 'fuser -m')")
    if pid:
        client.wait_gone(pid, 600)
    from overlayckpt.store.info import read_info
    outcome = read_info(status["store"]).get("last_unmount", {})
    if outcome.get("error"):
        raise UserError(outcome["error"])
    # what the apply left as the repo has it (session.json: checked, as any file read back)
    refused, dropped = outcome.get("refused"), outcome.get("setid_dropped")
    return {**status, "applied": outcome.get("applied") is True,
            "refused": [Refused(path=str(r.get("path")), why=str(r.get("why")))
                        for r in refused if isinstance(r, dict)] if isinstance(refused, list) else [],
            "setid_dropped": [p for p in dropped if isinstance(p, str)] if isinstance(dropped, list) else []}


def _refused_text(r: UnmountReport) -> str:
    """What an apply at unmount left out or made less, as apply itself says it."""
    if not r["refused"] and not r["setid_dropped"]:
        return ""
    from overlayckpt.cli.applied import applied_text
    return "\n" + applied_text({"repo": r["repo"], "written": 0, "removed": 0, "pinned": 0,
                                 "refused": r["refused"], "setid_dropped": r["setid_dropped"]}
                                ).split("\n", 1)[1]


def cmd_unmount(args: argparse.Namespace) -> int:
    mountpoint = args.mountpoint or args.mount
    if mountpoint and client.is_stale(mountpoint):
        clear_stale(mountpoint)
        print(f"cleared stale mount at {mountpoint} (its daemon was gone; the session is kept)",
              file=sys.stderr)
        return 0
    target = find_mount(mountpoint)
    if target is None:
        raise UserError("no overlayckpt mount here: give the mountpoint")
    status = unmount(target, args.apply)
    report: UnmountReport = {"mountpoint": target, "repo": status["repo"], "store": status["store"],
                             "applied": status["applied"], "refused": status["refused"],
                             "setid_dropped": status["setid_dropped"]}
    emit(args, report,
         lambda r: f"unmounted {target}" + (f"; applied to {r['repo']}" if r["applied"] else "")
         + _refused_text(r))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UserError("run needs a command: overlayckpt run -- CMD ...")
    repo = resolve_repo(args.repo)
    private = os.environ.get("OVERLAYCKPT_PRIVATE", "")
    if args.private and not private:
        unshare, private = private_namespace()
        argv = [sys.executable, "-P", "-m", "overlayckpt"] + sys.argv[1:]
        env = dict(os.environ, OVERLAYCKPT_PRIVATE=private)
        return subprocess.call(unshare + ["--"] + argv, env=env)
    if private == "user":  # the command without the namespace's capabilities: it cannot unmount the overlay
        cmd = ["unshare", "--user", "--map-current-user", "--"] + cmd
    from overlayckpt.cli.sessions import store_for
    store = store_for(repo, args.store, getattr(args, "new", False))
    check_places(repo, repo, [store])
    prepare_mountpoint(repo)
    apply = args.apply if args.apply is not None else not args.private
    # a private run's daemon refuses its agent what reaches outside the sandbox (apply,
    # set_apply, fork, export, gc): told by its command line, which the agent cannot touch
    args.sandboxed = bool(private)
    spawn_daemon(repo, repo, store, args, apply)
    try:
        env = dict(os.environ, OVERLAYCKPT_MOUNT=repo)
        try:
            status = subprocess.call(cmd, cwd=repo, env=env)
        except OSError as e:
            raise UserError(f"cannot run {cmd[0]}: {e.strerror}") from None
    finally:
        # (sandboxed: the daemon applies, or not, as it was started; it refuses set_apply)
        unmount(repo, None if private else apply)
    return status


# what lets a normal user create user namespaces, where the kernel has such a switch
USERNS_SWITCHES = (
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "sudo sysctl kernel.unprivileged_userns_clone=1"),
    ("/proc/sys/user/max_user_namespaces", "0", "sudo sysctl user.max_user_namespaces=15000"),
    ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
     "sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0 (AppArmor forbids them)"),
)


def private_namespace() -> tuple[list[str], str]:
    """unshare's argv for a private mount namespace, and how the run inside tells it
    ("root" or "user"). A normal user gets a user namespace too, where it keeps its ids
    (what the store records and apply writes stay the user's) and the daemon has the
    capabilities to mount FUSE itself."""
    if not shutil.which("unshare"):
        raise UserError("--private needs unshare(1): install util-linux")
    private_mounts = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() == 0:
        return private_mounts, "root"
    userns = ["unshare", "--user", "--map-current-user", "--keep-caps"] + private_mounts[1:]
    probe = subprocess.run(userns + ["true"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["unshare failed"])[-1].removeprefix("unshare: ")
        enable = next((fix for path, off, fix in USERNS_SWITCHES if _read(path) == off),
                      "run it as root, or without --private")
        raise UserError(f"--private needs a user namespace, which this machine refuses ({why}): {enable}")
    return userns, "user"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def cmd_status(args: argparse.Namespace) -> int:
    from overlayckpt.messages import StatusRequest
    result = Target(args).call(StatusRequest())

    def line(key: str, value: object) -> str:
        if isinstance(value, dict):
            value = " ".join(f"{k}={v}" for k, v in value.items())
        return f"{key}: {value}"
    emit(args, result, lambda r: "\n".join(line(k, v) for k, v in r.items()))
    return 0


_SALVAGE = ("import json, sys\n"
            "from overlayckpt.store.salvage import salvage\n"
            "for name, copied, error in salvage(sys.argv[1], sys.argv[2]):\n"
            "    print(json.dumps([name, copied, error]), flush=True)\n")


def cmd_recover(args: argparse.Namespace) -> int:
    """Copy what can be read out of a damaged store, in a child process (reading damaged
    pages through LMDB may crash it), then swap the copy in and keep the damaged one."""
    import fcntl

    from overlayckpt.core.maintenance import fsck
    from overlayckpt.store.lmdbstore import Store
    from overlayckpt.store.places import secure
    from overlayckpt.store.synced import fsync_dir
    if not args.store:
        raise UserError("recover needs --store DIR: the store of the damaged session")
    store = os.path.abspath(args.store)
    if not os.path.isfile(os.path.join(store, "data.mdb")):
        raise UserError(f"no session store at {store}: check --store")
    lock_fd = os.open(os.path.join(store, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"store {store} is in use by an overlayckpt daemon: unmount it "
                            "first") from None
        work = store.rstrip("/") + ".recovering"
        shutil.rmtree(work, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-c", _SALVAGE, store, work],
                              capture_output=True, text=True, timeout=6 * 3600)
        tables = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
        if not os.path.isfile(os.path.join(work, "data.mdb")):
            raise UserError(f"nothing could be read from {store} ({proc.stderr.strip()[-200:]}); "
                            "it is unchanged")
        for name in ("session.json",):
            if os.path.exists(os.path.join(store, name)):
                shutil.copy2(os.path.join(store, name), os.path.join(work, name))
        secure(work)  # (copy2 copied the old file's mode)
        recovered = Store.open(work, create=False, lock=False)
        try:
            check = fsck(recovered)
        finally:
            recovered.close()
        kept = f"{store}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(store, kept)
        secure(kept)  # the damaged copy holds the same captured content
        os.rename(work, store)
        fsync_dir(os.path.dirname(store))
    finally:
        os.close(lock_fd)
    lost = [f"table {t} stopped after {n} entries: {e}" for t, n, e in tables if e]
    scanned = sum(n for t, n, _ in tables if t == "blocks (scan)")
    if proc.returncode != 0:
        lost.append(f"the reader stopped (status {proc.returncode}) after "
                    f"{len(tables)} of the tables")
    # clean only if every table was read to its end and fsck finds nothing: a table that
    # stopped may have held what the recovered store no longer refers to (fsck cannot tell)
    result = {"store": store, "damaged_copy": kept, "entries": sum(n for _, n, _ in tables),
              "blocks_found_by_scan": scanned, "lost": lost + check["problems"],
              "clean": check["clean"] and not lost}
    emit(args, result, lambda r: (
        f"recovered {r['entries']} entries into {store}; the damaged store is kept at "
        f"{kept}\n" + ("lost: " + "; ".join(r["lost"][:20]) if r["lost"] else "nothing lost")))
    return 0
