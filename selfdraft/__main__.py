import sys

from selfdraft.cli import main

sys.exit(main())
