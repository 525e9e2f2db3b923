"""selfdraft: self-drafting heads and an exact tree-verification decoder.

The top-level names are imported lazily so that ``import selfdraft`` (and the CLI's ``--help``)
does not pay for torch and transformers.
"""

__version__ = "0.2.0"

_LAZY = {
    "load_target": "selfdraft.heads.target",
    "Target": "selfdraft.heads.target",
    "TargetIdentity": "selfdraft.heads.target",
    "generate": "selfdraft.inference.api",
    "generate_batch": "selfdraft.inference.api",
    "GenerationResult": "selfdraft.inference.api",
    "make_drafter": "selfdraft.inference.specs",
    "run_bench": "selfdraft.inference.bench",
    "SelfdraftError": "selfdraft.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'selfdraft' has no attribute {name!r}")
