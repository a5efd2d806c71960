"""CLI commands on the timeline: checkpoint, log, diff, show, restore, backout, conversation."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from typing import Any


PAGE = 20  # log entries shown without --limit


def _target(args: argparse.Namespace) -> Any:
    from overlayckpt.cli.target import Target
    return Target(args)


def _emit(args: argparse.Namespace, result: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> int:
    from overlayckpt.cli.target import emit
    emit(args, result, text)
    return 0


def _ref(value: str) -> Any:
    from overlayckpt.names import parse_ref  # (ASCII digits only: "²" and "１" are names)
    return parse_ref(value)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    result = _target(args).call({"cmd": "checkpoint", "name": args.name, "message": args.message})
    return _emit(args, result, lambda r: str(r["id"]))


def _local_time(iso: str) -> str:
    import datetime
    t = datetime.datetime.fromisoformat(iso).astimezone()
    return t.strftime("%Y-%m-%d %H:%M:%S")


def cmd_log(args: argparse.Namespace) -> int:
    limit = args.limit if args.limit is not None else 0 if args.json else PAGE  # (scripts read all)
    result = _target(args).call({"cmd": "log", "limit": limit, "file": args.file, "all": args.all})

    from overlayckpt.names import line_text, quote_path  # (names, paths, summaries: escaped)

    def text(r: dict[str, Any]) -> str:
        lines = []
        for c in r["checkpoints"]:
            files = " ".join(f"{f['change']} {quote_path(f['path'])}" for f in c["files"][:6])
            total = c.get("files_total", len(c["files"]))
            if total > 6:
                files += f" (+{total - 6} more)"
            if c.get("files_pending"):
                files = "(its files are being listed)"
            name = f" [{line_text(c['name'])}]" if c["name"] else ""
            proc = line_text(c["process"]["comm"] or "-")
            delta = f" +{c['added']} -{c['removed']}" if "added" in c else ""
            if c.get("folded"):  # bookkeeping checkpoints of ignored files (log --all)
                n = len(c["folded"])
                delta += f" (+{n} bookkeeping checkpoint{'s' if n > 1 else ''}: {', '.join(map(str, c['folded']))})"
            lines.append(f"{c['id']:>4}{name} {_local_time(c['time'])} {c['kind']:<7} {proc:<12} "
                         f"{line_text(c['summary'])}" + (f"\n       {files}{delta}" if files else ""))
        if r.get("more"):
            lines.append(f"(the newest {len(r['checkpoints'])}; older ones: --limit N, or --limit 0 for all)")
        elif r.get("forked_from"):
            from overlayckpt.cli.fork import forked_from_line
            lines.append(forked_from_line(r["forked_from"]))
        return "\n".join(lines)
    return _emit(args, result, text)


def cmd_diff(args: argparse.Namespace) -> int:
    refs, paths = args.refs, args.paths
    if any(":" in ref for ref in refs):  # SESSION:ID, across sessions of the repo
        from overlayckpt.cli.fork import cross_diff
        return cross_diff(args, _diff_text(args))
    if len(refs) > 2:
        from overlayckpt.errors import UserError
        raise UserError("diff takes at most two checkpoints: diff [A [B]] [-- PATH ...]")
    cmd: dict[str, Any] = {"cmd": "diff", "stat": args.stat, "paths": paths or None, "all": args.all}
    if refs:
        cmd["a"] = _ref(refs[0])
    if len(refs) > 1:
        cmd["b"] = _ref(refs[1])
    result = _target(args).call(cmd)
    return _emit(args, result, _diff_text(args))


def _diff_text(args: argparse.Namespace) -> Callable[[dict[str, Any]], str]:
    from overlayckpt.names import quote_path

    def text(r: dict[str, Any]) -> str:
        if args.stat:
            rows = [f" {f['change']} {quote_path(f['path'])} | " + ("Bin" if f["added"] is None else
                                                        f"+{f['added']} -{f['removed']}")
                    for f in r["files"]]
            rows.append(f" {len(r['files'])} files changed")
            return "\n".join(rows)
        # the bytes of the files as they are (a line that is not UTF-8 too), whatever the locale
        sys.stdout.flush()
        sys.stdout.buffer.write(r["patch"].encode("utf-8", "surrogateescape"))
        sys.stdout.buffer.flush()
        return ""
    return text


def cmd_show(args: argparse.Namespace) -> int:
    result = _target(args).call({"cmd": "show", "id": _ref(args.id), "path": args.path, "all": args.all})
    if args.json:
        return _emit(args, result, lambda r: "")
    if "content_b64" in result:
        import base64
        sys.stdout.buffer.write(base64.b64decode(result["content_b64"]))
        sys.stdout.flush()
        return 0
    from overlayckpt.names import quote_path
    if "entries" in result:
        print("\n".join(quote_path(e) for e in result["entries"]))
        return 0
    print("\n".join(quote_path(f["path"]) + ("/" if f["type"] == "dir" else "") for f in result["files"]))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    paths = args.paths
    cmd: dict[str, Any] = {"cmd": "restore", "id": _ref(args.id)}
    if args.what:
        cmd["what"] = args.what
    if paths:
        cmd["paths"] = paths
    result = _target(args).call(cmd)
    from overlayckpt.names import line_text
    for w in result.get("warnings", []):
        print(f"overlayckpt: warning: {line_text(w)}", file=sys.stderr)
    if result.get("resume") and not args.json:
        print("agent transcript cut back to this checkpoint; continue with: "
              f"{line_text(result['resume'])}")
    return _emit(args, result, lambda r: f"restored checkpoint {r['restored']} ({r['what']}) "
                                         f"as checkpoint {r['id']}")


def cmd_backout(args: argparse.Namespace) -> int:
    cmd: dict[str, Any] = {"cmd": "backout", "id": _ref(args.id), "all": args.all}
    if args.paths:
        cmd["paths"] = args.paths
    result = _target(args).call(cmd)

    from overlayckpt.names import quote_path

    def text(r: dict[str, Any]) -> str:
        if r["id"] is None:
            return f"nothing to back out: the changes of checkpoint {r['backed_out']} are undone already"
        files = " ".join(f"{f['change']} {quote_path(f['path'])}" for f in r["files"][:6])
        more = f" (+{len(r['files']) - 6} more)" if len(r["files"]) > 6 else ""
        return (f"backed out checkpoint {r['backed_out']} as checkpoint {r['id']}: {files}{more}\n"
                f"(undo: overlayckpt restore {r['id'] - 1})")
    return _emit(args, result, text)


def cmd_conversation(args: argparse.Namespace) -> int:
    cmd: dict[str, Any] = {"cmd": "conversation", "all": args.all}
    if args.at is not None:
        cmd["at"] = _ref(args.at)
    result = _target(args).call(cmd)

    from overlayckpt.names import line_text, terminal_text  # (what the agent wrote: escaped)

    def text(r: dict[str, Any]) -> str:
        out = []
        for line in r["lines"]:
            mark = "" if line.get("live", True) else "(abandoned) "
            content = line["content"] if isinstance(line["content"], str) else json.dumps(line["content"])
            tool = f" [{line_text(str(line['tool']))}]" if line.get("tool") else ""
            out.append(f"{mark}{line_text(str(line['role']))}{tool}: {terminal_text(content)}")
        return "\n".join(out)
    return _emit(args, result, text)


def cmd_apply(args: argparse.Namespace) -> int:
    from overlayckpt.cli.applied import applied_text
    from overlayckpt.errors import PartlyDone
    try:
        if args.from_session:  # another session of the repo (a fork): its own apply
            from overlayckpt.cli.fork import apply_from
            result = apply_from(args)
            return _emit(args, result, lambda r: applied_text(r, f"{args.from_session} "))
        cmd: dict[str, Any] = {"cmd": "apply", "force": args.force}
        if args.special:
            cmd["special"] = True
        if args.checkpoint is not None:
            cmd["checkpoint"] = _ref(args.checkpoint)
        result = _target(args).call(cmd)
    except PartlyDone as e:  # (--json: what was written before it stopped, on stdout too)
        if args.json:
            json.dump({"error": str(e), **e.details}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        raise
    return _emit(args, result, applied_text)


def cmd_fsck(args: argparse.Namespace) -> int:
    result = _target(args).call({"cmd": "fsck", "repair": args.repair})
    from overlayckpt.names import line_text
    _emit(args, result, lambda r: "\n".join(
        [f"repaired: {line_text(str(x))}" for x in r["repaired"]] + [line_text(p) for p in r["problems"]]
        + [f"{'clean' if r['clean'] else 'DAMAGED'}: {r['blocks']} blocks, {r['checkpoints']} checkpoints, "
           f"{r['journal']} journal records"]))
    return 0 if result["clean"] else 1


def cmd_gc(args: argparse.Namespace) -> int:
    cmd: dict[str, Any] = {"cmd": "gc"}
    if args.budget is not None:
        cmd["budget"] = args.budget
    result = _target(args).call(cmd)
    return _emit(args, result, lambda r: f"thinned {r['thinned']} automatic checkpoints; swept "
                                         f"{r['swept_inodes']} files and directories restores left "
                                         f"unnamed; removed {r['removed_blocks']} blocks "
                                         f"({r['freed_bytes']} bytes), kept {r['kept_blocks']}")


def cmd_rewind(args: argparse.Namespace) -> int:
    from overlayckpt.cli.rewind import build_app
    target = _target(args)
    if not sys.stdin.isatty():
        from overlayckpt.errors import UserError
        raise UserError("rewind is interactive: run it in a terminal (or use log and restore)")
    app, _ = build_app(target.call)
    result = app.run()
    if result:
        from overlayckpt.names import line_text
        print(f"restored checkpoint {result['restored']} ({result['what']}) as checkpoint {result['id']}")
        if result.get("resume"):
            print("agent transcript cut back to this checkpoint; continue with: "
                  f"{line_text(result['resume'])}")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "checkpoint": cmd_checkpoint, "log": cmd_log, "diff": cmd_diff, "show": cmd_show,
    "restore": cmd_restore, "backout": cmd_backout, "conversation": cmd_conversation, "apply": cmd_apply,
    "fsck": cmd_fsck, "gc": cmd_gc, "rewind": cmd_rewind,
}


def add_parsers(sub: Any, only: str | None = None) -> None:
    c = sub.add_parser("checkpoint", help="a named checkpoint of the live state; prints its id")
    c.add_argument("name", nargs="?")
    c.add_argument("-m", "--message")

    lg = sub.add_parser("log", help="the timeline, newest first")
    lg.add_argument("--file", help="only checkpoints that changed this path")
    lg.add_argument("--limit", type=int, help=f"at most N entries (0: all; default {PAGE}, all with --json)")
    lg.add_argument("--all", action="store_true",
                    help="also checkpoints without net changes, and git's internals (.git/...)")

    d = sub.add_parser("diff", help="unified diff between checkpoints (B defaults to live, A to 0)")
    d.add_argument("refs", nargs="*", metavar="A [B]", help="then optionally: -- PATH ...")
    d.add_argument("--stat", action="store_true")
    d.add_argument("--all", action="store_true", help="also git's internals (.git/...)")
    d.add_argument("--repo", help="the repo whose sessions SESSION:ID names (default: as for sessions)")

    s = sub.add_parser("show", help="a checkpoint's files, or one file's content at it")
    s.add_argument("id")
    s.add_argument("path", nargs="?")
    s.add_argument("--all", action="store_true", help="also git's internals (.git/...)")

    r = sub.add_parser("restore", help="rewind code, conversation or both to a checkpoint")
    r.add_argument("id", help="then optionally: -- PATH ... (only these files, code only)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--code", dest="what", action="store_const", const="code")
    g.add_argument("--conversation", dest="what", action="store_const", const="conversation")
    g.add_argument("--both", dest="what", action="store_const", const="both")

    bo = sub.add_parser("backout", help="undo one checkpoint's changes and keep later ones "
                                        "(a three-way merge), as a new checkpoint")
    bo.add_argument("id", help="then optionally: -- PATH ... (only these files)")
    bo.add_argument("--all", action="store_true", help="also git's internals (.git/...)")

    ap = sub.add_parser("apply", help="write the live state (or a checkpoint) into the repo")
    ap.add_argument("--checkpoint")
    ap.add_argument("--from", dest="from_session", metavar="SESSION[:ID]",
                    help="apply another session of the repo (a fork: its id in 'sessions'), "
                         "live or at checkpoint ID")
    ap.add_argument("--repo", help="the repo whose session --from names (default: as for sessions)")
    ap.add_argument("--force", action="store_true",
                    help="overwrite files that also changed in the repo since the session began")
    ap.add_argument("--special", action="store_true",
                    help="also write device nodes, fifos and sockets (refused and listed without it)")

    fk = sub.add_parser("fsck", help="verify every block digest and every reference")
    fk.add_argument("--repair", action="store_true", help="drop corrupt blocks and dangling names")
    gcp = sub.add_parser("gc", help="thin old automatic checkpoints over budget; reclaim unreferenced blocks")
    gcp.add_argument("--budget", type=int, help="bytes of blocks to keep before thinning (default 5 GiB)")

    sub.add_parser("rewind", help="interactive timeline: move, preview, restore")

    if only in (None, "export", "import"):
        from overlayckpt.cli.export import add_cli
        add_cli(sub, HANDLERS)

    cv = sub.add_parser("conversation", help="the conversation now, at a checkpoint, or all branches")
    cv.add_argument("--at")
    cv.add_argument("--all", action="store_true")
