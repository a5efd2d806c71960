import sys

if sys.argv[1:2] == ["hook"]:  # run by the agent on every event: no CLI imports
    from overlayckpt.agents.hooks import hook_main
    code = hook_main(sys.argv[2:])
    if code is not None:
        sys.exit(code)

from overlayckpt.cli.app import main

sys.exit(main())
