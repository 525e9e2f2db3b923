"""Hides the packages a lent device machine lacks (datasets, wandb, deepspeed, gguf) from imports and from
``importlib.util.find_spec`` (transformers' availability checks), so that the GPU check's smoke run on a
CPU (tests/test_gpu_check.py puts this folder on PYTHONPATH) needs no more than the device has."""

import sys

BLOCKED = ("datasets", "wandb", "deepspeed", "gguf")


class _Without:
    """A meta-path finder that finds nothing of the BLOCKED packages and asks the finder it wraps for the rest."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Without(f) for f in sys.meta_path]
