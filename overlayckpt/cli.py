"""The `overlayckpt` command line.

Exit status: 0 ok, 1 failed (one line on stderr: what, why, what to do), 2 usage.
Commands on a session talk to its daemon through `.overlayckpt/ctl` when it is
mounted, or open its store directly (`--store`) when it is not.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from . import client
from .errors import FsError, UserError
from .records import DEFAULT_BLOCK_SIZE
from .session import default_store_dir, read_info

READY_TIMEOUT = 30.0


def _mount_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=None,
                   help=f"block size of a new store (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--window", type=float, default=None,
                   help="seconds of idleness that end an automatic checkpoint (0: one per operation)")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--mount", default=argparse.SUPPRESS,
                        help="the session's mountpoint (default: $OVERLAYCKPT_MOUNT or the mount "
                             "containing the current directory)")
    common.add_argument("--store", default=argparse.SUPPRESS,
                        help="the session's store directory (works on unmounted sessions)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)
    p = argparse.ArgumentParser(prog="overlayckpt", parents=[common],
                                description="Checkpointing overlay for coding agents")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    real_add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return real_add(name, parents=[common], **kw)
    sub.add_parser = add_parser  # type: ignore[method-assign]

    m = sub.add_parser("mount", help="mount REPO (in place, or at MOUNTPOINT)")
    m.add_argument("repo")
    m.add_argument("mountpoint", nargs="?")
    m.add_argument("--foreground", action="store_true", help="serve in this process (debugging)")
    m.add_argument("--apply", dest="apply", action="store_true", default=None,
                   help="write the live state into the repo at unmount")
    m.add_argument("--no-apply", dest="apply", action="store_false")
    _mount_args(m)

    u = sub.add_parser("unmount", help="unmount (in place: applies to the repo unless --no-apply)")
    u.add_argument("mountpoint", nargs="?")
    u.add_argument("--apply", dest="apply", action="store_true", default=None)
    u.add_argument("--no-apply", dest="apply", action="store_false")

    r = sub.add_parser("run", help="mount, run CMD inside, unmount, exit with CMD's status")
    r.add_argument("--repo", default=".")
    r.add_argument("--apply", dest="apply", action="store_true", default=None)
    r.add_argument("--no-apply", dest="apply", action="store_false")
    r.add_argument("--private", action="store_true",
                   help="only CMD and its children see the overlay (private mount namespace)")
    _mount_args(r)
    r.add_argument("cmd", nargs=argparse.REMAINDER)

    sub.add_parser("status", help="mount, repo, store, live checkpoint, counts")
    sub.add_parser("recover", help="salvage a damaged store (--store DIR) into a new one, "
                                   "keeping the damaged one beside it")

    h = sub.add_parser("hook", help="log one agent hook event (JSON on stdin) into the conversation")
    h.add_argument("agent", choices=["claude-code"])
    ih = sub.add_parser("install-hooks", help="add our hooks to the project's agent settings")
    ih.add_argument("agent", choices=["claude-code"])
    ih.add_argument("--project", default=".", help="project directory (default: current)")

    from . import cli_timeline
    cli_timeline.add_parsers(sub)
    return p


# -- finding the session ----------------------------------------------------

def find_mount(explicit: str | None) -> str | None:
    """The mountpoint of the session: --mount, $OVERLAYCKPT_MOUNT, or walking up from cwd."""
    candidate = explicit or os.environ.get("OVERLAYCKPT_MOUNT")
    if candidate:
        if not os.path.exists(os.path.join(candidate, ".overlayckpt", "ctl")):
            if client.is_stale(candidate):
                raise UserError(f"{candidate}: the daemon is gone (stale mount); "
                                f"run 'overlayckpt mount' again to recover it")
            raise UserError(f"{candidate} is not an overlayckpt mount: check --mount")
        return os.path.abspath(candidate)
    try:
        d = os.getcwd()
    except OSError:
        raise UserError("the current directory is gone (stale mount?): cd elsewhere and retry") from None
    while True:
        if os.path.exists(os.path.join(d, ".overlayckpt", "ctl")):
            return d
        if client.is_stale(d):
            raise UserError(f"{d}: the daemon is gone (stale mount); run 'overlayckpt mount' "
                            "again to recover it")
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


class Target:
    """Where a command goes: a mounted daemon, or an unmounted store."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.mount: str | None = None
        self.store: str | None = args.store
        if args.store is None:
            self.mount = find_mount(args.mount)
            if self.mount is None:
                raise UserError("no overlayckpt session here: cd into a mount, or pass --mount or --store")
        elif not os.path.isdir(args.store):
            raise UserError(f"no session store at {args.store}: check --store")

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self.mount is not None:
            return client.send(self.mount, cmd)
        info = read_info(self.store or "")
        if info.get("pid") and client.pid_alive(info["pid"]) and info.get("mountpoint"):
            return client.send(info["mountpoint"], cmd)
        return client.offline(self.store or "", cmd)


