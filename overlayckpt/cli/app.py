"""The `overlayckpt` command line: the parser and the dispatch.

Exit status: 0 ok, 1 failed (one line on stderr: what, why, what to do), 2 usage.
Commands on a session talk to its daemon through `.overlayckpt/ctl` when it is
mounted, or open its store directly (`--store`) when it is not.
The commands live one group per module: daemon.py (mount, unmount, run, status,
recover), timeline.py, export.py, hooks.py.
"""
from __future__ import annotations

import argparse
import errno
import logging
import sys
from collections.abc import Callable
from typing import Any

from overlayckpt.errors import FsError, UserError
from overlayckpt.records import DEFAULT_BLOCK_SIZE
from overlayckpt.cli.daemon import cmd_mount, cmd_recover, cmd_run, cmd_status, cmd_unmount
from overlayckpt.cli.hooks import cmd_hook, cmd_install_hooks


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
    agents = ["claude-code", "codex", "gemini", "cursor"]
    h.add_argument("agent", choices=agents)
    ih = sub.add_parser("install-hooks", help="add our hooks (and MCP server) to the agent's user settings")
    ih.add_argument("agent", choices=agents)
    ih.add_argument("--settings", help="the hooks file (default: ~/.claude/settings.json, ~/.codex/hooks.json, "
                                       "~/.gemini/settings.json, ~/.cursor/hooks.json)")
    ih.add_argument("--no-mcp", action="store_true",
                    help="do not register `overlayckpt mcp` (default: in ~/.claude.json, ~/.codex/config.toml, "
                         "~/.gemini/settings.json, ~/.cursor/mcp.json)")
    ih.add_argument("--uninstall", action="store_true", help="take our hooks and MCP server out again")
    ih.add_argument("--project", default=".",
                    help="project whose .claude/settings.local.json loses our old hooks (default: current)")

    sub.add_parser("mcp", help="serve this mount's timeline to an agent as an MCP server "
                               "(stdio): timeline, diff, checkpoint, restore")

    from overlayckpt.cli import timeline as cli_timeline
    cli_timeline.add_parsers(sub)
    return p


def cmd_mcp(args: argparse.Namespace) -> int:
    from overlayckpt.cli.mcp import cmd_mcp as run  # (imports the mcp package only here)
    return run(args)


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "mount": cmd_mount, "unmount": cmd_unmount, "run": cmd_run, "status": cmd_status,
    "recover": cmd_recover,
    "hook": cmd_hook, "install-hooks": cmd_install_hooks, "mcp": cmd_mcp,
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
    from overlayckpt.cli import timeline as cli_timeline
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
