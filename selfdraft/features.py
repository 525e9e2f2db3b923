"""``accelerate launch -m selfdraft.features --config X.yaml [key=value ...]``: ``selfdraft features`` in each
process; the processes share the shards of one cache."""

import sys

from selfdraft.cli import main

sys.exit(main(["features", *sys.argv[1:]]))
