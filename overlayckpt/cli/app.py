"""The `overlayckpt` command line: the parser and the dispatch.

Exit status: 0 ok, 1 failed (one line on stderr: what, why, what to do), 2 usage.
Commands on a session talk to its daemon through `.overlayckpt/ctl` when it is
mounted, or open its store directly (`--store`) when it is not.
The commands live one group per module: daemon.py (mount, unmount, run, status,
recover), timeline.py, export.py, hooks.py, bench.py.

A command that only talks to a daemon (a hook's `checkpoint`, `log`) is started
often and must start fast: this module imports only the parser's needs, each
command's module is imported when it runs, and nothing on that path imports
trio, lmdb or the other compiled dependencies (tests/test_promptness.py).
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable

from overlayckpt.errors import FsError, UserError

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from typing import Any


def _mount_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=None,
                   help="block size of a new store (default 4096: records.DEFAULT_BLOCK_SIZE)")
    p.add_argument("--window", type=float, default=None,
                   help="seconds of idleness that end an automatic checkpoint (0: one per operation)")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount")
    p.add_argument("--new", action="store_true",
                   help="start a fresh session of the repo instead of resuming the newest "
                        "(the old ones are kept: 'overlayckpt sessions' lists them)")


class _Skipped:
    """A subcommand's parser that build_parser(only=...) leaves out: takes every call."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with only, just that subcommand's (a parser of every subcommand
    costs more than a short command itself)."""
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
    added: list[str] = []

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        if only is not None and name != only:
            return _Skipped()  # type: ignore[return-value]  # a stand-in parser that takes any call
        added.append(name)
        return real_add(name, parents=[common], **kw)
    sub.add_parser = add_parser  # type: ignore[method-assign]  # builds only the command run

    m = sub.add_parser("mount", help="mount REPO (in place, or at MOUNTPOINT)")
    m.add_argument("repo")
    m.add_argument("mountpoint", nargs="?")
    m.add_argument("--foreground", action="store_true", help="serve in this process (debugging)")
    m.add_argument("--apply", dest="apply", action="store_true", default=None,
                   help="write the live state into the repo at unmount")
    m.add_argument("--no-apply", dest="apply", action="store_false")
    # (run --private's daemon: refuses its agent what reaches outside the sandbox)
    m.add_argument("--sandboxed", action="store_true", help=argparse.SUPPRESS)
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
    r.add_argument("--fork", type=int, default=None, metavar="N",
                   help="run CMD in each of N forks of the session's live state, at once; "
                        "print each fork's exit status and diff --stat (the forks are kept)")
    _mount_args(r)
    r.add_argument("cmd", nargs=argparse.REMAINDER)

    sub.add_parser("status", help="mount, repo, store, live checkpoint, counts")
    st = sub.add_parser(
        "stats", help="from the running daemon, since its mount: latency of writes, captures, "
                      "reads, fsyncs, checkpoints, restores; the store",
        description="What the running daemon measured since its mount. --json prints nested "
                    "objects (jq .writes.count, .writes.p99_us, .capture.max_us, .store.dedup_ratio); "
                    "latency in µs from a request's arrival at the daemon to its reply (capture: "
                    "until the write is in the store, which for writes answered early comes after "
                    "the reply); --prometheus prints the same as metrics for a node-exporter "
                    "textfile collector.")
    st.add_argument("--prometheus", action="store_true",
                    help="print the Prometheus text format (for a node-exporter textfile collector)")
    sub.add_parser("recover", help="salvage a damaged store (--store DIR) into a new one, "
                                   "keeping the damaged one beside it")

    h = sub.add_parser("hook", help="log one agent hook event (JSON on stdin) into the conversation")
    agents = ["claude-code", "codex", "gemini", "qwen", "cursor", "opencode"]
    h.add_argument("agent", choices=agents)
    ih = sub.add_parser("install-hooks", help="add our hooks (and MCP server) to the agent's user settings")
    ih.add_argument("agent", choices=agents)
    ih.add_argument("--settings", help="the hooks file (default: ~/.claude/settings.json, ~/.codex/hooks.json, "
                                       "~/.gemini/settings.json, ~/.qwen/settings.json, ~/.cursor/hooks.json, "
                                       "~/.config/opencode/plugins/overlayckpt.js)")
    ih.add_argument("--no-mcp", action="store_true",
                    help="do not register `overlayckpt mcp` (default: in ~/.claude.json, ~/.codex/config.toml, "
                         "~/.gemini/settings.json, ~/.qwen/settings.json, ~/.cursor/mcp.json)")
    ih.add_argument("--uninstall", action="store_true", help="take our hooks and MCP server out again")
    ih.add_argument("--project", default=".",
                    help="project whose .claude/settings.local.json loses our old hooks (default: current)")

    ss = sub.add_parser("sessions", help="the repo's sessions: created, last activity, "
                                         "checkpoints, size, mounted, the default")
    ss.add_argument("repo", nargs="?", help="default: the mount or repo containing the current directory")
    dr = sub.add_parser("drop", help="delete a session (not a mounted one): its id in "
                                     "'overlayckpt sessions', or its store directory")
    dr.add_argument("session")
    dr.add_argument("--repo", help="the repo whose session ID is meant (default: as for sessions)")

    fo = sub.add_parser("fork", help="a new session from checkpoint ID (default: the live "
                                     "state) of this one, mounted at MOUNTPOINT; no file data copied")
    fo.add_argument("id", nargs="?", help="the checkpoint (id or name; default: the live state, "
                                         "as a new checkpoint)")
    fo.add_argument("mountpoint")
    fo.add_argument("--fork-store", help="the fork's store (default: the repo's next numbered session)")

    be = sub.add_parser("bench", help="per-write snapshot latency on REPO, native against "
                                      "mounted, without changing REPO")
    be.add_argument("repo", help="the repository to measure (left as it is)")
    be.add_argument("--seconds", type=float, default=20.0,
                    help="seconds of measuring (default 20; sampling and mounting come on top)")

    sub.add_parser("mcp", help="serve this mount's timeline to an agent as an MCP server "
                               "(stdio): timeline, diff, checkpoint, restore")

    from overlayckpt.cli import timeline as cli_timeline
    cli_timeline.add_parsers(sub, only)
    if only is not None and not added:
        return build_parser()  # a misspelt command: the full parser lists the known ones
    return p


def _command_in(argv: list[str]) -> str | None:
    """The subcommand argv names (None with -h or when it cannot tell): the first word
    that is neither an option of `common` nor the value of --mount or --store."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("-h", "--help"):
            return None
        if word in ("--mount", "--store"):
            i += 2
            continue
        if not word.startswith("-"):
            return word
        i += 1
    return None


