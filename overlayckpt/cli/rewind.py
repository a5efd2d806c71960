"""`overlayckpt rewind`: the timeline in the terminal.

Up/Down (or k/j, PageUp/PageDown, Home/End) move between checkpoints, the right pane
previews what that checkpoint changed and the conversation at it, Enter asks code /
conversation / both and restores, Esc or q leaves. The list scrolls with the selection
and the two panes share the terminal's width. The application talks to the session
only through `call` (the same JSON commands as the CLI), so tests drive it with a pipe
input and a dummy output, or in a pseudo-terminal; the rendering functions take the
size they render for.
"""
from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from prompt_toolkit.application import Application, get_app
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.layout import HSplit, Layout, VSplit, Window
from prompt_toolkit.layout.controls import FormattedTextControl
from prompt_toolkit.layout.dimension import Dimension

from overlayckpt.messages import (
    ConversationLine,
    ConversationRequest,
    DiffRequest,
    LogEntry,
    LogRequest,
    Request,
    RestoreReply,
    RestoreRequest,
)
from overlayckpt.names import line_text

R = TypeVar("R")


class Call(Protocol):
    """How the application reaches the session (cli.target.Target.call)."""

    def __call__(self, cmd: Request[R], /) -> R: ...


CHOICES = {"c": "code", "v": "conversation", "b": "both"}
LOADED = 2000  # checkpoints listed (newest first); older ones: log and restore
CONVERSATION_SHOWN = 8
# the fields of a tool's input or result that say what it did, in the order tried
BRIEF_KEYS = ("command", "file_path", "path", "pattern", "url", "description", "query",
              "stdout", "output", "content", "result", "error", "message", "filePath")


