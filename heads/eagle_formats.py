"""EAGLE layouts that serving engines load, written and read here (names follow vLLM's and SGLang's
``llama_eagle.py`` / ``llama_eagle3.py`` loaders).

EAGLE-1, ``LlamaForCausalLMEagle``: ``fc.weight`` [H, 2H] (input ``cat(embed, feature)``, no bias) and
``layers.0.*`` (a Llama decoder layer without ``input_layernorm``); no LM head (the target's is used)
and no embedding (shared with the target).

EAGLE-3, ``LlamaForCausalLMEagle3``: ``fc.weight`` [H, 3H]; ``midlayer.*`` with ``q/k/v_proj`` reading
2H, ``input_layernorm`` (on the embedding), ``hidden_norm`` (on the feature), ``post_attention_layernorm``
and ``mlp``; ``norm.weight``; ``lm_head.weight`` [V', H]; ``d2t`` int64 [V'] (target id - draft id) and
``t2d`` bool [V]. config.json carries ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (the fused target layers, as hidden_states indices).

Both config.json files are the target's text config (so rope, heads and dims match it) with one
hidden layer and the architecture replaced.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.eagle import EagleDrafter
from selfdraft.heads.io import load_strict, read_weights, write_folder

WEIGHTS = "model.safetensors"
ARCHITECTURES = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}


def _to_engine(kind: str, name: str) -> str:
    """Our state-dict name -> the engine's."""
    if kind == "eagle":
        return name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
    if name.startswith("layer."):
        return "midlayer." + name[len("layer."):]
    if name.startswith("hidden_norm."):
        return "midlayer." + name
    return name


def engine_contract(drafter: EagleDrafter) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape the engine layout of ``drafter`` holds."""
    return {_to_engine(drafter.kind, k): tuple(v.shape) for k, v in drafter.state_dict().items()}


def export_eagle(drafter: EagleDrafter, folder: str | os.PathLike) -> pathlib.Path:
    """Write an EAGLE-1 or EAGLE-3 drafter in the vLLM/SGLang layout (one layout serves both)."""
    cfg = drafter.layer_config
    if cfg.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise SelfdraftError(f"engines load EAGLE drafters as Llama layers; a {cfg.model_type} target's layer may differ")
    tensors = {_to_engine(drafter.kind, k): v for k, v in drafter.state_dict().items()}
    config = {k: v for k, v in drafter.dims["layer_config"].items() if not k.startswith("_")}
    config.update({
        "architectures": [ARCHITECTURES[drafter.kind]], "model_type": "llama", "num_hidden_layers": 1,
        "attention_bias": drafter.layer.self_attn.q_proj.bias is not None,
    })
    if drafter.kind == "eagle3":
        config.update({
            "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(drafter.aux_layers), "use_aux_hidden_state": True},
        })
    return write_folder(folder, WEIGHTS, tensors, config, metadata={"format": "pt"})


def is_engine_eagle_folder(path: str | os.PathLike) -> bool:
    """True for a folder whose config.json names an EAGLE-1/EAGLE-3 engine architecture."""
    config = pathlib.Path(path) / "config.json"
    try:
        arch = (json.loads(config.read_text(encoding="utf-8")).get("architectures") or [""])[0]
    except (OSError, ValueError, AttributeError):
        return False
    return arch in ARCHITECTURES.values()


def import_eagle(folder: str | os.PathLike, target_model) -> EagleDrafter:
    """Read an EAGLE-1/EAGLE-3 folder in the vLLM/SGLang layout as a drafter for ``target_model``.

    A hidden size, vocabulary or head layout that does not match the target is an error naming it."""
    from selfdraft.heads.formats import _read

    folder = pathlib.Path(folder)
    config, tensors = _read(folder, WEIGHTS)
    arch = (config.get("architectures") or [""])[0]
    kinds = {v: k for k, v in ARCHITECTURES.items()}
    if arch not in kinds:
        raise SelfdraftError(f"{folder}: architecture {arch!r} is not an EAGLE layout ({', '.join(kinds)})")
    kind = kinds[arch]
    text = target_model.config.get_text_config()
    for key in ("hidden_size", "vocab_size"):
        if key in config and config[key] != getattr(text, key):
            raise SelfdraftError(f"{folder} is an EAGLE drafter for {key} {config[key]}; the target has {getattr(text, key)}")
    fc = tensors.get("fc.weight")
    width = 2 if kind == "eagle" else 3
    if fc is None or tuple(fc.shape) != (text.hidden_size, width * text.hidden_size):
        raise SelfdraftError(f"{folder}: fc.weight is {None if fc is None else tuple(fc.shape)}, expected "
                             f"{(text.hidden_size, width * text.hidden_size)} for this target")
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = config.get("draft_vocab_size") or (tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None)
    drafter = EagleDrafter(EagleDrafter.dims_for(target_model, kind, draft_vocab_size=draft_vocab, aux_layers=aux))
    ours = {_to_engine(kind, k): k for k in drafter.state_dict()}
    tensors = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens.")}  # the target's is used
    if kind == "eagle3" and "t2d" not in tensors and "d2t" in tensors:  # t2d follows from d2t
        ids = tensors["d2t"].long() + torch.arange(len(tensors["d2t"]))
        tensors["t2d"] = torch.zeros(text.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    unknown = sorted(set(tensors) - set(ours))
    if unknown:
        raise SelfdraftError(f"{folder}: tensors this EAGLE layout does not have: {unknown[:5]}")
    state = {ours[k]: v for k, v in tensors.items()}
    load_strict(drafter, state, f"{folder}: tensors do not form the {arch} drafter its config describes")
    return drafter.eval()
