"""`overlayckpt rewind`: the timeline in the terminal.

Up/Down (or k/j) move between checkpoints, the right pane previews what that
checkpoint changed and the conversation at it, Enter asks code / conversation
/ both and restores, Esc or q leaves. The application talks to the session
only through `call` (the same JSON commands as the CLI), so tests drive it
with a pipe input and a dummy output.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prompt_toolkit.application import Application
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.layout import HSplit, Layout, VSplit, Window
from prompt_toolkit.layout.controls import FormattedTextControl

Call = Callable[[dict[str, Any]], dict[str, Any]]

CHOICES = {"c": "code", "v": "conversation", "b": "both"}


class Rewind:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.checkpoints = call({"cmd": "log"})["checkpoints"]
        self.index = 0
        self.asking = False
        self.message = "Up/Down: move   Enter: restore   Esc/q: quit"
        self.result: dict[str, Any] | None = None
        self._previews: dict[int, str] = {}

    @property
    def current(self) -> dict[str, Any]:
        return self.checkpoints[self.index]

    def timeline_text(self) -> FormattedText:
        out: list[tuple[str, str]] = []
        for i, c in enumerate(self.checkpoints):
            name = f" [{c['name']}]" if c["name"] else ""
            line = f"{c['id']:>4}{name} {c['time'][11:19]} {c['kind']:<7} {c['summary'][:60]}\n"
            out.append(("reverse" if i == self.index else "", line))
        return FormattedText(out)

    def preview_text(self) -> str:
        cid = self.current["id"]
        if cid not in self._previews:
            parts = []
            files = self.current["files"]
            if cid > 0 and files:
                try:
                    diff = self.call({"cmd": "diff", "a": self._previous_id(), "b": cid,
                                      "paths": [f["path"] for f in files][:20]})
                    parts.append(diff.get("patch", "")[:6000] or "(no content changes)")
                except Exception as e:  # a preview must never end the session
                    parts.append(f"(no preview: {e})")
            else:
                parts.append("(no changes in this checkpoint)")
            conv = self.call({"cmd": "conversation", "at": cid})["lines"][-6:]
            parts.append("\n-- conversation at this checkpoint --")
            parts += [f"{x['role']}: {str(x['content'])[:200]}" for x in conv] or ["(empty)"]
            self._previews[cid] = "\n".join(parts)
        return self._previews[cid]

    def _previous_id(self) -> int:
        later = self.checkpoints[self.index + 1:]  # newest first: the next entry is older
        return later[0]["id"] if later else 0

    def status_text(self) -> str:
        if self.asking:
            return f"Restore checkpoint {self.current['id']}: [c]ode, con[v]ersation, [b]oth, Esc: cancel"
        return self.message

    def restore(self, what: str) -> None:
        self.result = self.call({"cmd": "restore", "id": self.current["id"], "what": what})


def build_app(call: Call, **io: Any) -> tuple[Application[Any], Rewind]:
    state = Rewind(call)
    kb = KeyBindings()

    @kb.add("up")
    @kb.add("k")
    def _up(event: Any) -> None:
        if not state.asking and state.index > 0:
            state.index -= 1

    @kb.add("down")
    @kb.add("j")
    def _down(event: Any) -> None:
        if not state.asking and state.index < len(state.checkpoints) - 1:
            state.index += 1

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

    body = VSplit([
        Window(FormattedTextControl(state.timeline_text), width=80, wrap_lines=False),
        Window(width=1, char="|"),
        Window(FormattedTextControl(lambda: state.preview_text()), wrap_lines=True),
    ])
    root = HSplit([body, Window(FormattedTextControl(state.status_text), height=1, style="reverse")])
    app: Application[Any] = Application(layout=Layout(root), key_bindings=kb, full_screen=True, **io)
    return app, state
