"""Tiny random targets for every causal-LM family transformers ships (a plain module: no tests in it).

The families are read from transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), and each
config is shrunk *generically* from its config class:

* the class's default config is built and read back with ``to_dict()`` (which round-trips through the
  constructor; per-layer attributes of heterogeneous configs are read with their global values);
* every int attribute that is a size is given a small consistent value by the first of ``_RULES`` (name
  patterns) that matches: hidden 64, heads 4, kv heads 2 (1 where the default is MQA, 4 where it is MHA or
  MLA), head_dim 16 (rope part 8), intermediate 128, experts 4 top-2 with 32-wide experts, LoRA ranks 32,
  SSM state 16 and Mamba heads expand*hidden/16, windows and chunk sizes ``window``, vocabularies
  ``vocab_size``, positions >= 512; other widths that equal a hidden size (adapters, projectors) follow it;
* attributes the class derives in ``__post_init__`` (fields defaulting to None, or no field at all:
  layer_types, head_dim of MLA configs, ...) are not passed, so the class re-derives them for the tiny
  sizes; per-layer lists it keeps at their default length are cut to the new layer count; lists of layer
  indices are filtered; per-layer overrides (``per_layer_config``) are scaled as their global values were;
* the layer count is the smallest >= 4 (<= 8) whose prefix of every default per-layer type list holds all of
  its kinds (gemma3: 6, for 5 sliding + 1 full), leaving room for KV-sharing layers where there are some;
* special token ids outside the vocabulary are moved inside it (one new id per old id);
* the config is built by calling the class with those keyword arguments, so that its validation runs.

``_QUIRKS`` holds the few family-specific keyword arguments the rules cannot find (mostly default configs
that their own model cannot run), each with its reason; ``_DEFAULT_KW`` those without which a default
config does not build; ``_NONE_FILL`` sizes a default leaves None although its model needs them.

API::

    families()                      every model_type of the causal-LM mapping (also ``FAMILIES``)
    SKIPPED                         {model_type: reason} of those that cannot generate on input_ids alone
    tiny_config(model_type, *, vocab_size=512, window=16, seed=0)   a small float32 PretrainedConfig
    tiny_model(model_type, **kw)    AutoModelForCausalLM.from_config(tiny_config(...)), seeded, eval, fp32
    layer_kinds(config)             a short description of the layer kinds the config has
    check_family(model_type)        one report row: built, generated, seconds, attention implementations

``python tests/families.py [family ...] [--timeout S] [--report PATH]`` builds each tiny model, runs a greedy
``generate`` of 24 tokens after a 30-token prompt (a repeating pattern of 7 ids), and prints (and writes
to /tmp/family_report.txt) one row per family and the failures, refusals and quirks below the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PretrainedConfig  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

# ------------------------------------------------------------------------------------------------------
# The tiny shape every family is shrunk to.
HIDDEN = 64
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
LAYERS = 4  # at least; raised (up to MAX_LAYERS) until every layer kind of the default pattern shows up
MAX_LAYERS = 8
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
EXPERTS = 4
TOP_K = 2
LORA_RANK = 32
ROPE_HEAD_DIM = 8
STATE = 16  # SSM state size
MIN_POSITIONS = 512

PROMPT_LEN = 30
NEW_TOKENS = 24
REPORT_PATH = "/tmp/family_report.txt"


def families() -> list[str]:
    """Every model_type of transformers' causal-LM mapping, in the registry's order."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


FAMILIES: list[str] = families()

SKIPPED: dict[str, str] = {
    "gemma4_assistant": "a drafter over a Gemma 4 target: every layer reads the target's shared KV cache",
    "gemma4_unified_assistant": "a drafter over a Gemma 4 target: every layer reads the target's shared KV "
                                "cache",
}
"""model_type -> why it cannot generate on input_ids alone (its tiny config and model are still built)."""


# ------------------------------------------------------------------------------------------------------
# Size rules: (regex on the attribute name, new value as a function of (old value, context)).
# The first rule whose regex fully matches the name decides; ints only (bools excluded). The context holds
# the default config's dict ("d"), the attribute's name ("name") and the tiny layer count ("layers").


def _keep(v, ctx):
    return v


def _cap(n):
    return lambda v, ctx: min(v, n)


def _set(n):
    return lambda v, ctx: n


def _positions(v, ctx):
    return max(v, MIN_POSITIONS)


def _layers(v, ctx):
    return ctx["layers"]


def _window(v, ctx):
    return ctx["window"] if ctx["is_text"] else v


def _vocab(v, ctx):
    return ctx["vocab_size"] if ctx["is_text"] or v > ctx["vocab_size"] else v


def _extra_vocab(v, ctx):  # hash / n-gram / per-layer-input tables: as small as the main vocabulary
    return min(v, ctx["vocab_size"])


def _layer_index(v, ctx):  # a layer index or a count of leading layers: keep it inside the stack
    return min(v, ctx["layers"] - 1)