def emit(args: argparse.Namespace, result: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> None:
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = text(result)
        if out:
            print(out)


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


def cmd_mount(args: argparse.Namespace) -> int:
    repo = resolve_repo(args.repo)
    mountpoint = os.path.realpath(args.mountpoint) if args.mountpoint else repo
    store = os.path.abspath(args.store) if args.store else default_store_dir(repo)
    prepare_mountpoint(mountpoint)
    info = read_info(store)
    if info.get("repo") and info["repo"] != repo:
        raise UserError(f"store {store} belongs to repo {info['repo']}, not {repo}: pick another --store")
    if info.get("pid") and client.pid_alive(info["pid"]):
        raise UserError(f"store {store} is in use by daemon {info['pid']} at {info.get('mountpoint')}: "
                        "unmount it first")
    apply = args.apply if args.apply is not None else mountpoint == repo
    if args.foreground:
        from .mount import run_daemon
        return run_daemon(repo, mountpoint, store, block_size=args.block_size, window=args.window,
                          apply_on_exit=apply, allow_other=args.allow_other)
    spawn_daemon(repo, mountpoint, store, args, apply)
    emit(args, {"repo": repo, "mountpoint": mountpoint, "store": store},
         lambda r: f"mounted {repo} at {mountpoint} (store {store})")
    return 0


def spawn_daemon(repo: str, mountpoint: str, store: str, args: argparse.Namespace, apply: bool) -> None:
    os.makedirs(store, mode=0o700, exist_ok=True)
    logpath = os.path.join(store, "daemon.log")
    argv = [sys.executable, "-m", "overlayckpt", "--store", store, "mount", repo, mountpoint,
            "--foreground", "--apply" if apply else "--no-apply"]
    if args.block_size:
        argv += ["--block-size", str(args.block_size)]
    if args.window is not None:
        argv += ["--window", str(args.window)]
    if args.allow_other:
        argv.append("--allow-other")
    if args.verbose:
        argv.insert(3, "--verbose")
    with open(logpath, "ab") as logf:
        start = logf.tell()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True, cwd="/")
    deadline = time.monotonic() + READY_TIMEOUT
    ctl = os.path.join(mountpoint, ".overlayckpt", "ctl")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(_last_error(logpath, start) or f"daemon exited with status {proc.returncode}")
        if os.path.exists(ctl):
            return
        time.sleep(0.02)
    proc.terminate()
    raise UserError(f"mount did not answer within {READY_TIMEOUT:.0f} s; see {logpath}")


def _last_error(logpath: str, start: int) -> str:
    with open(logpath, "rb") as f:
        f.seek(start)
        lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1].removeprefix("overlayckpt: ") if lines else ""


def unmount(mountpoint: str, apply: bool | None) -> dict[str, Any]:
    status = client.send(mountpoint, {"cmd": "status"})
    if apply is not None:
        client.send(mountpoint, {"cmd": "set_apply", "apply": apply})
    proc = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "fusermount3 failed"
        raise UserError(f"cannot unmount {mountpoint}: {why} (close programs using it, e.g. 'fuser -m')")
    pid = status.get("pid")
    deadline = time.monotonic() + 600
    while pid and client.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    outcome = read_info(status["store"]).get("last_unmount", {})
    if outcome.get("error"):
        raise UserError(outcome["error"])
    status["applied"] = outcome.get("applied", False)
    return status


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
    emit(args, {"mountpoint": target, "repo": status["repo"], "store": status["store"],
                "applied": status["applied"]},
         lambda r: f"unmounted {target}" + (f"; applied to {r['repo']}" if r["applied"] else ""))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UserError("run needs a command: overlayckpt run -- CMD ...")
    repo = resolve_repo(args.repo)
    if args.private and not os.environ.get("OVERLAYCKPT_PRIVATE"):
        if not shutil.which("unshare"):
            raise UserError("--private needs unshare(1) (util-linux)")
        argv = [sys.executable, "-m", "overlayckpt"] + sys.argv[1:]
        env = dict(os.environ, OVERLAYCKPT_PRIVATE="1")
        return subprocess.call(["unshare", "-m", "--propagation", "private", "--"] + argv, env=env)
    store = os.path.abspath(args.store) if args.store else default_store_dir(repo)
    prepare_mountpoint(repo)
    apply = args.apply if args.apply is not None else not args.private
    spawn_daemon(repo, repo, store, args, apply)
    try:
        env = dict(os.environ, OVERLAYCKPT_MOUNT=repo)
        try:
            status = subprocess.call(cmd, cwd=repo, env=env)
        except OSError as e:
            raise UserError(f"cannot run {cmd[0]}: {e.strerror}") from None
    finally:
        unmount(repo, apply)
    return status


