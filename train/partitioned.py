"""A target created partitioned under DeepSpeed ZeRO-3, each process reading only its part of every
weight: the ``model_loader`` the training loop gives ``heads.target.load_target`` under ZeRO-3."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from dataclasses import dataclass

import torch

from selfdraft.errors import SelfdraftError

logger = logging.getLogger(__name__)


def load_partitioned(folder: pathlib.Path, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module | None:
    """Under DeepSpeed ZeRO-3 (transformers' HfDeepSpeedConfig alive, as accelerate sets it for ZeRO-3
    loading): the model created partitioned (deepspeed.zero.Init) and each process reading only its
    part of every weight from the safetensors files. transformers' own ZeRO-3 loading reads the whole
    checkpoint into memory on rank 0. None when ZeRO-3 is off or the files do not name every weight
    (transformers then loads it).

    A partition is DeepSpeed's: weight w of n elements, flattened, padded to world x ceil(n / world);
    process r holds elements [r p, (r + 1) p) of that (deepspeed/runtime/zero/partition_parameters.py,
    ``_partition_param``, in deepspeed 0.19.8)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled
    from transformers.initialization import no_init_weights

    from selfdraft.heads.target_layers import attention_backend

    files = sorted(folder.glob("*.safetensors"))
    if not is_deepspeed_zero3_enabled() or not files:
        return None
    import deepspeed

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    config._attn_implementation = attention_backend(config)  # as load_target chooses it
    config.dtype = dtype
    # Made partitioned (deepspeed.zero.Init, with the run's DeepSpeed config as transformers passes it:
    # each weight is partitioned as soon as its module exists) and left uninitialised: the files fill
    # each partition below. The class is built directly: transformers' from_config under ZeRO-3 (5.24,
    # modeling_utils `_from_config`) then re-initialises every module through gathers
    # (integrations/deepspeed.py `initialize_weights_zero3`), which took the resident memory of each
    # process to the whole model's size during creation (scripts/bench_zero3_memory.py measures it).
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
    if model_class is None:  # a remote-code architecture: only from_config knows its class
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=deepspeed_config()):
                model = model_class(config)
        finally:
            torch.set_default_dtype(default)
    model.tie_weights()  # no_init_weights skips post_init's tying too
    stored = _index(files)
    params = dict(model.named_parameters())  # tied weights once
    if not set(params) <= set(stored):
        missing = sorted(set(params) - set(stored))
        logger.warning("%s's files do not name %d of the model's weights (%s): transformers loads it instead, reading "
                       "the whole checkpoint on rank 0", folder, len(missing), ", ".join(missing[:3]))
        return None
    rank = deepspeed.comm.get_rank() if deepspeed.comm.is_initialized() else 0
    with torch.no_grad():
        for name, param in params.items():
            part = param.ds_tensor  # (p,) this process's partition
            p, n = part.numel(), param.ds_numel
            start, end = min(rank * p, n), min((rank + 1) * p, n)
            if stored[name].shape != tuple(param.ds_shape):
                raise SelfdraftError(f"{folder}: {name} has shape {stored[name].shape} in the files, "
                                     f"{tuple(param.ds_shape)} in the model")
            part.zero_()
            if end > start:
                _read_elements(stored[name], start, part[: end - start])
    return model


# Weights are read with plain file reads of exactly this process's bytes. safetensors' safe_open maps
# the whole file: every page a slice touched then counted in the process's resident memory (about
# the whole target on every process while it loaded). The layout read here is safetensors' own: an
# 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
# data_offsets (relative to the end of the header), then the data, row-major.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class _Stored:
    path: pathlib.Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's first element in the file."""


def _index(files: list[pathlib.Path]) -> dict[str, _Stored]:
    """Where every tensor of a safetensors checkpoint lies, from the files' headers."""
    index = {}
    for path in files:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            length = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
            if not 0 < length <= size - 8:
                raise SelfdraftError(f"{path} is not a complete safetensors file (header of {length} bytes in a file "
                                     f"of {size}): re-download or re-save the target")
            try:
                header = json.loads(fh.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise SelfdraftError(f"{path} has a corrupt safetensors header ({err})") from err
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(entry.get("dtype"))
            begin, end = entry["data_offsets"]
            if dtype is None:
                raise SelfdraftError(f"{path}: {name} has dtype {entry.get('dtype')}, which ZeRO-3 loading does not read")
            if 8 + length + end > size:
                raise SelfdraftError(f"{path} is truncated: {name} ends at byte {8 + length + end} of {size}")
            index[name] = _Stored(path, dtype, tuple(entry["shape"]), 8 + length + begin)
    return index


def _read_elements(stored: _Stored, start: int, out: torch.Tensor) -> None:
    """Fill ``out`` (1-D) with elements [start, start + out.numel()) of the flattened stored tensor."""
    if not 0 <= start <= start + out.numel() <= math.prod(stored.shape):
        raise ValueError(f"elements [{start}, {start + out.numel()}) are outside a tensor of shape {stored.shape}")
    buffer = out if out.dtype == stored.dtype and out.is_contiguous() else torch.empty(out.numel(), dtype=stored.dtype)
    raw = buffer.view(torch.uint8).numpy()  # the buffer's bytes, filled in place
    with open(stored.path, "rb") as fh:
        fh.seek(stored.offset + start * buffer.element_size())
        done = 0
        while done < raw.size:
            got = fh.readinto(memoryview(raw)[done:])
            if not got:
                raise SelfdraftError(f"{stored.path} ended early while reading a weight")
            done += got
    if buffer is not out:
        out.copy_(buffer)
