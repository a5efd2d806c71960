"""CLI commands on the timeline: checkpoint, log, diff, show, restore, backout, conversation."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    from overlayckpt.cli.fork import CrossDiff
    from overlayckpt.cli.target import Target
    from overlayckpt.messages import (
        BackoutReply,
        ConversationReply,
        DiffReply,
        GcReply,
        LogReply,
        Ref,
    )
    R = TypeVar("R")
# (the request classes, overlayckpt.messages, are imported where a command runs: loading
# dataclasses costs every CLI start, --help too, a few ms)


PAGE = 20  # log entries shown without --limit


def _target(args: argparse.Namespace) -> Target:
    from overlayckpt.cli.target import Target
    return Target(args)


def _emit(args: argparse.Namespace, result: R, text: Callable[[R], str]) -> int:
    from overlayckpt.cli.target import emit
    emit(args, result, text)
    return 0


def _ref(value: str) -> Ref:
    from overlayckpt.names import parse_ref  # (ASCII digits only: "²" and "１" are names)
    return parse_ref(value)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from overlayckpt.messages import CheckpointRequest
    result = _target(args).call(CheckpointRequest(name=args.name, message=args.message))
    return _emit(args, result, lambda r: str(r["id"]))


def _local_time(iso: str) -> str:
    import datetime
    t = datetime.datetime.fromisoformat(iso).astimezone()
    return t.strftime("%Y-%m-%d %H:%M:%S")


def cmd_log(args: argparse.Namespace) -> int:
    limit = args.limit if args.limit is not None else 0 if args.json else PAGE  # (scripts read all)
    from overlayckpt.messages import LogRequest
    result = _target(args).call(LogRequest(limit=limit, file=args.file, all=args.all))

    from overlayckpt.names import line_text, quote_path  # (names, paths, summaries: escaped)

    def text(r: LogReply) -> str:
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
            if folded := c.get("folded"):  # bookkeeping checkpoints, an agent's commit (log --all)
                delta += f" (also {', '.join(map(str, folded))}: folded in)"
            lines.append(f"{c['id']:>4}{name} {_local_time(c['time'])} {c['kind']:<7} {proc:<12} "
                         f"{line_text(c['summary'])}" + (f"\n       {files}{delta}" if files else ""))
        if r.get("more"):
            lines.append(f"(the newest {len(r['checkpoints'])}; older ones: --limit N, or --limit 0 for all)")
        elif forked := r.get("forked_from"):
            from overlayckpt.cli.fork import forked_from_line
            lines.append(forked_from_line(forked))
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
    from overlayckpt.messages import DiffRequest
    result = _target(args).call(DiffRequest(
        a=_ref(refs[0]) if refs else None, b=_ref(refs[1]) if len(refs) > 1 else None,
        stat=args.stat, paths=paths or None, all=args.all))
    return _emit(args, result, _diff_text(args))


def _diff_text(args: argparse.Namespace) -> Callable[[DiffReply | CrossDiff], str]:
    from overlayckpt.names import quote_path

    def text(r: DiffReply | CrossDiff) -> str:
        if args.stat:
            rows = [f" {f['change']} {quote_path(f['path'])} | " + ("Bin" if f["added"] is None else
                                                        f"+{f['added']} -{f['removed']}")
                    for f in r["files"]]
            rows.append(f" {len(r['files'])} files changed")
            return "\n".join(rows)
        # the bytes of the files as they are (a line that is not UTF-8 too), whatever the locale
        sys.stdout.flush()
        sys.stdout.buffer.write(r.get("patch", "").encode("utf-8", "surrogateescape"))
        sys.stdout.buffer.flush()
        return ""
    return text


def cmd_show(args: argparse.Namespace) -> int:
    from overlayckpt.messages import ShowRequest
    result = _target(args).call(ShowRequest(id=_ref(args.id), path=args.path, all=args.all))
    if args.json:
        return _emit(args, result, lambda r: "")
    if (content := result.get("content_b64")) is not None:
        import base64
        sys.stdout.buffer.write(base64.b64decode(content))
        sys.stdout.flush()
        return 0
    from overlayckpt.names import quote_path
    if (entries := result.get("entries")) is not None:
        print("\n".join(quote_path(e) for e in entries))
        return 0
    print("\n".join(quote_path(f["path"]) + ("/" if f["type"] == "dir" else "")
                    for f in result.get("files", [])))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from overlayckpt.messages import RestoreRequest
    result = _target(args).call(RestoreRequest(id=_ref(args.id), what=args.what,
                                               paths=args.paths or None))
    from overlayckpt.names import line_text
    for w in result.get("warnings", []):
        print(f"overlayckpt: warning: {line_text(w)}", file=sys.stderr)
    if (resume := result.get("resume")) and not args.json:
        print(f"agent transcript cut back to this checkpoint; continue with: {line_text(resume)}")
    return _emit(args, result, lambda r: f"restored checkpoint {r['restored']} ({r['what']}) "
                                         f"as checkpoint {r['id']}")


def cmd_backout(args: argparse.Namespace) -> int:
    from overlayckpt.messages import BackoutRequest
    result = _target(args).call(BackoutRequest(id=_ref(args.id), paths=args.paths or None,
                                               all=args.all))

    from overlayckpt.names import quote_path

    def text(r: BackoutReply) -> str:
        if r["id"] is None:
            return f"nothing to back out: the changes of checkpoint {r['backed_out']} are undone already"
        files = " ".join(f"{f['change']} {quote_path(f['path'])}" for f in r["files"][:6])
        more = f" (+{len(r['files']) - 6} more)" if len(r["files"]) > 6 else ""
        return (f"backed out checkpoint {r['backed_out']} as checkpoint {r['id']}: {files}{more}\n"
                f"(undo: overlayckpt restore {r['id'] - 1})")
    return _emit(args, result, text)


def cmd_conversation(args: argparse.Namespace) -> int:
    from overlayckpt.messages import ConversationRequest
    at = _ref(args.at) if args.at is not None else None
    result = _target(args).call(ConversationRequest(at=at, all=args.all))

    from overlayckpt.names import line_text, terminal_text  # (what the agent wrote: escaped)

    def text(r: ConversationReply) -> str:
        out = []
        for line in r["lines"]:
            mark = "" if line.get("live", True) else "(abandoned) "
            content = line.get("content")
            content = content if isinstance(content, str) else json.dumps(content)
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
        from overlayckpt.messages import ApplyRequest
        ck = _ref(args.checkpoint) if args.checkpoint is not None else None
        result = _target(args).call(ApplyRequest(checkpoint=ck, force=args.force,
                                                 special=args.special))
    except PartlyDone as e:  # (--json: what was written before it stopped, on stdout too)
        if args.json:
            json.dump({"error": str(e), **e.details}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        raise
    return _emit(args, result, applied_text)


def cmd_fsck(args: argparse.Namespace) -> int:
    from overlayckpt.messages import FsckRequest
    result = _target(args).call(FsckRequest(repair=args.repair))
    from overlayckpt.names import line_text
    _emit(args, result, lambda r: "\n".join(
        [f"repaired: {line_text(str(x))}" for x in r["repaired"]] + [line_text(p) for p in r["problems"]]
        + [f"{'clean' if r['clean'] else 'DAMAGED'}: {r['blocks']} blocks, {r['checkpoints']} checkpoints, "
           f"{r['journal']} journal records"]))
    return 0 if result["clean"] else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from overlayckpt.messages import GcRequest
    result = _target(args).call(GcRequest(budget=args.budget))

    def text(r: GcReply) -> str:
        return (f"thinned {r['thinned']} automatic checkpoints; swept {r.get('swept_inodes', 0)} "
                f"files and directories restores left unnamed; removed "
                f"{r.get('removed_blocks', 0)} blocks ({r.get('freed_bytes', 0)} bytes), kept "
                f"{r.get('kept_blocks', 0)}")
    return _emit(args, result, text)


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
        if resume := result.get("resume"):
            print(f"agent transcript cut back to this checkpoint; continue with: {line_text(resume)}")
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
