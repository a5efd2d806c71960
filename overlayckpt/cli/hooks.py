"""The agent hooks: `hook` (run by the agent on each event) and `install-hooks`.

`python -m overlayckpt hook AGENT`, the command we install, never gets here:
overlayckpt/__main__.py hands it to core/agents.py before the CLI is imported.
"""
from __future__ import annotations

import argparse
import os
import sys


def cmd_hook(args: argparse.Namespace) -> int:
    from overlayckpt.core.agents import run_hook
    return run_hook(sys.stdin, args.mount, args.agent)


def cmd_install_hooks(args: argparse.Namespace) -> int:
    from overlayckpt.core.agents import HOOK_MARK, install_hooks, remove_project_hooks, user_settings_path
    command = f"{sys.executable} -m {HOOK_MARK} {args.agent}"
    path = install_hooks(os.path.abspath(args.settings or user_settings_path(args.agent)), command, args.agent)
    print(f"hooks written to {path} (they log only inside an overlayckpt mount)")
    if args.agent == "codex":
        print("Codex runs them once trusted: review them with /hooks in codex")
    old = remove_project_hooks(os.path.abspath(args.project)) if args.agent == "claude-code" else None
    if old:
        print(f"removed our hooks from {old} (restoring the code could delete it)")
    return 0
