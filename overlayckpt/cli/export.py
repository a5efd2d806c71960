"""The export and import commands of the command line (export git once, or again every
DURATION; export bundle; import).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from overlayckpt.errors import UserError

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from overlayckpt.cli.target import Target
    from overlayckpt.messages import ExportGitReply, ExportGitRequest

CHUNK = 50  # checkpoints per export call from the CLI: progress granularity
# -- command line -------------------------------------------------------------------

def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 30s, 5m, 1h")
    scale = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]
    return float(m.group(1)) * scale


def _export_all(call: Callable[[ExportGitRequest], ExportGitReply], args: argparse.Namespace,
                quiet: bool = False) -> ExportGitReply:
    """Export until the branch has every checkpoint, CHUNK at a time (one request each)."""
    from overlayckpt.messages import Exported, ExportGitRequest
    since = args.since
    if since is not None and since.isascii() and since.isdigit():
        since = int(since)
    cmd = ExportGitRequest(branch=args.branch, since=since, limit=CHUNK)
    done: list[Exported] = []
    total = None
    while True:
        result = call(cmd)
        done += result["exported"]
        if total is None:
            total = len(result["exported"]) + result.get("remaining", 0)
        if total > CHUNK and result["exported"] and not quiet:
            print(f"overlayckpt: exported {len(done)}/{total} checkpoints to {result['branch']}",
                  file=sys.stderr, flush=True)
        if not result.get("remaining") or not result["exported"]:
            break
    result["exported"] = done
    result.pop("remaining", None)
    return result


def _export_text(r: ExportGitReply) -> str:
    tip = (r["tip"] or "")[:12]
    if not r["exported"]:
        where = f" (checkpoint {r['last']}, {tip})" if r.get("last") is not None else ""
        return f"{r['branch']} is up to date{where}"
    ids = [e["id"] for e in r["exported"]]
    span = f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
    return (f"exported {len(ids)} checkpoint{'s' if len(ids) != 1 else ''} ({span}) to "
            f"{r['branch']} ({tip})")


def cmd_export(args: argparse.Namespace) -> int:
    from overlayckpt.cli.target import Target, emit
    if args.kind == "bundle":
        if not args.file:
            raise UserError("export bundle needs a FILE: overlayckpt export bundle FILE")
        if args.branch is not None or args.since is not None or args.every is not None:
            raise UserError("--branch, --since and --every belong to 'export git'")
        path = _bundle_path(args.file)
        from overlayckpt.messages import ExportBundleRequest
        result = Target(args).call(ExportBundleRequest(path=path))
        emit(args, result, lambda r: f"wrote {r['path']}: {r['checkpoints']} checkpoints, "
                                     f"{r['blocks']} blocks, {r['bytes']} bytes")
        return 0
    if args.file:
        raise UserError(f"export git takes no FILE (got {args.file!r}): overlayckpt export git "
                        "[--branch NAME] [--since ID]")
    target = Target(args)
    if args.every is None:
        emit(args, _export_all(target.call, args), _export_text)
        return 0
    return _export_every(target, args)


def _export_every(target: Target, args: argparse.Namespace) -> int:
    """Export, then again every DURATION, until interrupted or the session unmounts.
    A first Ctrl-C lets an export under way finish and report; a second stops at once."""
    from overlayckpt.cli.target import emit
    from overlayckpt.messages import StatusRequest
    store = target.store or target.call(StatusRequest())["store"]
    stop = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal stop
        if stop:
            raise KeyboardInterrupt
        stop = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        while not stop:
            try:
                result = _export_all(target.call, args)
            except UserError:
                if target.mount is None or os.path.exists(os.path.join(target.mount, ".overlayckpt", "ctl")):
                    raise
                # the session was unmounted: one last export from its store, then stop
                result = _export_offline_when_free(store, args)
                if result["exported"]:
                    emit(args, result, _export_text)
                return 0
            if result["exported"]:
                emit(args, result, _export_text)
                sys.stdout.flush()
            deadline = time.monotonic() + args.every
            while not stop and time.monotonic() < deadline:
                time.sleep(min(0.1, args.every))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)


def _export_offline_when_free(store: str, args: argparse.Namespace) -> ExportGitReply:
    from overlayckpt.cli import client
    from overlayckpt.errors import StoreLocked

    deadline = time.monotonic() + 120
    while True:
        try:
            return _export_all(lambda cmd: client.offline(store, cmd), args, quiet=True)
        except StoreLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _bundle_path(file: str) -> str:
    path = os.path.abspath(file)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise UserError(f"cannot write bundle {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write bundle {path}: directory {parent} is not writable")
    if os.path.isdir(path):
        raise UserError(f"cannot write bundle {path}: it is a directory; give a file name")
    return os.path.join(os.path.realpath(parent), os.path.basename(path))


def cmd_import(args: argparse.Namespace) -> int:
    from overlayckpt.cli.target import emit
    from overlayckpt.export.importer import import_bundle  # (lmdb, zstd: only when used)
    from overlayckpt.store.places import check_store_dir
    if getattr(args, "store", None):  # (drop deletes a store's files: a directory of yours is refused)
        check_store_dir(os.path.abspath(args.store))
    result = import_bundle(args.file, args.store, args.repo)
    emit(args, result, lambda r: f"imported {r['checkpoints']} checkpoints into {r['store']} "
                                 f"(repo {r['repo']}); 'overlayckpt --store {r['store']} log' lists them")
    return 0


def add_cli(sub: Any, handlers: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    """Add the `export` and `import` subcommands to the CLI."""
    e = sub.add_parser("export", help="checkpoints as git commits (export git), or the session "
                                      "as one file (export bundle FILE)")
    e.add_argument("kind", choices=["git", "bundle"])
    e.add_argument("file", nargs="?", help="bundle: the file to write")
    e.add_argument("--branch", help="git: the branch to write (default overlayckpt/<session>)")
    e.add_argument("--since", help="git: start at this checkpoint (id or name) on a new branch")
    e.add_argument("--every", type=parse_duration, metavar="DURATION",
                   help="git: export again every DURATION (30s, 5m) until interrupted")
    i = sub.add_parser("import", help="load a session bundle into a new store")
    i.add_argument("file")
    i.add_argument("--repo", help="the repo the session belongs to (default: the one recorded)")
    handlers["export"] = cmd_export
    handlers["import"] = cmd_import