def _period(v, ctx):  # every n-th layer: at most half the stack so that both kinds show up
    return max(1, min(v, ctx["layers"] // 2)) if v > 1 else v


def _offset(v, ctx):
    return min(v, max(0, ctx["layers"] // 2 - 1))


def _heads(v, ctx):
    if ctx["ssm"] and ctx["name"] == "num_heads":  # Mamba-2 heads: expand * hidden == heads * head_dim
        return max(1, ctx["mamba_inner"] // HEAD_DIM)
    return HEADS


def _kv_heads(*query_heads):
    """Keep the default's grouping: one kv head (MQA), as many as query heads (MHA, MLA), else GQA."""

    def rule(v, ctx):
        q = next((ctx["d"][k] for k in query_heads if isinstance(ctx["d"].get(k), int)), None)
        if v == 1:
            return 1
        if v == q:
            return HEADS
        return KV_HEADS

    return rule


def _head_dim(v, ctx):
    # MLA configs whose head_dim is their rope part (longcat_flash): keep them equal
    d = ctx["d"]
    if ctx["name"] == "head_dim" and v == d.get("qk_rope_head_dim"):
        return ROPE_HEAD_DIM
    # and those whose (sliding-window) head_dim is the whole MLA query head, nope + rope (dots3_note)
    if ctx["name"] not in ("qk_nope_head_dim", "v_head_dim") and isinstance(d.get("qk_nope_head_dim"), int) \
            and isinstance(d.get("qk_rope_head_dim"), int) and v == d["qk_nope_head_dim"] + d["qk_rope_head_dim"]:
        return HEAD_DIM + ROPE_HEAD_DIM
    return HEAD_DIM


def _mamba_heads(v, ctx):
    return max(1, ctx["mamba_inner"] // HEAD_DIM)


def _leading_dense(v, ctx):  # first_k_dense_replace & co: one dense layer, the rest sparse
    return min(v, 1)


def _kv_shared(v, ctx):
    return ctx["kv_shared"]


_WINDOWS = (r"sliding_window|sliding_window_size|attention_window_size|attention_chunk_size"
            r"|local_attention_window_len|local_attention|attention_window|window_size|keep_window_size")

_RULES: list[tuple[str, Any]] = [
    # counts of layers (token ids are handled apart)
    (r"num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|num_(de|en)coder_layers"
     r"|n_recurrent_layers|num_blocks", _layers),
    (r"n_input_layers|n_output_layers|num_global_layers|conf_num_hidden_layers", _set(1)),
    # heads
    (r"num_key_value_heads|num_kv_heads|num_query_groups|multi_query_group_num|kv_n_heads|indexer_kv_heads",
     _kv_heads("num_attention_heads", "n_heads", "num_heads", "n_head")),
    (r"swa_num_key_value_heads", _kv_heads("swa_num_attention_heads")),
    (r"linear_num_key_heads", _kv_heads("linear_num_value_heads")),
    (r"index_n_heads|index_num_heads|indexer_n_heads|heads_per_ngram", _set(HEADS // KV_HEADS)),
    (r"mamba_n_heads|mamba_num_heads|n_mamba_heads", _mamba_heads),
    (r"num_attention_heads|n_heads?|num_heads|attention_heads|(de|en)coder_attention_heads"
     r"|num_(de|en)coder_attention_heads|swa_num_attention_heads|conf_num_attention_heads"
     r"|linear_num_value_heads|linear_num_heads", _heads),
    # head dims
    (r"qk_rope_head_dim|rotary_dim|rotary_emb_dim", _set(ROPE_HEAD_DIM)),
    (r"head_dim|d_head|dim_head|attention_head_dim|attention_head_size|d_kv|kv_channels|swa_head_dim"
     r"|index_head_dim|indexer_head_dim|linear_(key_|value_)?head_dim|mamba_d_head|mamba_head_dim"
     r"|mamba_headdim|v_head_dim|qk_nope_head_dim|qk_head_dim|global_head_dim", _head_dim),
    # low ranks
    (r"(kv|q|o)_lora_rank", _set(LORA_RANK)),
    (r"laurel_rank|gated_norm_rank|loop_gate_rank|adapter_rank|hc_lowrank", _cap(16)),
    # experts
    (r"num_experts|n_routed_experts|num_local_experts|moe_num_experts|num_centroids", _set(EXPERTS)),
    (r"num_experts_per_tok|num_experts_per_token|moe_k|moe_topk|moe_top_k|top_k_experts|top_k"
     r"|centroid_intermediate_top_k", _cap(TOP_K)),
    (r"n_shared_experts|num_shared_experts|moe_num_shared_experts", _cap(1)),
    (r"n_group|num_expert_group|topk_group", _set(1)),
    (r"zero_expert_num", _cap(2)),
    # expert / shared-expert widths before the generic intermediate sizes
    (r"moe_intermediate_size|expert_ffn_hidden_size|shared_expert_intermediate_size"
     r"|shared_experts_intermediate_size|shared_intermediate_size|moe_shared_expert_intermediate_size"
     r"|moe_latent_size|mlp_only_intermediate_size", _set(EXPERT_INTERMEDIATE)),
    (r".*intermediate_size.*|.*ffn_dim|ffn_hidden_size|d_ff|dff|dim_ff|n_inner|d_inner|feed_forward_size"
     r"|mlp_dim|router_hidden_size", _set(INTERMEDIATE)),
    # widths
    (r"hidden_size|d_model|n_embd|emb_dim|embedding_dim|embedding_size|word_embed_proj_dim"
     r"|attention_hidden_size|hidden_size_global|lru_width|backbone_hidden_size|input_embedding_size"
     r"|output_embedding_size|out_hidden_size|projector_(input|output)_dim|ple_embed_dim"
     r"|pronunciation_embed_dim|shape_embed_dim|prompt_mid_dim|dim_model_base|encoder_cross_output_size",
     _set(HIDDEN)),
    (r"hidden_size_per_layer_input", _cap(16)),
    (r"query_pre_attn_scalar", lambda v, ctx: HEAD_DIM if v == ctx["d"].get("head_dim") else v),
    # SSM / linear attention
    (r"mamba_d_state|state_size|ssm_state_size|d_state", _set(STATE)),
    (r"mamba_n_groups|mamba_ngroups|n_groups", _set(1)),
    (r"time_step_rank|mamba_dt_rank", _set(8)),
    (r"mamba_d_ssm", lambda v, ctx: ctx["mamba_inner"]),
    (r"mamba_chunk_size|chunk_size", _keep),
    # windows and chunks (text configs only)
    (_WINDOWS, _window),
    # vocabularies and positions
    (r"vocab_size|unpadded_vocab_size", _vocab),
    (r".*vocab_size.*|.*_vocab|.*_vocab_size_base", _extra_vocab),
    (r"max_position_embeddings|n_positions|n_ctx|max_seq_len|max_target_positions|context_length",
     _positions),
    # layer indices, periods and counts of special layers
    (r"num_kv_shared_layers", _kv_shared),
    (r"first_k_dense_replace|num_dense_layers|num_dense_blocks|moe_layer_start_index", _leading_dense),
    (r"max_window_layers|moe_layer_end_index|loop_layer_index_start|loop_layer_index_end", _layer_index),
    (r".*_period|.*_interval|.*every_n_layers|interleave_moe_layer_step|decoder_sparse_step"
     r"|layer_group_size|n_layers_per_attn_res_block|rescale_every", _period),
    (r".*_offset", _offset),
    (r"num_nextn_predict_layers|num_mtp_layers", _cap(1)),
    # indexers (sparse attention): keep their budgets inside the tiny sequence
    (r"index_topk|indexer_budget|index_topk_blocks", lambda v, ctx: min(v, ctx["window"])),
]
_COMPILED = [(re.compile(p), f) for p, f in _RULES]

_NONE_FILL = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "num_experts_per_tok": TOP_K,
              "n_routed_experts": EXPERTS, "n_shared_experts": 1}
"""Sizes a few default configs leave None although their model reads them as ints (hunyuan_v1_*,
ministral: head_dim; nemotron: num_key_value_heads; deepseek_v2, dots1: num_experts_per_tok; dots1:
n_routed_experts, n_shared_experts)."""

_TOKEN_ID = re.compile(r"(bos|eos|pad|sep|cls|unk|mask|decoder_start|forced_eos|forced_bos|eod)_token_id")

_SKIP_KEYS = {"architectures", "transformers_version", "model_type", "id2label", "label2id", "dtype",
              "per_layer_config", "problem_type", "_name_or_path"}

# Per-family keyword arguments the generic rules cannot find, each with its reason. Values that are dicts
# are merged into the sub-config of that name.
_QUIRKS: dict[str, tuple[dict[str, Any], str]] = {
    "lfm2": ({"full_attn_idxs": [2]},
             "the default config is all attention; LFM2 checkpoints interleave short-conv layers"),
    "lfm2_moe": ({"layer_types": ["conv", "conv", "full_attention", "conv"]},
                 "the default config leaves layer_types None, which the model indexes"),
    "bamba": ({"attn_layer_indices": [2]},
              "the default config is all Mamba (and generate then fails: no attention layer for the mask)"),
    "granitemoehybrid": ({"layer_types": ["mamba", "mamba", "attention", "mamba"]},
                         "the default config is all Mamba (generate then fails as for bamba)"),
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                    "mrope_section": [4, 2, 2]}}},
                            "the default rope_parameters is empty although the model reads one per layer type"),
    "dbrx": ({"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
             "the model reads attn_config.rope_theta, which the default attention config lacks, and clamps "
             "with clip_qkv, which it leaves None (DBRX checkpoints: 500000, 8)"),
    "dots3_note_text": ({"head_dim": 32},
                        "its sliding layers' head_dim must be their (per-layer, 1.5x) qk_nope_head_dim + "
                        "qk_rope_head_dim"),
    "dots3_note": ({"text_config": {"head_dim": 32}}, "as dots3_note_text"),
    "reformer": ({"is_decoder": True, "axial_pos_embds_dim": [32, 32]},
                 "ReformerModelWithLMHead asserts is_decoder; the axial position dims must sum to hidden_size"),
    "qwen4_exp_text": ({"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                        "indexer_budget": 8, "indexer_compress_ratio": 4},
                       "the default layer_types has indexed_attention layers but leaves the QSA indexer unset"),
    "qwen4_exp": ({"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                   "indexer_budget": 8, "indexer_compress_ratio": 4}},
                  "as qwen4_exp_text"),
    "inkling2_loop_text": ({"n_layers_per_attn_res_block": 2, "loop_layer_index_start": 2,
                            "loop_layer_index_end": 4},
                           "loop start/end must be multiples of n_layers_per_attn_res_block"),
    "xlstm": ({"hidden_size": 128, "embedding_dim": 128},
              "hidden*qk_dim_factor must be a multiple of 64 (the cache rounds qk_dim up, the layers do not)"),
    "xmod": ({"default_language": "en_XX"}, "the model refuses input without a language"),
    "zamba": ({"num_hidden_layers": 5},
              "the shared attention block is tied across hybrid layers: it needs two of them"),
}

_ASSISTANT_TEXT = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
                   "use_double_wide_mlp": False}
_DEFAULT_KW: dict[str, dict] = {
    # the assistant's validation rejects its own default text config (gemma4_text's defaults)
    "gemma4_assistant": {"text_config": dict(_ASSISTANT_TEXT, model_type="gemma4_text")},
}
"""model_type -> keywords without which even the default config does not build."""


# ------------------------------------------------------------------------------------------------------


def _config_class(model_type: str):
    return CONFIG_MAPPING[model_type]


def _field_defaults(cls) -> dict[str, Any]:
    """The class-level defaults of a dataclass config (None where a field is derived in __post_init__)."""
    out = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


@contextlib.contextmanager
def _quiet():
    """Silence transformers' config warnings (they are about the default config, not ours)."""
    tlog = logging.getLogger("transformers")
    level = tlog.level
    tlog.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            tlog.setLevel(level)


def _as_dict(cfg) -> dict[str, Any]:
    """``cfg.to_dict()`` with the global values of per-layer attributes of heterogeneous configs."""
    prev = cfg.__dict__.get("allow_global_per_layer_attribute_access", False)
    cfg.__dict__["allow_global_per_layer_attribute_access"] = True
    try:
        with _quiet():
            d = cfg.to_dict()
            for k, v in list(d.items()):
                sub = cfg.__dict__.get(k)
                if isinstance(sub, PretrainedConfig):
                    d[k] = sub
    finally:
        cfg.__dict__["allow_global_per_layer_attribute_access"] = prev
    return d


def _per_layer_overrides(cfg) -> dict[int, dict[str, Any]]:
    spec = cfg.__dict__.get("_heterogeneity_spec")
    return {int(i): dict(o) for i, o in spec.per_layer_overrides.items()} if spec is not None else {}


def _num_layers(cfg) -> int | None:
    d = cfg if isinstance(cfg, dict) else cfg.__dict__
    for name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"):
        v = d.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _per_layer_lists(d: dict, n: int | None) -> dict[str, list]:
    """Entries of a config dict that are lists with one entry per layer."""
    if not n or n < 2:
        return {}
    return {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n}


def _is_text(cfg) -> bool:
    return hasattr(cfg, "vocab_size") and not any(
        t in (getattr(cfg, "model_type", "") or "") for t in ("vision", "audio", "vq")
    )


def _is_ssm(d: dict) -> bool:
    return any(k in d for k in ("state_size", "ssm_state_size", "mamba_d_state")) and "num_heads" in d


def _kinds_of(values: list) -> set:
    return {repr(v) for v in values}


def _layer_plan(default: PretrainedConfig) -> tuple[int, int]:
    """(layers, kv-shared layers): the smallest layer count >= LAYERS whose prefix of every default
    per-layer string list, and of the per-layer overrides, holds all of its kinds (capped at MAX_LAYERS);
    with KV sharing, the producing prefix must hold them."""
    d = _as_dict(default)
    n0 = _num_layers(d)
    lists = [v for v in _per_layer_lists(d, n0).values() if all(isinstance(x, str) for x in v)]
    overrides = _per_layer_overrides(default)
    if overrides and n0:
        lists.append([repr(sorted(overrides.get(i, {}).items())) for i in range(n0)])
    shared0 = d.get("num_kv_shared_layers") or 0
    for n in range(LAYERS, MAX_LAYERS + 1):
        shared = max(1, round(shared0 * n / n0)) if shared0 and n0 else 0
        if all(_kinds_of(v[:n]) == _kinds_of(v) for v in lists) and all(
                _kinds_of(v[:n - shared]) == _kinds_of(v) for v in lists if shared):
            return n, shared
    n = LAYERS
    return n, (max(1, round(shared0 * n / n0)) if shared0 and n0 else 0)


def _cut_layer_list(values: list, n: int) -> list:
    """Cut a per-layer list to n entries keeping, where the prefix misses a kind, its first occurrence."""
    out = list(values[:n])
    missing = [i for i, v in enumerate(values) if v not in out and values.index(v) == i]
    for j, i in enumerate(missing):
        if j + 1 < n:
            out[n - 1 - j] = values[i]
    return out


def _shrink_value(name: str, v, ctx):
    for rx, f in _COMPILED:
        if rx.fullmatch(name):
            return f(v, dict(ctx, name=name))
    # other widths that equal a hidden size of this config or of its parent (adapters, projectors)
    if re.search(r"dim|size|channels|width", name) and v in ctx.get("hiddens", ()):
        return HIDDEN
    return v


def _shrink_kwargs(default: PretrainedConfig, ctx: dict) -> dict[str, Any]:
    """Keyword arguments that rebuild ``default``'s class small (sub-configs as dicts of theirs)."""
    fdefaults = _field_defaults(type(default))
    d = _as_dict(default)
    n0 = _num_layers(d)
    n = ctx["layers"]
    hiddens = set(ctx.get("hiddens", ())) | {d[k] for k in ("hidden_size", "d_model", "n_embd")
                                              if isinstance(d.get(k), int) and d[k] > 1}
    ctx = dict(ctx, d=d, is_text=_is_text(default), ssm=_is_ssm(d), hiddens=hiddens)
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if k.startswith("_") or k in _SKIP_KEYS:
            continue
        if isinstance(v, PretrainedConfig):
            kw[k] = dict(_shrink_kwargs(v, ctx), model_type=v.model_type)
            continue
        if v is None and k in _NONE_FILL:  # left unset by the default config, but the model needs it
            kw[k] = _NONE_FILL[k]
            continue
        if isinstance(v, bool) or v is None or _TOKEN_ID.fullmatch(k):
            continue
        if fdefaults and (k not in fdefaults or fdefaults[k] is None) and not re.fullmatch(_WINDOWS, k):
            continue  # set in __post_init__ from the other fields: let the class derive it again
        if isinstance(v, int):
            new = _shrink_value(k, v, ctx)
            if new != v:
                kw[k] = new
        elif isinstance(v, list) and n0 and n0 > 1 and len(v) == n0:
            kw[k] = _shrink_layer_list(k, v, n, ctx)
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
                and re.search(r"layer|idxs|indexes|indices|layer_ids", k):
            kw[k] = sorted({x for x in v if x < n}) or [n - 1]  # a list of layer indices
    if "is_decoder" in fdefaults:
        kw["is_decoder"] = True  # BERT-like families decode causally only as decoders
    overrides = _per_layer_overrides(default)
    if overrides:
        kw["per_layer_config"] = _shrink_overrides(overrides, d, kw, n, ctx)
    # token ids inside the vocabulary
    vocab = kw.get("vocab_size", d.get("vocab_size"))
    if isinstance(vocab, int):
        used = {x for k, v in d.items() if _TOKEN_ID.fullmatch(k)
                for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and x < vocab}
        free = iter(i for i in range(vocab) if i not in used)
        moved: dict[int, int] = {}  # one new id per old id: eos == pad stays so

        def inside(x):
            if not isinstance(x, int) or x < vocab:
                return x
            if x not in moved:
                moved[x] = next(free)
            return moved[x]

        for k, v in d.items():
            if not _TOKEN_ID.fullmatch(k) or v is None:
                continue
            new = [inside(x) for x in v] if isinstance(v, list) else inside(v)
            if new != v:
                kw[k] = new
    return kw


def _shrink_layer_list(k: str, v: list, n: int, ctx) -> list:
    cut = _cut_layer_list(v, n)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in cut) and re.search(r"size|heads|dim", k):
        cut = [_shrink_value(re.sub(r"_per_layer$", "", k), x, ctx) for x in cut]
    return cut


def _shrink_overrides(overrides: dict, d: dict, kw: dict, n: int, ctx) -> dict[int, dict]:
    """Per-layer overrides of a heterogeneous config for the first n layers, each size scaled as its
    global value was (a layer with twice the global head_dim keeps twice the tiny one)."""
    out = {}
    for i, o in overrides.items():
        if i >= n:
            continue
        new = {}
        for attr, val in o.items():
            g0, g1 = d.get(attr), kw.get(attr, d.get(attr))
            if isinstance(val, int) and not isinstance(val, bool) and isinstance(g0, int) and g0 and g1:
                new[attr] = max(1, round(g1 * val / g0))
            elif isinstance(val, int) and not isinstance(val, bool):
                new[attr] = _shrink_value(attr, val, ctx)
            else:
                new[attr] = val
        out[i] = new
    return out


def _merge(kw: dict, extra: dict) -> dict:
    out = dict(kw)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls, kw):
    with _quiet():
        return cls(**kw)


def _build_checked(cls, kw: dict, default: PretrainedConfig, n: int) -> PretrainedConfig:
    """Build; where a per-layer list the class derives came out at the default length (or the build
    failed), pass those lists cut to n and build again."""
    d = _as_dict(default)
    lists = {k: v for k, v in _per_layer_lists(d, _num_layers(d)).items() if k not in kw}
    try:
        cfg, err = _build(cls, kw), None
    except Exception as e:  # noqa: BLE001
        cfg, err = None, e
    if cfg is not None:
        cd = _as_dict(cfg)
        nn = _num_layers(cd) or n
        lists = {k: v for k, v in lists.items() if isinstance(cd.get(k), list) and len(cd[k]) != nn}
        if not lists:
            return cfg
        n = nn
    if not lists:
        raise err  # type: ignore[misc]
    ctx = {"layers": n}
    kw2 = dict(kw, **{k: _shrink_layer_list(k, v, n, ctx) for k, v in lists.items()})
    return _build(cls, kw2)


def _text_part(cfg):
    return cfg.__dict__.get("text_config") or cfg


def tiny_config(model_type: str, *, vocab_size: int = 512, window: int = 16, seed: int = 0,
                num_layers: int | None = None) -> PretrainedConfig:
    """A tiny random-init config of ``model_type`` (see the module docstring). ``seed`` only matters to
    ``tiny_model``; it is accepted here so both take the same keywords."""
    del seed
    cls = _config_class(model_type)
    default = _build(cls, _DEFAULT_KW.get(model_type, {}))
    n, shared = _layer_plan(_text_part(default))
    n = num_layers or n
    d = _as_dict(_text_part(default))
    expand = d.get("mamba_expand", d.get("expand", 2))
    inner = int(expand * HIDDEN) if isinstance(expand, (int, float)) and not isinstance(expand, bool) else 128
    ctx = {"layers": n, "kv_shared": shared, "window": window, "vocab_size": vocab_size, "mamba_inner": inner,
           "hiddens": {d[k] for k in ("hidden_size",) if isinstance(d.get(k), int)}}
    kw = _shrink_kwargs(default, ctx)
    kw = _merge(_merge(_DEFAULT_KW.get(model_type, {}), kw), _QUIRKS.get(model_type, ({}, ""))[0])
    kw["dtype"] = torch.float32
    return _build_checked(cls, kw, default, kw.get("num_hidden_layers", n))


def tiny_model(model_type: str, *, attn_implementation: str | None = None, **kw) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config(model_type, **kw))`` seeded, in eval mode, float32.
    Where the registry maps a composite config to a causal-LM class built on one of its sub-configs and
    the composite does not build (musicgen: the decoder), that sub-config is used."""
    cfg = tiny_config(model_type, **kw)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    torch.manual_seed(kw.get("seed", 0))
    try:
        with _quiet():
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **extra)
    except Exception:
        model_cls, sub = _causal_sub_config(model_type, cfg)
        if sub is None:
            raise
        torch.manual_seed(kw.get("seed", 0))
        with _quiet():
            model = model_cls._from_config(sub, dtype=torch.float32, **extra)
        # musicgen pads its codebook delay pattern with decoder_start_token_id, which its checkpoints'
        # generation configs set to the decoder's bos (2048) and the decoder config lacks
        if getattr(model.generation_config, "decoder_start_token_id", None) is None:
            model.generation_config.decoder_start_token_id = getattr(sub, "bos_token_id", None)
        # MusicgenForCausalLM.generate expands its inputs by num_return_sequences, which a generation
        # config made from a model config leaves None
        if getattr(model.generation_config, "num_return_sequences", 1) is None:
            model.generation_config.num_return_sequences = 1
    return model.float().eval()


def _causal_sub_config(model_type: str, cfg):
    """The registry's causal-LM class and the sub-config of ``cfg`` of its own config class, if any."""
    import transformers

    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    want = getattr(model_cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return model_cls, None
    return model_cls, next((v for v in cfg.__dict__.values() if isinstance(v, want)), None)


# ------------------------------------------------------------------------------------------------------


def layer_kinds(config) -> list[str]:
    """A short description of the layer kinds ``config`` has, read from it: attention kinds from its
    per-layer type lists (full, sliding, chunked, linear, mamba, conv, recurrent, ...) or its window
    settings, then MLA (kv_lora_rank), MoE, attention sinks, soft-capping, KV sharing, per-layer overrides."""
    c = _text_part(config)
    d = _as_dict(c)
    kinds: list[str] = []

    def add(s):
        if s and s not in kinds:
            kinds.append(s)

    for k, v in d.items():  # per-layer (or cyclic) type lists: layer_types, layers_block_type, block_types...
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v) and not k.startswith("mtp") \
                and re.fullmatch(r"(\w+_)?(layer|block)s?_(block_)?types?|(attention|attn)_layers", k):
            for x in dict.fromkeys(v):
                add(_short_kind(x))
    use_sw = d.get("use_sliding_window", True) is not False
    if use_sw and any(d.get(k) for k in ("sliding_window", "sliding_window_size", "attention_window_size",
                                         "local_attention_window_len")) \
            and not any(k in ("sliding", "chunked") for k in kinds):
        if "attention" in kinds:  # recurrent_gemma: its attention blocks are local
            kinds[kinds.index("attention")] = "sliding"
        add("sliding")
    if d.get("attention_chunk_size"):
        add("chunked")
    if all(k == "MoE" for k in kinds):  # no layer-type list: one kind of mixer in every layer
        if re.search(r"mamba|rwkv|xlstm", c.model_type):
            add("recurrent")
        else:
            add("full")
    if d.get("kv_lora_rank"):
        add("MLA")
    ffn = d.get("ffn_config")
    ffn = ffn.__dict__ if isinstance(ffn, PretrainedConfig) else ffn if isinstance(ffn, dict) else {}
    if any(d.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")) \
            or ffn.get("moe_num_experts"):
        add("MoE")
    if c.model_type == "gpt_oss" or d.get("learnable_sink_init") is not None:
        add("attn-sinks")
    if d.get("attn_logit_softcapping"):
        add("attn-softcap")
    if d.get("final_logit_softcapping") or d.get("logits_soft_cap") or d.get("output_logit_soft_cap"):
        add("logit-softcap")
    if any(k.startswith("mamba_") for k in d) and "mamba" not in kinds:
        add("mamba")
    if d.get("num_kv_shared_layers"):
        add("kv-shared")
    nope = d.get("no_rope_layers")
    if isinstance(nope, list) and 0 in nope:  # 1 = rope, 0 = no rope (smollm3, llama4)
        add("NoPE")
    overrides = _per_layer_overrides(c)
    if overrides:
        add("per-layer:" + "+".join(sorted({a for o in overrides.values() for a in o})))
    return kinds


def _short_kind(x: str) -> str:
    """One entry of a layer-type list in the words of ``layer_kinds`` ("" for plain MLP blocks)."""
    x = x.lower()
    if x in ("moe", "sparse", "hash_moe"):
        return "MoE"
    if x in ("dense", "mlp"):
        return ""
    table = [("sliding", "sliding"), ("swa", "sliding"), ("chunk", "chunked"), ("linear", "linear"),
             ("mamba", "mamba"), ("conv", "conv"), ("recurrent", "recurrent"), ("full", "full"),
             ("global", "full"), ("local", "sliding")]
    for key, name in table:
        if key in x:
            return name
    return x.replace("_attention", "")


# ------------------------------------------------------------------------------------------------------
# The report.


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise _Timeout in the block after ``seconds`` (SIGALRM: main thread only, else no limit)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"timed out after {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def prompt_ids(vocab_size: int = 512, length: int = PROMPT_LEN) -> torch.Tensor:
    """A repeating pattern of 7 ids away from the low special ids."""
    pattern = [11, 29, 47, 83, 131, 173, 211]
    pattern = [p % (vocab_size - 16) + 8 for p in pattern]
    return torch.tensor([[pattern[i % len(pattern)] for i in range(length)]])


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:160]


def _missing_packages(model) -> list[str]:
    """Optional packages the model's modeling module would use and that are absent here, so that it runs
    its torch fallback: the fast-kernel packages of ``use_kernel_func_from_hub_with_fallback`` (mamba_ssm,
    causal_conv1d, fla) and the ``is_*_available`` checks it makes (mambapy, xlstm, ...)."""
    import importlib.util

    import transformers.utils.import_utils as iu

    mod = sys.modules.get(type(model).__module__)
    try:
        src = open(mod.__file__).read() if mod and mod.__file__ else ""
    except OSError:
        src = ""
    out = []
    for pkg in sorted(set(re.findall(r'use_kernel_func_from_hub_with_fallback\(\s*"[^"]+",\s*"([^"]+)"', src))):
        if importlib.util.find_spec(pkg) is None:
            out.append(pkg)
    for name in sorted(set(re.findall(r"\b(is_\w+_available)\b", src))):
        fn = getattr(iu, name, None)
        if fn is None or name in ("is_torch_available", "is_torchdynamo_compiling", "is_torch_cuda_available",
                                  "is_torch_flex_attn_available", "is_torch_greater_or_equal",
                                  "is_bitsandbytes_available"):
            continue
        try:
            ok = fn()
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            out.append(name[3:-10])
    return out


def check_family(model_type: str, timeout: float = 60.0) -> dict[str, Any]:
    """Build the tiny model of ``model_type`` and greedily generate NEW_TOKENS tokens after a PROMPT_LEN
    prompt, each step under ``timeout`` seconds; then whether sdpa and eager are accepted. Never raises."""
    row: dict[str, Any] = {"family": model_type, "built": "", "generate": "", "seconds": None, "gen_s": None,
                           "attn_default": "", "sdpa": "", "eager": "", "kinds": "", "new_tokens": None,
                           "missing": "", "quirk": _QUIRKS.get(model_type, (None, ""))[1]}
    t0 = time.perf_counter()
    try:
        with _deadline(timeout):
            cfg = tiny_config(model_type)
            row["kinds"] = ",".join(layer_kinds(cfg))
            model = tiny_model(model_type)
    except BaseException as e:  # noqa: BLE001 - the report records everything
        if isinstance(e, KeyboardInterrupt):
            raise
        row["built"] = _one_line(e)
        row["seconds"] = time.perf_counter() - t0
        return row
    row["built"] = "yes"
    if not isinstance(model.config, type(cfg)):
        row["built"] = f"yes (from {type(model.config).__name__})"
    row["attn_default"] = str(getattr(model.config, "_attn_implementation", None))
    row["missing"] = ",".join(_missing_packages(model))
    if model_type in SKIPPED:
        row["generate"] = "skipped: " + SKIPPED[model_type]
    else:
        ids = prompt_ids(getattr(_text_part(model.config), "vocab_size", 512) or 512)
        books = getattr(model.config, "num_codebooks", None)
        if isinstance(books, int) and books > 1:  # musicgen decoders: one row per codebook
            ids = ids.repeat(books, 1)
        t1 = time.perf_counter()
        try:
            with _deadline(timeout), torch.no_grad(), _quiet():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)
            out = out.sequences if hasattr(out, "sequences") else out
            row["new_tokens"] = int(out.shape[-1] - ids.shape[-1])
            row["generate"] = "ok"
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            row["generate"] = _one_line(e)
            try:  # is it the cache? (reported, not counted as generating)
                with _deadline(timeout), torch.no_grad(), _quiet():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, use_cache=False)
                row["generate"] += " [ok with use_cache=False]"
            except BaseException as e2:  # noqa: BLE001
                if isinstance(e2, KeyboardInterrupt):
                    raise
        row["gen_s"] = time.perf_counter() - t1
    row["seconds"] = time.perf_counter() - t0
    for impl in ("sdpa", "eager"):
        try:
            with _deadline(timeout):
                m = tiny_model(model_type, attn_implementation=impl)
                got = getattr(m.config, "_attn_implementation", None)
                row[impl] = "yes" if got == impl else f"got {got}"
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            row[impl] = "no: " + _one_line(e)
    return row


