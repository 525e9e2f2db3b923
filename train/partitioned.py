"""A target created partitioned under DeepSpeed ZeRO-3, each process reading only its part of every
weight: the ``model_loader`` the training loop gives ``heads.target.load_target`` under ZeRO-3."""

from __future__ import annotations

import math
import pathlib
import sys

import torch

from selfdraft.errors import SelfdraftError


def load_partitioned(folder: pathlib.Path, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module | None:
    """Under DeepSpeed ZeRO-3 (transformers' HfDeepSpeedConfig alive, as accelerate sets it for ZeRO-3
    loading): the model created partitioned (deepspeed.zero.Init) and each process reading only its
    part of every weight from the safetensors files. transformers' own ZeRO-3 loading reads the whole
    checkpoint into memory on rank 0. None when ZeRO-3 is off or the files do not name every weight
    (transformers then loads it).

    A partition is DeepSpeed's: weight w of n elements, flattened, padded to world x ceil(n / world);
    process r holds elements [r p, (r + 1) p) of that (deepspeed/runtime/zero/partition_parameters.py,
    ``_partition_param``, in deepspeed 0.19.8)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.initialization import no_init_weights

    files = sorted(folder.glob("*.safetensors"))
    if not is_deepspeed_zero3_enabled() or not files:
        return None
    import deepspeed
    from safetensors import safe_open

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    # Made partitioned and left uninitialised (transformers would gather every weight at once to
    # initialise it): the files fill each partition below.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                 trust_remote_code=trust_remote_code)
    model.tie_weights()  # no_init_weights skips post_init's tying too
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    params = dict(model.named_parameters())  # tied weights once
    if not set(params) <= set(where):
        missing = sorted(set(params) - set(where))
        print(f"selfdraft: {folder}'s files do not name {len(missing)} of the model's weights ({', '.join(missing[:3])}): "
              "transformers loads it instead, reading the whole checkpoint on rank 0", file=sys.stderr, flush=True)
        return None
    rank = deepspeed.comm.get_rank() if deepspeed.comm.is_initialized() else 0
    with torch.no_grad():
        for name, param in params.items():
            part = param.ds_tensor  # (p,) this process's partition
            p, n = part.numel(), param.ds_numel
            start, end = min(rank * p, n), min((rank + 1) * p, n)
            view = where[name].get_slice(name)
            shape = view.get_shape()
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            if tuple(shape) != tuple(param.ds_shape):
                raise SelfdraftError(f"{folder}: {name} has shape {tuple(shape)} in the files, {tuple(param.ds_shape)} in the model")
            part.zero_()
            if end > start:  # the rows covering [start, end), flattened and cut
                first, last = start // row, -(-end // row)
                flat = view[first:last].reshape(-1)[start - first * row: end - first * row]
                part[: end - start].copy_(flat.to(part.dtype))
    return model
