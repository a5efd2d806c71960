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

import enum
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, NotRequired, TypedDict, TypeVar, dataclass_transform

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


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # a field's default when it has none: the field is required


class Field:
    """A request field: its name, its annotation as written, its default, and what its
    errors say: `must` (a value of the wrong type must be ...), `needs` (the line when it
    is missing), `choices`."""
    __slots__ = ("name", "type", "default", "must", "needs", "choices")

    def __init__(self, default: object, must: str | None, needs: str | None,
                 choices: tuple[str, ...]) -> None:
        self.name = self.type = ""  # (set by the request class)
        self.default, self.must, self.needs, self.choices = default, must, needs, choices


def arg(default: Any = MISSING, *, must: str | None = None, needs: str | None = None,
        choices: tuple[str, ...] = ()) -> Any:
    """A request field's default (none: required) and error texts (Field)."""
    return Field(default, must, needs, choices)


REQUESTS: dict[str, type[Request[Any]]] = {}  # command name -> its request class


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(arg,))
class Request(Generic[R]):
    """One control command; R is its reply. A frozen, keyword-only dataclass to the type
    checker, made here at run time: dataclasses (six compiled methods per class, and the
    modules it imports) cost every CLI start and the daemon's 16 ms."""
    CMD: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[Field, ...]] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        fields = list(cls.FIELDS)
        for name, kind in cls.__dict__.get("__annotations__", {}).items():
            if kind.startswith("ClassVar"):
                continue
            f = cls.__dict__.get(name, MISSING)
            f = f if isinstance(f, Field) else Field(f, None, None, ())
            f.name, f.type = name, kind
            fields.append(f)
            if name in cls.__dict__:
                delattr(cls, name)  # (an instance holds every field's value)
        cls.FIELDS = tuple(fields)
        REQUESTS[cls.CMD] = cls

    def __init__(self, **values: Any) -> None:
        for f in self.FIELDS:
            if f.name in values:
                value = values.pop(f.name)
            elif f.default is MISSING:
                raise TypeError(f"{type(self).__name__} needs {f.name}")
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        if values:
            raise TypeError(f"{type(self).__name__} takes no {', '.join(values)}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a request is frozen: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a request is frozen: cannot delete {name}")

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, f.name) for f in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Request)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self.FIELDS)
        return f"{type(self).__name__}({shown})"

    def to_json(self) -> dict[str, object]:
        """The line's object: "cmd" and the fields not at their defaults."""
        out: dict[str, object] = {"cmd": self.CMD}
        for f in self.FIELDS:
            value = getattr(self, f.name)
            if f.default is MISSING or value != f.default:
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
    fields = {f.name: f for f in cls.FIELDS}
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key == "cmd":
            continue
        f = fields.get(key)
        if f is None:
            takes = ", ".join(fields) or "nothing"
            raise UserError(f"{name} takes no field {shown(key)}; it takes: {takes}")
        kind = f.type
        optional = kind.endswith(" | None")
        if value is None and optional:
            continue  # null: the default
        passes, what = _CHECKS[kind.removesuffix(" | None")]
        choices = f.choices
        if not passes(value) or (choices and value not in choices):
            if choices:
                what = ", ".join(f'"{c}"' for c in choices[:-1]) + f' or "{choices[-1]}"'
            raise UserError(f'"{key}" must be {f.must or what}')
        values[key] = value
    for key, f in fields.items():
        if key not in values and f.default is MISSING:
            raise UserError(f.needs or f'{name} needs "{key}"')
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


class CheckpointRequest(Request[CheckpointReply]):
    CMD = "checkpoint"
    name: str | None = arg(default=None)
    message: str | None = arg(default=None)


class LogReply(TypedDict):
    checkpoints: list[LogEntry]
    more: bool
    forked_from: NotRequired[ForkPoint | None]


class LogRequest(Request[LogReply]):
    CMD = "log"
    limit: int = arg(default=0)
    file: str | None = arg(default=None)
    all: bool = arg(default=False)


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


class RestoreRequest(Request[RestoreReply]):
    CMD = "restore"
    id: Ref = arg(needs='restore needs "id" (a checkpoint id or name)')
    what: str | None = arg(default=None, choices=WHAT)  # None: both, or code with paths
    paths: list[str] | None = arg(default=None)


class BackoutReply(TypedDict):
    id: int | None
    backed_out: int
    files: list[FileChange]


class BackoutRequest(Request[BackoutReply]):
    CMD = "backout"
    id: Ref = arg(needs='backout needs "id" (a checkpoint id or name)')
    paths: list[str] | None = arg(default=None)
    all: bool = arg(default=False)