def _table(rows: list[dict]) -> str:
    head = ["family", "built", "generate", "s", "gen_s", "tok", "attn", "sdpa", "eager", "kinds", "absent pkgs"]
    cut = lambda x, w=28: x if len(x) <= w else x[: w - 3] + "..."  # noqa: E731
    lines = []
    for r in rows:
        lines.append([r["family"], cut(r["built"]), cut(r["generate"]),
                      "" if r["seconds"] is None else f"{r['seconds']:.2f}",
                      "" if r["gen_s"] is None else f"{r['gen_s']:.2f}",
                      "" if r["new_tokens"] is None else str(r["new_tokens"]),
                      r["attn_default"], cut(r["sdpa"], 12), cut(r["eager"], 12), r["kinds"], r["missing"]])
    widths = [max(len(head[i]), *(len(l[i]) for l in lines)) for i in range(len(head))]
    fmt = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [fmt(head), "-+-".join("-" * w for w in widths)]
    out += [fmt(l) for l in lines]
    n = len(rows)
    built = [r for r in rows if r["built"].startswith("yes")]
    gen = [r for r in rows if r["generate"] == "ok"]
    fast = [r for r in gen if r["seconds"] < 2]
    out += ["", f"{n} families, {len(built)} built, {len(gen)} generated, {len(fast)} of them in under 2 s "
                f"(build + generate); transformers {__import__('transformers').__version__}, "
                f"torch {torch.__version__}, {torch.get_num_threads()} threads"]
    fails = [r for r in rows if not r["built"].startswith("yes") or r["generate"] != "ok"]
    if fails:
        out += ["", "Not built or not generated:"]
        out += [f"  {r['family']}: {r['built'] if not r['built'].startswith('yes') else r['generate']}"
                for r in fails]
    slow = [r for r in gen if r["seconds"] >= 2]
    if slow:
        out += ["", "Generated in 2 s or more: " + ", ".join(f"{r['family']} ({r['seconds']:.1f} s)" for r in slow)]
    for impl in ("sdpa", "eager"):
        refused = [r for r in built if r[impl] != "yes"]
        plain = [r["family"] for r in refused if "does not support an attention implementation" in r[impl]]
        other = [f"{r['family']} ({r[impl]})" for r in refused if r["family"] not in plain]
        if plain:
            out += ["", f"attn_implementation={impl!r} refused as unsupported by: " + ", ".join(plain)]
        if other:
            out += ["", f"attn_implementation={impl!r} not taken:"] + [f"  {x}" for x in other]
    quirks = [r for r in rows if r["quirk"]]
    if quirks:
        out += ["", "Family-specific keywords (tests/families.py _QUIRKS):"]
        out += [f"  {r['family']}: {r['quirk']}" for r in quirks]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help="model_types (default: all of the causal-LM mapping)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per family and step")
    parser.add_argument("--report", default=REPORT_PATH)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with torch.no_grad(), _quiet():  # warm up (first-call costs would land on the first family's time)
        ids = prompt_ids()
        tiny_model("llama").generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    rows = []
    for mt in args.families or families():
        row = check_family(mt, timeout=args.timeout)
        rows.append(row)
        print(f"{mt:28s} built={row['built'][:60]} generate={row['generate'][:80]} "
              f"s={row['seconds'] or 0:.2f} kinds={row['kinds']}", flush=True)
    table = _table(rows)
    print(table)
    with open(args.report, "w") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
