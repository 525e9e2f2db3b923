"""The built-in drafter kinds, registered on import: one folder each (a family of kinds may share one), one entry each below.

Import the registry's functions from here (``from selfdraft.heads.kinds import get_kind``) so that the
built-in kinds are registered before the first lookup. A kind added at run time calls
:func:`register` with its own :class:`DrafterKind`.
"""

from selfdraft.heads.registry import (DrafterKind, Dims, EngineReader, EngineWriter, ExportContext, export_formats,
                                      get_kind, kind_of_module, read_engine_folder, register, registered, served_as, unregister)
from selfdraft.heads.kinds import block, eagle, medusa

for _kind in (medusa.KIND, eagle.EAGLE1, eagle.EAGLE3, block.DFLASH, block.DSPARK):
    register(_kind)

__all__ = ["DrafterKind", "Dims", "EngineReader", "EngineWriter", "ExportContext", "export_formats", "get_kind",
           "kind_of_module", "read_engine_folder", "register", "registered", "served_as", "unregister"]
