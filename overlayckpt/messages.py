"""The control protocol's messages: one request dataclass and one reply TypedDict per
`ctl` command (docs/protocol.md documents each; tests/core/test_messages.py holds the
two together).

The daemon turns every incoming line into a request with `parse` (an unknown command
or field, a wrong type, a missing field: UserError, one line); the CLI and the MCP
server build the same dataclasses and send `to_json()`. Replies travel as plain JSON
objects; their TypedDicts say what a handler returns and what a client reads. Rank 0:
the core's reports are reply parts too, and the CLI imports this without the service.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, NotRequired, TypedDict, TypeVar

from overlayckpt.errors import UserError
from overlayckpt.names import shown

# A checkpoint reference: an id, or a string (digits, a name, "@before-last").
Ref = int | str
R = TypeVar("R")


class Change(enum.StrEnum):
    """A change code, as stored and as sent: the same strings (log --json, groupfiles)."""
    ADDED = "A"
    MODIFIED = "M"
    DELETED = "D"
    RENAMED = "R"
    BEFORE = "<"  # the journal's: the old name of a rename (groupfiles keeps it beside "R")
    GONE = "gone"  # groupfiles': a path made and removed within one group


# -- requests ---------------------------------------------------------------------------

# field checks by annotation: (passes, what a value must be)
_CHECKS: dict[str, tuple[Callable[[object], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "a non-negative integer"),
    "Ref": (lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
            "a checkpoint id or name"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v),
                  "a list of strings"),
}


def arg(default: object = dataclasses.MISSING, *, must: str | None = None,
        needs: str | None = None, choices: tuple[str, ...] = ()) -> Any:
    """A request field: its default (none: required), and what its errors say: `must` (a
    value of the wrong type must be ...), `needs` (the line when it is missing), `choices`."""
    meta = {"must": must, "needs": needs, "choices": choices}
    return dataclasses.field(default=default, metadata=meta)


REQUESTS: dict[str, type[Request[Any]]] = {}  # command name -> its request class


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(Generic[R]):
    """One control command; R is its reply."""
    CMD: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        REQUESTS[cls.CMD] = cls

    def to_json(self) -> dict[str, object]:
        """The line's object: "cmd" and the fields not at their defaults."""
        out: dict[str, object] = {"cmd": self.CMD}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = value
        return out


