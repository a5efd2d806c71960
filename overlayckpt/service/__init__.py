"""The session and the JSON commands it answers (in the daemon or offline alike).

The one place that imports the command modules for their registrations
(registry.py): any import of overlayckpt.service.* runs this first, so a Session
always finds every command.
"""
from overlayckpt.service import commands, export_commands, stats  # noqa: F401  (register commands)