def list_width(columns: int) -> int:
    """Columns of the list: two fifths of the terminal, at least 30, at most 90 (the
    preview gets the rest, less one for the separator)."""
    return max(min(30, columns), min(90, columns * 2 // 5))


def _fit(text: str, width: int) -> str:
    # (escaped as the log is: a name or a line the agent wrote never drives the terminal)
    text = line_text(" ".join(text.split()))
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


def first_row(count: int, index: int, height: int) -> int:
    """The first entry shown so that the selection is visible (kept in the middle once
    the list is longer than the screen)."""
    if count <= height:
        return 0
    return max(0, min(index - height // 2, count - height))


def timeline_rows(checkpoints: list[LogEntry], index: int, width: int,
                  height: int) -> list[tuple[str, str]]:
    """The list as (style, line) rows, height at most, each width columns exactly."""
    top = first_row(len(checkpoints), index, height)
    rows = []
    for i in range(top, min(len(checkpoints), top + max(0, height))):
        c = checkpoints[i]
        name = f" [{c['name']}]" if c.get("name") else ""
        line = _fit(f"{c['id']:>4}{name} {c['time'][11:19]} {c['summary']}", width)
        rows.append(("reverse" if i == index else "", line.ljust(width)))
    return rows


def brief(content: object) -> str:
    """What a conversation line's content says, not its JSON: a tool's command, path or
    output; a text as it is."""
    value = content
    if isinstance(content, str) and content[:1] in "{[":
        try:
            value = json.loads(content)
        except ValueError:
            return content  # (a text that only starts like JSON, or JSON cut short)
    if isinstance(value, dict):
        for key in BRIEF_KEYS:
            if isinstance(found := value.get(key), str) and found.strip():
                return found
        return ", ".join(f"{k}={v}" for k, v in value.items() if isinstance(v, (str, int, float)))
    if isinstance(value, list):
        return " ".join(brief(v) if not isinstance(v, dict) else str(v.get("text", "")) for v in value)
    return str(value)


def conversation_line(line: Mapping[str, object]) -> str:
    """`role [tool]: text`."""
    tool = line.get("tool")
    text = brief(line.get("content"))
    if not text.strip() and line.get("summary"):
        text = str(line["summary"])
    return f"{line.get('role', '?')}{f' [{tool}]' if tool else ''}: {' '.join(text.split())}"


def preview_lines(patch: str, conversation: Sequence[Mapping[str, object]], width: int,
                  height: int) -> list[str]:
    """The preview pane: the conversation at the checkpoint (its last lines, each
    wrapped to at most three rows) below the start of the patch, all width columns."""
    talk = ["-- conversation at this checkpoint --"]
    for line in conversation[-CONVERSATION_SHOWN:] or [{"role": "(empty)", "content": ""}]:
        wrapped = textwrap.wrap(conversation_line(line), max(1, width), max_lines=3, placeholder="…")
        talk += wrapped or [""]
    talk = [_fit(t, width) for t in talk]
    room = max(0, height - len(talk))
    code = [_fit(t.expandtabs(), width) for t in patch.splitlines()[:room]]
    return (code + talk)[:max(0, height)]


class Rewind:
    def __init__(self, call: Call) -> None:
        self.call = call
        log = call(LogRequest(limit=LOADED))
        self.checkpoints = log["checkpoints"]
        self.index = 0
        self.asking = False
        self.message = "Up/Down PgUp/PgDn: move   Enter: restore   Esc/q: quit" + (
            f"   (the newest {LOADED}: older ones with log and restore)" if log.get("more") else "")
        self.result: RestoreReply | None = None
        self._patches: dict[int, tuple[str, list[ConversationLine]]] = {}

    @property
    def current(self) -> LogEntry:
        return self.checkpoints[self.index]

    def move(self, by: int) -> None:
        if not self.asking:
            self.index = max(0, min(len(self.checkpoints) - 1, self.index + by))

    def preview(self) -> tuple[str, list[ConversationLine]]:
        """The patch of the current checkpoint and the conversation at it (asked once)."""
        cid = self.current["id"]
        if cid not in self._patches:
            files = self.current["files"]
            if cid > 0 and files:
                try:
                    diff = self.call(DiffRequest(a=self._previous_id(), b=cid,
                                                 paths=[f["path"] for f in files][:20]))
                    patch = diff.get("patch", "")[:20000] or "(no content changes)"
                except Exception as e:  # a preview must never end the session
                    patch = f"(no preview: {e})"
            else:
                patch = "(no changes in this checkpoint)"
            try:
                conv = self.call(ConversationRequest(at=cid))["lines"]
            except Exception as e:
                conv = [{"role": "(no conversation", "content": f"{e})"}]
            self._patches[cid] = (patch, conv)
        return self._patches[cid]

    def _previous_id(self) -> int:
        later = self.checkpoints[self.index + 1:]  # newest first: the next entry is older
        return later[0]["id"] if later else 0

    def status_text(self) -> str:
        if self.asking:
            return f"Restore checkpoint {self.current['id']}: [c]ode, con[v]ersation, [b]oth, Esc: cancel"
        return self.message

    def restore(self, what: str) -> None:
        self.result = self.call(RestoreRequest(id=self.current["id"], what=what))


def _size() -> tuple[int, int]:
    """(columns, rows) of the list and preview: the terminal less the status line."""
    size = get_app().output.get_size()
    return size.columns, max(1, size.rows - 1)


def build_app(call: Call, **io: Any) -> tuple[Application[Any], Rewind]:
    state = Rewind(call)
    kb = KeyBindings()

    def page() -> int:
        return max(1, _size()[1] - 1)

    moves: dict[str, Callable[[], int]] = {
        "up": lambda: -1, "k": lambda: -1, "down": lambda: 1, "j": lambda: 1,
        "pageup": lambda: -page(), "pagedown": page,
        "home": lambda: -len(state.checkpoints), "end": lambda: len(state.checkpoints)}
    for key, by in moves.items():
        @kb.add(key)
        def _move(event: Any, by: Callable[[], int] = by) -> None:
            state.move(by())

    @kb.add("enter")
    def _enter(event: Any) -> None:
        state.asking = True

    for key, what in CHOICES.items():
        @kb.add(key)
        def _choose(event: Any, what: str = what) -> None:
            if state.asking:
                try:
                    state.restore(what)
                except Exception as e:
                    state.asking = False
                    state.message = f"restore failed: {e}"
                    return
                event.app.exit(result=state.result)

    @kb.add("escape", eager=True)
    @kb.add("q")
    def _quit(event: Any) -> None:
        if state.asking:
            state.asking = False
        else:
            event.app.exit(result=None)

    def timeline() -> FormattedText:
        columns, rows = _size()
        out: list[tuple[str, str]] = []
        for style, line in timeline_rows(state.checkpoints, state.index, list_width(columns), rows):
            out += [(style, line), ("", "\n")]
        return FormattedText(out[:-1])

    def preview() -> str:
        columns, rows = _size()
        patch, conv = state.preview()
        return "\n".join(preview_lines(patch, conv, max(1, columns - list_width(columns) - 1), rows))

    body = VSplit([
        Window(FormattedTextControl(timeline), width=lambda: Dimension.exact(list_width(_size()[0])),
               wrap_lines=False),
        Window(width=1, char="|"),
        Window(FormattedTextControl(preview), wrap_lines=False),
    ])
    root = HSplit([body, Window(FormattedTextControl(state.status_text), height=1, style="reverse")])
    app: Application[Any] = Application(layout=Layout(root), key_bindings=kb, full_screen=True, **io)
    return app, state