class ConversationReply(TypedDict):
    lines: list[ConversationLine]


class ConversationRequest(Request[ConversationReply]):
    CMD = "conversation"
    at: Ref | None = arg(default=None)
    all: bool = arg(default=False)


class DiffReply(TypedDict):
    a: int
    b: int | str  # "live"
    files: list[DiffFile]
    patch: NotRequired[str]


class DiffRequest(Request[DiffReply]):
    CMD = "diff"
    a: Ref | None = arg(default=None)
    b: Ref | None = arg(default=None)
    stat: bool = arg(default=False)
    paths: list[str] | None = arg(default=None)
    all: bool = arg(default=False)


class ShowReply(TypedDict):
    id: int
    files: NotRequired[list[ShownFile]]
    path: NotRequired[str]
    type: NotRequired[str]
    entries: NotRequired[list[str]]
    mode: NotRequired[int]
    content_b64: NotRequired[str]


class ShowRequest(Request[ShowReply]):
    CMD = "show"
    id: Ref = arg()
    path: str | None = arg(default=None)
    all: bool = arg(default=False)


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


class ApplyRequest(Request[ApplyReply]):
    CMD = "apply"
    checkpoint: Ref | None = arg(default=None)
    force: bool = arg(default=False)
    special: bool = arg(default=False)  # device nodes, fifos and sockets too


class FsckReport(TypedDict):
    clean: bool
    problems: list[str]
    blocks: int
    referenced: int
    checkpoints: int
    journal: int


class FsckReply(FsckReport):
    repaired: list[str]


class FsckRequest(Request[FsckReply]):
    CMD = "fsck"
    repair: bool = arg(default=False)


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


class GcRequest(Request[GcReply]):
    CMD = "gc"
    budget: int | None = arg(default=None, must="a number of bytes")  # None: the default, 5 GiB


class ForkMade(TypedDict):
    store: str
    checkpoint: int
    entries: int


class ForkReply(ForkMade):
    parent: str
    repo: str


class ForkRequest(Request[ForkReply]):
    CMD = "fork"
    store: str = arg(needs='fork needs "store" (the new session\'s store directory)')
    id: Ref | None = arg(default=None)


class UnforkReply(TypedDict):
    forgot: bool


class UnforkRequest(Request[UnforkReply]):
    CMD = "unfork"
    store: str = arg()


class ForksReply(TypedDict):
    parent: ForkPoint | None
    forks: dict[str, int]


class ForksRequest(Request[ForksReply]):
    CMD = "forks"


class ExportGitReply(TypedDict):
    branch: str
    ref: str
    exported: list[Exported]
    tip: str | None
    last: int | None
    remaining: NotRequired[int]  # (left out of the CLI's result, which exports them all)


class ExportGitRequest(Request[ExportGitReply]):
    CMD = "export_git"
    branch: str | None = arg(default=None)
    since: Ref | None = arg(default=None)
    limit: int = arg(default=0)


class ExportBundleReply(TypedDict):
    path: str
    bytes: int
    records: dict[str, int]
    checkpoints: int
    blocks: int
    journal: int


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
    repo_dirs_listed_in_c: NotRequired[int]  # (repo directories C listed itself: lowerdirs.c)
    repo_reads_in_c: NotRequired[int]  # (READs of repo files C answered from the repo)
    repo_attrs_in_c: NotRequired[int]  # (and GETATTRs of repo entries)
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


class StatsRequest(Request[StatsReply]):
    CMD = "stats"


class Summary(TypedDict):
    checkpoints: int
    unapplied: int
    applied: bool
    last_checkpoint: str | None


class SummaryReply(Summary):
    created: str | None


class SummaryRequest(Request[SummaryReply]):
    CMD = "summary"


class SetApplyReply(TypedDict):
    apply_on_unmount: bool


class SetApplyRequest(Request[SetApplyReply]):
    CMD = "set_apply"
    apply: bool = arg(needs='"apply" must be true or false')


class InterruptReply(TypedDict):
    interrupted: int


class InterruptRequest(Request[InterruptReply]):
    """Answered by the control directory itself (fuse/control.py), not by a Session."""
    CMD = "interrupt"


def reply_fields(cls: type[Request[Any]]) -> frozenset[str]:
    """The fields of cls's reply TypedDict (for the protocol doc's test)."""
    import typing
    base = next(b for b in cls.__orig_bases__ if typing.get_origin(b) is Request)  # type: ignore[attr-defined]  # typing keeps the subscripted base there
    reply = typing.get_args(base)[0]
    return frozenset(reply.__required_keys__ | reply.__optional_keys__)