def parse(raw: object) -> Request[Any]:
    """The request a decoded line holds, every field checked; else UserError (one line)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("cmd"), str):
        raise UserError('a command is a JSON object with a "cmd" string, e.g. {"cmd": "status"}')
    name = raw["cmd"]
    cls = REQUESTS.get(name)
    if cls is None:
        raise UserError(f"unknown command {shown(name)}; known: {', '.join(sorted(REQUESTS))}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key == "cmd":
            continue
        f = fields.get(key)
        if f is None:
            takes = ", ".join(fields) or "nothing"
            raise UserError(f"{name} takes no field {shown(key)}; it takes: {takes}")
        kind = str(f.type)
        optional = kind.endswith(" | None")
        if value is None and optional:
            continue  # null: the default
        passes, what = _CHECKS[kind.removesuffix(" | None")]
        choices = f.metadata["choices"]
        if not passes(value) or (choices and value not in choices):
            if choices:
                what = ", ".join(f'"{c}"' for c in choices[:-1]) + f' or "{choices[-1]}"'
            raise UserError(f'"{key}" must be {f.metadata["must"] or what}')
        values[key] = value
    for key, f in fields.items():
        if key not in values and f.default is dataclasses.MISSING:
            raise UserError(f.metadata["needs"] or f'{name} needs "{key}"')
    return cls(**values)


# -- replies' parts -----------------------------------------------------------------------

class FileChange(TypedDict):
    path: str
    change: str  # a Change value


class DiffFile(FileChange):
    added: int | None  # lines; None for a binary file
    removed: int | None


class Process(TypedDict):
    pid: int
    comm: str


class ForkPoint(TypedDict):
    store: str
    checkpoint: int


class LogEntry(TypedDict):
    id: int
    seq: int
    time: str
    kind: str
    name: str | None
    message: str | None
    summary: str
    files: list[FileChange]
    files_total: int
    empty: bool
    process: Process
    restored_from: int | None
    files_pending: bool
    added: NotRequired[int]
    removed: NotRequired[int]
    folded: NotRequired[list[int]]  # ids of bookkeeping checkpoints folded into this row


class ShownFile(TypedDict):
    path: str
    type: str
    size: int
    mode: int


class Exported(TypedDict):
    id: int
    commit: str


# a conversation line as stored: the fields its writer sent (foreign JSON), plus ours
ConversationLine = dict[str, object]


# -- the commands -------------------------------------------------------------------------

class CheckpointReply(TypedDict):
    id: int
    name: str | None
    seq: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRequest(Request[CheckpointReply]):
    CMD = "checkpoint"
    name: str | None = arg(None)
    message: str | None = arg(None)


class LogReply(TypedDict):
    checkpoints: list[LogEntry]
    more: bool
    forked_from: NotRequired[ForkPoint | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogRequest(Request[LogReply]):
    CMD = "log"
    limit: int = arg(0)
    file: str | None = arg(None)
    all: bool = arg(False)


class RestoreReply(TypedDict):
    id: int
    restored: int
    what: str
    changed_keys: int
    warnings: list[str]
    took_ms: dict[str, float]
    resume: NotRequired[str]
    transcript: NotRequired[str]
    claude_resume: NotRequired[str]


WHAT = ("code", "conversation", "both")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreRequest(Request[RestoreReply]):
    CMD = "restore"
    id: Ref = arg(needs='restore needs "id" (a checkpoint id or name)')
    what: str | None = arg(None, choices=WHAT)  # None: both, or code with paths
    paths: list[str] | None = arg(None)


class BackoutReply(TypedDict):
    id: int | None
    backed_out: int
    files: list[FileChange]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackoutRequest(Request[BackoutReply]):
    CMD = "backout"
    id: Ref = arg(needs='backout needs "id" (a checkpoint id or name)')
    paths: list[str] | None = arg(None)
    all: bool = arg(False)


class ConversationReply(TypedDict):
    lines: list[ConversationLine]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversationRequest(Request[ConversationReply]):
    CMD = "conversation"
    at: Ref | None = arg(None)
    all: bool = arg(False)


class DiffReply(TypedDict):
    a: int
    b: int | str  # "live"
    files: list[DiffFile]
    patch: NotRequired[str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffRequest(Request[DiffReply]):
    CMD = "diff"
    a: Ref | None = arg(None)
    b: Ref | None = arg(None)
    stat: bool = arg(False)
    paths: list[str] | None = arg(None)
    all: bool = arg(False)


class ShowReply(TypedDict):
    id: int
    files: NotRequired[list[ShownFile]]
    path: NotRequired[str]
    type: NotRequired[str]
    entries: NotRequired[list[str]]
    mode: NotRequired[int]
    content_b64: NotRequired[str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShowRequest(Request[ShowReply]):
    CMD = "show"
    id: Ref = arg()
    path: str | None = arg(None)
    all: bool = arg(False)


class Refused(TypedDict):
    path: str
    why: str


class ApplyStats(TypedDict):
    written: int
    removed: int
    pinned: int
    refused: list[Refused]  # left as the repo has them
    setid_dropped: list[str]  # written without their setuid/setgid bits


class ApplyReply(ApplyStats):
    repo: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApplyRequest(Request[ApplyReply]):
    CMD = "apply"
    checkpoint: Ref | None = arg(None)
    force: bool = arg(False)
    special: bool = arg(False)  # device nodes, fifos and sockets too


class FsckReport(TypedDict):
    clean: bool
    problems: list[str]
    blocks: int
    referenced: int
    checkpoints: int
    journal: int


class FsckReply(FsckReport):
    repaired: list[str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsckRequest(Request[FsckReply]):
    CMD = "fsck"
    repair: bool = arg(False)


class SweepReport(TypedDict):
    swept_inodes: int
    swept_keys: int


class GcReport(TypedDict):
    removed_blocks: int
    freed_bytes: int
    kept_blocks: int


class GcReply(TypedDict):
    thinned: int
    swept_inodes: NotRequired[int]  # (these: when anything was thinned, or always for gc)
    swept_keys: NotRequired[int]
    removed_blocks: NotRequired[int]
    freed_bytes: NotRequired[int]
    kept_blocks: NotRequired[int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GcRequest(Request[GcReply]):
    CMD = "gc"
    budget: int | None = arg(None, must="a number of bytes")  # None: the default, 5 GiB


class ForkMade(TypedDict):
    store: str
    checkpoint: int
    entries: int


class ForkReply(ForkMade):
    parent: str
    repo: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForkRequest(Request[ForkReply]):
    CMD = "fork"
    store: str = arg(needs='fork needs "store" (the new session\'s store directory)')
    id: Ref | None = arg(None)


class UnforkReply(TypedDict):
    forgot: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnforkRequest(Request[UnforkReply]):
    CMD = "unfork"
    store: str = arg()


class ForksReply(TypedDict):
    parent: ForkPoint | None
    forks: dict[str, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForksRequest(Request[ForksReply]):
    CMD = "forks"


class ExportGitReply(TypedDict):
    branch: str
    ref: str
    exported: list[Exported]
    tip: str | None
    last: int | None
    remaining: NotRequired[int]  # (left out of the CLI's result, which exports them all)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportGitRequest(Request[ExportGitReply]):
    CMD = "export_git"
    branch: str | None = arg(None)
    since: Ref | None = arg(None)
    limit: int = arg(0)


class ExportBundleReply(TypedDict):
    path: str
    bytes: int
    records: dict[str, int]
    checkpoints: int
    blocks: int
    journal: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportBundleRequest(Request[ExportBundleReply]):
    CMD = "export_bundle"
    path: str = arg(needs='export_bundle needs "path": an absolute file path')


class KernelStatus(TypedDict):
    kernel_dir_cache: bool
    repo_read_ahead: Mapping[str, object] | None  # how far the repo's read-ahead got
    dir_attrs_from_c: NotRequired[int]
    names_from_c: NotRequired[int]
    absent_from_c: NotRequired[int]  # (of names_from_c: answered as no such name)
    listings_from_c: NotRequired[int]
    attrs_from_c: NotRequired[int]
    kernel_invalidation: NotRequired[str]  # "epoch" or "entries"


class StatusReply(KernelStatus):
    repo: str
    mountpoint: str | None
    store: str
    pid: int | None
    in_place: bool
    apply_on_unmount: bool
    sandboxed: bool
    live_checkpoint: int | None
    block_size: int
    store_bytes: int
    checkpoints: int
    journal: int
    blocks: int
    nodes: int
    interruptible: NotRequired[bool]  # status.json's


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatusRequest(Request[StatusReply]):
    CMD = "status"


# a latency summary (core/latency.Histogram.summary): count, p50_us, p99_us, max_us, ...
Latencies = dict[str, float | int | None]


class StoreFigures(TypedDict):
    bytes: int
    blocks: int
    block_bytes: int
    logical_bytes: int  # captured since the mount
    new_bytes: int
    stored_bytes: int
    dedup_ratio: float | None
    compression_ratio: float | None


class HistogramDump(TypedDict):
    buckets: list[list[int]]  # [bucket, count] of each bucket that holds anything
    sum_ns: int
    max_ns: int


class StatsReply(TypedDict):
    mountpoint: str | None
    since: str
    uptime_s: float
    requests_timed: bool
    writes: Latencies
    capture: Latencies
    reads: Latencies
    fsyncs: Latencies
    checkpoints: Latencies
    restores: Latencies
    store: StoreFigures
    untimed: int
    histograms: NotRequired[dict[str, HistogramDump]]  # (--json leaves them out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatsRequest(Request[StatsReply]):
    CMD = "stats"


class Summary(TypedDict):
    checkpoints: int
    unapplied: int
    applied: bool
    last_checkpoint: str | None


class SummaryReply(Summary):
    created: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SummaryRequest(Request[SummaryReply]):
    CMD = "summary"


class SetApplyReply(TypedDict):
    apply_on_unmount: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class SetApplyRequest(Request[SetApplyReply]):
    CMD = "set_apply"
    apply: bool = arg(needs='"apply" must be true or false')


class InterruptReply(TypedDict):
    interrupted: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterruptRequest(Request[InterruptReply]):
    """Answered by the control directory itself (fuse/control.py), not by a Session."""
    CMD = "interrupt"


def reply_fields(cls: type[Request[Any]]) -> frozenset[str]:
    """The fields of cls's reply TypedDict (for the protocol doc's test)."""
    import typing
    base = next(b for b in cls.__orig_bases__ if typing.get_origin(b) is Request)  # type: ignore[attr-defined]  # typing keeps the subscripted base there
    reply = typing.get_args(base)[0]
    return frozenset(reply.__required_keys__ | reply.__optional_keys__)
