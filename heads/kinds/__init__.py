"""The built-in drafter kinds, registered on import: one folder each (a family of kinds may share one),
found here by looking, each folder's ``KINDS`` registered in the order of the folders' ``ORDER``.

Import the registry's functions from here (``from selfdraft.heads.kinds import get_kind``) so that the
built-in kinds are registered before the first lookup. A kind added at run time calls
:func:`register` with its own :class:`DrafterKind`; a folder added here is found without an edit.
"""

import importlib
import pkgutil

from selfdraft.heads.registry import (DrafterKind, Dims, EngineReader, EngineWriter, ExportContext, export_formats,
                                      get_kind, kind_of_module, read_engine_folder, register, registered, served_as, unregister)

_folders = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__) if m.ispkg]
for _folder in sorted(_folders, key=lambda folder: (folder.ORDER, folder.__name__)):
    for _kind in _folder.KINDS:
        register(_kind)

__all__ = ["DrafterKind", "Dims", "EngineReader", "EngineWriter", "ExportContext", "export_formats", "get_kind",
           "kind_of_module", "read_engine_folder", "register", "registered", "served_as", "unregister"]
