"""``accelerate launch -m selfdraft.train --config X.yaml [key=value ...]``: ``selfdraft train`` in each process."""

import sys

from selfdraft.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
