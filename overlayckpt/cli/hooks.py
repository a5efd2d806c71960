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
    return run_hook(sys.stdin, args.mount)


def cmd_install_hooks(args: argparse.Namespace) -> int:
    from overlayckpt.core.agents import HOOK_MARK, install_hooks
    command = f"{sys.executable} -m {HOOK_MARK}"
    path = install_hooks(os.path.abspath(args.project), command)
    print(f"hooks written to {path}")
    return 0
