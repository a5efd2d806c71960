import sys

from overlayckpt.cli import main

sys.exit(main())
