"""``accelerate launch -m selfdraft.train --config X.yaml [key=value ...]``: ``selfdraft train`` in each process."""

import sys

from selfdraft.cli import main
from selfdraft.log import setup_logging

setup_logging()  # each process reads its RANK / WORLD_SIZE: rank-prefixed lines, INFO on the main process only
sys.exit(main(["train", *sys.argv[1:]]))
