"""The agent hooks: `hook` (run by the agent on each event) and `install-hooks`.

`python -m overlayckpt hook AGENT`, the command we install, never gets here:
overlayckpt/__main__.py hands it to agents/hooks.py before the CLI is imported.
"""
from __future__ import annotations

import argparse
import os
import sys


def cmd_hook(args: argparse.Namespace) -> int:
    from overlayckpt.agents.hooks import run_hook
    return run_hook(sys.stdin, args.mount, args.agent)


def cmd_install_hooks(args: argparse.Namespace) -> int:
    from overlayckpt.agents import settings as agent_settings
    path = os.path.abspath(args.settings or agent_settings.user_settings_path(args.agent))
    mcp = None if args.no_mcp else agent_settings.mcp_config_path(args.agent, path)
    if args.uninstall:
        done = agent_settings.uninstall_hooks(path, args.agent)
        print(f"hooks removed from {path}" if done else f"no hooks of ours in {path}")
        if mcp and agent_settings.uninstall_mcp(mcp):
            print(f"MCP server removed from {mcp}")
        return 0
    # every directory checked before anything is written: the agent's own one may be made
    agent_settings.settings_dir(path, create=not args.settings, levels=2 if args.agent == "opencode" else 1)
    if mcp:
        agent_settings.settings_dir(mcp, create=False)
    import shlex
    program = agent_settings.hook_program()
    if program:  # a millisecond per event, where Python takes 20 ms to start
        command = f"{shlex.quote(program)} {args.agent}"
    else:
        command = f"{shlex.quote(sys.executable)} -P -m {agent_settings.HOOK_MARK} {args.agent}"
    agent_settings.install_hooks(path, command, args.agent)
    print(f"hooks written to {path} (they log only inside an overlayckpt mount)")
    if not program:
        print(f"note: the compiled hook ({agent_settings.HOOK_PROGRAM}) is not built, so each event starts "
              "Python (~50 ms): reinstall overlayckpt (make install) to build it")
    if args.agent == "gemini":
        print("Gemini's hook notifications are off (hooksConfig.notifications), so its status row stays quiet")
    if mcp:
        agent_settings.install_mcp(mcp, sys.executable, args.agent)
        print(f"MCP server `{agent_settings.MCP_NAME}` registered in {mcp} (it serves the mount the agent runs in)")
    if args.agent == "codex":
        print("Codex runs them once trusted: review them with /hooks in codex")
    old = agent_settings.remove_project_hooks(os.path.abspath(args.project)) if args.agent == "claude-code" else None
    if old:
        print(f"removed our hooks from {old} (restoring the code could delete it)")
    return 0