def cmd_status(args: argparse.Namespace) -> int:
    result = Target(args).call({"cmd": "status"})
    result.pop("ok", None)
    def line(key: str, value: Any) -> str:
        if isinstance(value, dict):
            value = " ".join(f"{k}={v}" for k, v in value.items())
        return f"{key}: {value}"
    emit(args, result, lambda r: "\n".join(line(k, v) for k, v in r.items()))
    return 0


_SALVAGE = ("import json, sys\n"
            "from overlayckpt.store import salvage\n"
            "for name, copied, error in salvage(sys.argv[1], sys.argv[2]):\n"
            "    print(json.dumps([name, copied, error]), flush=True)\n")


def cmd_recover(args: argparse.Namespace) -> int:
    """Copy what can be read out of a damaged store, in a child process (reading damaged
    pages through LMDB may crash it), then swap the copy in and keep the damaged one."""
    import fcntl
    from .maintenance import fsck
    from .store import Store
    from .synced import fsync_dir
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
        recovered = Store.open(work, create=False, lock=False)
        try:
            check = fsck(recovered)
        finally:
            recovered.close()
        kept = f"{store}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(store, kept)
        os.rename(work, store)
        fsync_dir(os.path.dirname(store))
    finally:
        os.close(lock_fd)
    lost = [f"table {t} stopped after {n} entries: {e}" for t, n, e in tables if e]
    if proc.returncode != 0:
        lost.append(f"the reader stopped (status {proc.returncode}) after "
                    f"{len(tables)} of the tables")
    result = {"store": store, "damaged_copy": kept, "entries": sum(n for _, n, _ in tables),
              "lost": lost + check["problems"], "clean": check["clean"]}
    emit(args, result, lambda r: (
        f"recovered {r['entries']} entries into {store}; the damaged store is kept at "
        f"{kept}\n" + ("lost: " + "; ".join(r["lost"][:20]) if r["lost"] else "nothing lost")))
    return 0


def cmd_hook(args: argparse.Namespace) -> int:
    from .agents import run_hook
    return run_hook(sys.stdin, args.mount)


def cmd_install_hooks(args: argparse.Namespace) -> int:
    from .agents import HOOK_MARK, install_hooks
    command = f"{sys.executable} -m {HOOK_MARK}"
    path = install_hooks(os.path.abspath(args.project), command)
    print(f"hooks written to {path}")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "mount": cmd_mount, "unmount": cmd_unmount, "run": cmd_run, "status": cmd_status,
    "recover": cmd_recover,
    "hook": cmd_hook, "install-hooks": cmd_install_hooks,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    paths: list[str] = []
    if "--" in argv and any(c in argv[:argv.index("--")] for c in ("diff", "restore")):
        i = argv.index("--")
        argv, paths = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    args.paths = paths
    for name, default in (("mount", None), ("store", None), ("json", False), ("verbose", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="overlayckpt: %(levelname)s %(name)s: %(message)s")
    from . import cli_timeline
    handler = HANDLERS.get(args.command) or cli_timeline.HANDLERS[args.command]
    try:
        return handler(args)
    except UserError as e:
        print(f"overlayckpt: {e}", file=sys.stderr)
        return 1
    except FsError as e:
        print(f"overlayckpt: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            print("overlayckpt: the mount's daemon is gone (stale mount): run 'overlayckpt mount' "
                  "again to recover", file=sys.stderr)
            return 1
        print(f"overlayckpt: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