# the commands of daemon.py and hooks.py; every other one is timeline.py's (or export.py's)
DAEMON_COMMANDS = ("mount", "unmount", "run", "status", "recover")
HOOK_COMMANDS = ("hook", "install-hooks")
SESSION_COMMANDS = ("sessions", "drop")
FORK_COMMANDS = ("fork", "run-forks")  # (run-forks: run --fork N)


def handler_of(command: str) -> Callable[[argparse.Namespace], int]:
    if command in DAEMON_COMMANDS:
        from overlayckpt.cli import daemon
        return getattr(daemon, "cmd_" + command)
    if command == "stats":
        from overlayckpt.cli.stats import cmd_stats
        return cmd_stats
    if command == "mcp":
        from overlayckpt.cli.mcp import cmd_mcp  # (JSON-RPC on stdio, no SDK)
        return cmd_mcp
    if command == "bench":
        # (it mounts a scratch session of its own)
        from overlayckpt.cli.bench import cmd_bench
        return cmd_bench
    if command in FORK_COMMANDS:
        from overlayckpt.cli import fork
        return getattr(fork, "cmd_" + command.replace("-", "_"))
    if command in SESSION_COMMANDS:
        from overlayckpt.cli import sessions
        return getattr(sessions, "cmd_" + command)
    if command in HOOK_COMMANDS:
        from overlayckpt.cli import hooks
        return getattr(hooks, "cmd_" + command.replace("-", "_"))
    from overlayckpt.cli import timeline as cli_timeline
    return cli_timeline.HANDLERS[command]


def setup_logging(verbose: bool) -> None:
    import logging
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="overlayckpt: %(levelname)s %(name)s: %(message)s")


MAX_WINDOW = 86400.0  # seconds: a longer idle window is a mistake, not a setting
# a new store's block size: a power of two in this range (the range bundles are held to)
BLOCK_SIZES = (512, 1 << 20)
MAX_COUNT = 1 << 31  # --limit, --fork: larger is a typo


def check_options(args: argparse.Namespace) -> None:
    """Option values argparse's types let through: one line each, before anything runs."""
    import math
    window = getattr(args, "window", None)
    if window is not None and not (math.isfinite(window) and 0 <= window <= MAX_WINDOW):
        raise UserError(f"--window {window!r} is not a number of seconds from 0 to "
                        f"{MAX_WINDOW:g}: pass e.g. --window 1")
    block = getattr(args, "block_size", None)
    lo, hi = BLOCK_SIZES
    if block is not None and not (lo <= block <= hi and block & (block - 1) == 0):
        raise UserError(f"--block-size {block} is not a power of two from {lo} to {hi}: "
                        "pass e.g. --block-size 4096")
    for option, key, least, most in (("--limit", "limit", 0, MAX_COUNT), ("--fork", "fork", 1, MAX_COUNT),
                                     ("--budget", "budget", 0, 1 << 62)):
        value = getattr(args, key, None)
        if value is not None and not least <= value <= most:
            raise UserError(f"{option} {value} is out of range: pass a whole number from {least}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))
    paths: list[str] = []
    if "--" in argv and any(c in argv[:argv.index("--")] for c in ("diff", "restore", "backout")):
        i = argv.index("--")
        argv, paths = argv[:i], argv[i + 1:]
    args = parser.parse_args(argv)
    args.paths = paths
    for name, default in (("mount", None), ("store", None), ("json", False), ("verbose", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    # (a command that talks to a daemon logs nothing here: it spares the import)
    if args.verbose or args.store or args.command in DAEMON_COMMANDS + HOOK_COMMANDS + ("mcp",):
        setup_logging(args.verbose)
    try:
        check_options(args)
        handler = handler_of("run-forks" if getattr(args, "fork", None) is not None else args.command)
        return handler(args)
    except (UserError, FsError) as e:
        # nothing in it a terminal acts on (it may quote a name the agent chose); the values
        # it quotes are escaped whole (names.shown, quote_path), so its own newlines stay: a
        # backout's conflict report is several lines by design
        from overlayckpt.names import terminal_text
        print(f"overlayckpt: {terminal_text(str(e))}", file=sys.stderr)
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
        from overlayckpt.names import line_text
        where = line_text(os.fsdecode(e.filename)) if isinstance(e.filename, (str, bytes)) else ""
        print(f"overlayckpt: {e.strerror or e}: {where}".rstrip(": "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
