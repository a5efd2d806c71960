"""opencode: its plugin (our hooks there) and its events as Claude Code's.

opencode has no hook commands; it loads JavaScript plugins from `plugins/` (or
`plugin/`) of its config directories. `install-hooks opencode` writes PLUGIN into the
user's one (`$XDG_CONFIG_HOME/opencode/plugins/`, outside every captured tree, as the
other agents' user settings are): on `chat.message`, `tool.execute.before`,
`tool.execute.after`, a call's failure and `session.idle` it runs our compiled hook
(`overlayckpt-hook opencode`) with one small event on stdin, synchronously, and
swallows every error. The daemon makes the conversation line of it (as_claude, through
hooks.event_to_line): a tool call before it runs holds its checkpoint open, its result
ends it, as Claude's lines do.

The events' paths (a tool's filePath) are text for the summary only: nothing here opens
them. opencode keeps its sessions in its own SQLite database, which a restore does not
rewind (REWIND_NOTE).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

PLUGIN_NAME = "overlayckpt.js"
PLUGIN_MARK = "// overlayckpt: "  # the first line of every plugin we write (uninstall checks it)
# opencode's plugin events as the Claude events the conversation keys on
AS_CLAUDE = {"chat.message": "UserPromptSubmit", "tool.execute.before": "PreToolUse",
             "tool.execute.after": "PostToolUse", "tool.execute.error": "PostToolUseFailure",
             "session.idle": "Stop"}
REWIND_NOTE = ("opencode's own session is not rewound (it lives in opencode's database): "
               "start a new opencode session, or tell it which calls were undone")

# Kept small: the plugin cuts long strings (a written file's content, a read's output) to
# LIMIT characters before it sends an event; the conversation keeps 300 of them.
PLUGIN = """\
// overlayckpt: logs opencode's prompts and tool calls into the conversation of the
// overlayckpt mount it runs in (written by `overlayckpt install-hooks opencode`; taken out
// by `overlayckpt install-hooks opencode --uninstall`). Outside a mount it logs nothing.
import { spawnSync } from "node:child_process";

const COMMAND = __COMMAND__;
const LIMIT = 2000;

function cut(value, depth = 0) {
  if (typeof value === "string") return value.length > LIMIT ? value.slice(0, LIMIT) + "..." : value;
  if (value === null || typeof value !== "object" || depth > 8) return typeof value === "object" ? null : value;
  if (Array.isArray(value)) return value.slice(0, 100).map((v) => cut(v, depth + 1));
  const out = {};
  for (const key of Object.keys(value).slice(0, 100)) out[key] = cut(value[key], depth + 1);
  return out;
}

// Synchronous, as other agents run their hooks: a call's line lands before its changes.
function send(event) {
  try {
    spawnSync(COMMAND[0], COMMAND.slice(1), {
      input: JSON.stringify(cut(event)), stdio: ["pipe", "ignore", "ignore"], timeout: 10000,
    });
  } catch {}  // never fail the agent
}

export const OverlayckptPlugin = async ({ directory }) => {
  const cwd = directory || process.cwd();
  const said = new Map();  // session -> the assistant's last text
  return {
    "chat.message": async (input, output) => {
      try {
        const text = (output.parts || []).filter((p) => p && p.type === "text" && !p.synthetic)
          .map((p) => p.text).join("\\n");
        send({ hook_event_name: "chat.message", cwd, session_id: input.sessionID, prompt: text });
      } catch {}
    },
    "tool.execute.before": async (input, output) => {
      try {
        send({ hook_event_name: "tool.execute.before", cwd, session_id: input.sessionID,
               tool: input.tool, call_id: input.callID, args: output.args });
      } catch {}
    },
    "tool.execute.after": async (input, output) => {
      try {
        send({ hook_event_name: "tool.execute.after", cwd, session_id: input.sessionID,
               tool: input.tool, call_id: input.callID, title: output.title, output: output.output });
      } catch {}
    },
    event: async ({ event }) => {
      try {
        const p = event.properties || {};
        if (event.type === "message.part.updated" && p.part && p.part.type === "text"
            && p.part.time && p.part.time.end && !p.part.synthetic) {
          said.set(p.part.sessionID, p.part.text);
        } else if (event.type === "message.part.updated" && p.part && p.part.type === "tool"
                   && p.part.state && p.part.state.status === "error") {
          // a call that failed: tool.execute.after does not run for it
          send({ hook_event_name: "tool.execute.error", cwd, session_id: p.part.sessionID,
                 tool: p.part.tool, call_id: p.part.callID, error: p.part.state.error });
        } else if (event.type === "session.idle") {
          send({ hook_event_name: "session.idle", cwd, session_id: p.sessionID, message: said.get(p.sessionID) });
          said.delete(p.sessionID);
        }
      } catch {}
    },
  };
};
"""


def plugin_path() -> str:
    """Where opencode reads the user's own plugins: $XDG_CONFIG_HOME/opencode/plugins/
    (else ~/.config/opencode/plugins/), for every project, outside every captured tree."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "opencode", "plugins", PLUGIN_NAME)


def plugin_text(command: str) -> str:
    """PLUGIN running command (the hook command install-hooks made, a shell word list)."""
    import shlex
    return PLUGIN.replace("__COMMAND__", json.dumps(shlex.split(command)))


def is_ours(path: str) -> bool:
    """A plugin file we wrote (its first line is PLUGIN_MARK), not followed if a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return f.read(len(PLUGIN_MARK)) == PLUGIN_MARK.encode()


def _brief_input(tool: str, args: object) -> object:
    """A tool's input with opencode's names as Claude's (filePath: file_path), so the
    summary names the file; apply_patch's patchText as the command Codex's brief reads."""
    if not isinstance(args, dict):
        return args
    out = dict(args)
    if isinstance(out.get("filePath"), str) and "file_path" not in out:
        out = {"file_path": out.pop("filePath"), **out}
    if isinstance(out.get("patchText"), str) and "command" not in out:
        out = {"command": "apply_patch\n" + out.pop("patchText"), **out}
    return out


def as_claude(event: Mapping[str, object]) -> dict[str, object]:
    """One of our plugin's events in Claude Code's fields (hooks.event_to_line makes the
    line). Any JSON object may come here (anyone can run the hook): fields of another
    type become text or nothing, never an error."""
    name = event.get("hook_event_name")
    out: dict[str, object] = {"hook_event_name": AS_CLAUDE.get(str(name), name), "agent_event": name,
                           "session_id": event.get("session_id"), "cwd": event.get("cwd"),
                           "transcript_path": None}  # (opencode's sessions are in its database)
    tool = event.get("tool")
    out["tool_name"] = tool_name = tool if isinstance(tool, str) else "?"
    call = event.get("call_id")
    out["tool_use_id"] = call if isinstance(call, str) else None
    if name == "chat.message":
        out["prompt"] = event.get("prompt") if isinstance(event.get("prompt"), str) else ""
    elif name == "tool.execute.before":
        out["tool_input"] = _brief_input(tool_name, event.get("args"))
    elif name == "tool.execute.after":
        output = event.get("output")
        out["tool_response"] = output if output is not None else event.get("title")
    elif name == "tool.execute.error":
        out["error"] = event.get("error") if event.get("error") is not None else ""
    elif name == "session.idle":
        out["last_assistant_message"] = event.get("message")
    return out
