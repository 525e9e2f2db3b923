"""An emulator of how SGLang loads an exported DFlash or DSpark drafter folder and drafts a block with it.

Written from SGLang's own code (sgl-project/sglang; the commit of each stored file version read):

* python/sglang/srt/models/dflash.py                      (003b23d7: ``DFlashDraftModel``, its layers, ``load_weights``)
* python/sglang/srt/models/dspark.py                      (01f47623, 37e23874; 67d00001: a reduced draft vocabulary)
* python/sglang/srt/speculative/dflash_utils.py           (00731f0b: ``parse_dflash_draft_config``)
* python/sglang/srt/speculative/dflash_worker.py          (0468412f: the block, the context keys and values, greedy drafts)
* python/sglang/srt/speculative/dspark_components/dspark_config.py (01f47623, 8764d5a5), dspark_draft.py (0143365d)
* python/sglang/srt/models/qwen3.py (01b5f572), llama.py (00239548): what the target captures

Behaviours encoded (each read in the files above):

1. The model class comes from ``architectures[0]``: ``DFlashDraftModel`` or ``Qwen3DSparkModel``; anything
   else is refused. ``hidden_act`` must be silu. ``layer_types`` absent or all ``full_attention``: every
   draft layer attends without a causal mask (``AttentionType.ENCODER_ONLY``); a sliding layer is causal
   and windowed, which is not emulated (refused as unsupported).
2. Config: ``num_target_layers``, ``block_size``, ``target_layer_ids`` and ``mask_token_id`` are read from
   ``dflash_config`` first, then the top level. Block size defaults: 16 (DFlash), 7 (DSpark's gamma). The
   mask token must be below the target's vocabulary (its embedding is the target's row). DSpark needs
   ``markov_rank`` > 0; ``markov_head_type`` vanilla is emulated; ``sample_from_anchor`` (default true)
   decides whether the anchor's slot drafts.
3. RoPE: ``rope_parameters["rope_theta"]`` where ``rope_parameters`` exists, else ``rope_theta`` (default
   10000); neox (rotate-half) style; only the default, unscaled rope is emulated.
4. Weights: a ``model.`` prefix is stripped; q/k/v and gate/up are stacked from their own names; any other
   unknown name is DROPPED SILENTLY (listed in ``Emulator.ignored``), DFlash's ``lm_head``, ``d2t`` and
   ``embed_tokens`` among them: DFlash drafts through the target's embedding and LM head. A parameter no
   tensor fills would stay uninitialised in SGLang: the emulator raises. ``fc.weight`` must be
   [H, K H] for K target layers ("DFLASH fc.weight shape mismatch").
5. DSpark's ``markov_head.markov_w1`` [V, r] and ``markov_w2`` [V or V', r] under exactly these names.
   A reduced draft vocabulary (``draft_vocab_size`` < ``vocab_size``; from 67d00001 on) needs ``lm_head``
   [V', H] and ``d2t`` (target id = draft id + d2t[draft id], in range and one-to-one); with
   ``reduced_vocab=False`` (01f47623, 37e23874) ``lm_head.`` is skipped and ``markov_w2`` must be [V, r].
6. Target features: id i is "the output of decoder layer i", captured before layer i + 1 (the residual
   stream, transformers' ``hidden_states[i + 1]``), concatenated in ascending layer order. An id of the
   last layer is accepted by the config check but never captured: the first forward fails on the feature
   width, raised here at load.
7. Context: the committed tokens before the anchor (the last committed token, which the target has not
   read): ``hidden_norm(fc(features))``, then each layer's k/v projections (no input_layernorm), its k
   norm and RoPE at the context positions, written to that layer's cache.
8. The block: [anchor, mask x (n - 1)] at positions p .. p + n - 1 (p = the anchor's position), n =
   block_size (DFlash; DSpark with ``sample_from_anchor``) or block_size + 1 (DSpark without it: the
   anchor slot's output is dropped). Embeddings from the target. Pre-norm Qwen3 layers (q/k norms), the
   final norm. DFlash: the target's LM head on slots 1..n-1, argmax: block_size - 1 drafts. DSpark:
   base logits from the target's head (or its own over V'), then left to right
   ``base + markov_w2(markov_w1[previous])``, argmax, the previous token starting at the anchor and
   always a target id.
9. Each drafted token's chance of acceptance, which SGLang's DSpark planner sizes verification by
   (``dspark_planner.py`` 00c3cffa; outside ``SGLANG_RAGGED_VERIFY_MODE=static``, the default, in which
   ``build_confidence_head`` builds none and its tensors are skipped): the confidence head,
   ``sigmoid(proj(cat(h_k, markov_w1[previous_k])))`` (sts temperature 1), its product along the block.
   Without a confidence head the emulator reports the probability SGLang's distribution gives each drafted
   token (what its sampler draws from), so that the test compares distributions, not only their argmax.

Not emulated: the tokenizer's ``<|MASK|>`` fallback for a DFlash folder without ``mask_token_id`` (our
exports always carry one), gated and RNN Markov heads, sampling.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # the emulators' shared pieces, beside this file
import engine_common as C  # noqa: E402

EngineLoadError, EngineUnsupported = C.EngineLoadError, C.EngineUnsupported
ARCHITECTURES = {"DFlashDraftModel": "dflash", "Qwen3DSparkModel": "dspark"}


def _field(config: dict, key: str, default=None):
    """``dflash_config[key]`` first, then the top level (``parse_dflash_draft_config``)."""
    nested = config.get("dflash_config") or {}
    return nested[key] if key in nested else config.get(key, default)


class Emulator:
    """A folder as SGLang's DFlash / DSpark draft model holds it, beside the target it borrows from."""

    def __init__(self, folder, target, reduced_vocab: bool = True, ragged_verify: str = "confidence"):
        config = C.read_config(folder)
        arch = (config.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise EngineLoadError(f"no DFlash/DSpark model class for architectures {config.get('architectures')}")
        self.kind = ARCHITECTURES[arch]
        if config.get("hidden_act", "silu") != "silu":
            raise EngineLoadError(f"Unsupported DFlash activation: {config.get('hidden_act')}")
        layer_types = config.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise EngineUnsupported(f"sliding (causal) draft layers are not emulated: {layer_types}")
        rope = config.get("rope_parameters")
        if rope and rope.get("rope_type", "default") != "default":
            raise EngineUnsupported(f"rope {rope} is not emulated")
        text = C.text_config(target)
        self.target, self.L = target, text.num_hidden_layers
        H = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        self.dims = C.Dims(hidden=H, heads=heads, kv_heads=int(config.get("num_key_value_heads", heads)),
                           head_dim=int(config.get("head_dim") or H // heads), rms_eps=float(config.get("rms_norm_eps", 1e-6)),
                           rope_base=float(rope["rope_theta"] if rope else config.get("rope_theta", 10000)))
        self.block_size = int(_field(config, "block_size", 16 if self.kind == "dflash" else 7))
        mask = _field(config, "mask_token_id")
        if mask is None:
            raise EngineUnsupported("no mask_token_id: SGLang would take the tokenizer's <|MASK|> (not emulated)")
        if not 0 <= int(mask) < text.vocab_size:
            raise EngineLoadError(f"mask_token_id {mask} is outside the target vocab size {text.vocab_size}")
        self.mask = int(mask)
        ids = _field(config, "target_layer_ids")
        if ids is None:
            raise EngineUnsupported("no target_layer_ids: SGLang would choose its own layers")
        for i in ids:
            if not 0 <= int(i) < self.L:
                raise EngineLoadError(f"DFLASH target_layer_ids contains an out-of-range layer id {i}")
        # captured before layer i + 1, in the target's layer order, once each; i + 1 == L is never reached
        self.capture = sorted({int(i) + 1 for i in ids})
        if self.capture[-1] >= self.L or len(self.capture) != len(ids):
            raise EngineLoadError(f"DFLASH target_hidden feature dim mismatch: ids {ids} capture {self.capture} "
                                  f"of a {self.L}-layer target")
        self.sample_from_anchor = bool(_field(config, "sample_from_anchor", True))
        self.num_layers = int(config["num_hidden_layers"])
        V = int(config.get("vocab_size", text.vocab_size))
        self.draft_vocab = V
        if self.kind == "dspark":
            self.rank = int(config.get("markov_rank", 0))
            if self.rank <= 0:
                raise EngineLoadError(f"DSpark requires markov_rank > 0, got {self.rank}")
            if str(config.get("markov_head_type", "vanilla")).lower() != "vanilla":
                raise EngineUnsupported(f"markov_head_type {config.get('markov_head_type')} is not emulated")
            if reduced_vocab and int(config.get("draft_vocab_size") or V) < V:
                self.draft_vocab = int(config["draft_vocab_size"])
        self.confidence = (self.kind == "dspark" and ragged_verify != "static"
                           and bool(config.get("enable_confidence_head", True)))
        if self.confidence and not config.get("confidence_head_with_markov", True):
            raise EngineUnsupported("a confidence head without the Markov embedding is not emulated")
        self.state, self.ignored = self._load(Path(folder), V, int(config["intermediate_size"]), reduced_vocab)
        self.d2t = None
        if "d2t" in self.state:
            d2t = self.state["d2t"].long()
            self.d2t = torch.arange(self.draft_vocab) + d2t
            if int(self.d2t.min()) < 0 or int(self.d2t.max()) >= V or self.d2t.unique().numel() != self.draft_vocab:
                raise EngineLoadError("d2t maps draft ids outside the target vocabulary or two to one target id")

    def _load(self, folder: Path, V: int, intermediate: int, reduced_vocab: bool):
        d, K = self.dims, len(self.capture)
        spec = {"fc.weight": (d.hidden, K * d.hidden), "hidden_norm.weight": (d.hidden,), "norm.weight": (d.hidden,)}
        for i in range(self.num_layers):
            p = f"layers.{i}"
            spec.update(C.llama_layer_spec(d, intermediate, p, d.hidden, input_norm=True))
            spec[f"{p}.self_attn.q_norm.weight"] = (d.head_dim,)
            spec[f"{p}.self_attn.k_norm.weight"] = (d.head_dim,)
        if self.kind == "dspark":
            spec["markov_head.markov_w1.weight"] = (V, self.rank)
            spec["markov_head.markov_w2.weight"] = (self.draft_vocab, self.rank)
            if self.confidence:
                spec["confidence_head.proj.weight"] = (1, d.hidden + self.rank)
                spec["confidence_head.proj.bias"] = (1,)
            if self.draft_vocab < V:
                spec["lm_head.weight"] = (self.draft_vocab, d.hidden)
                spec["d2t"] = (self.draft_vocab,)
        skipped = ("embed_tokens.", "rotary_emb.") + (("lm_head.",) if self.kind == "dspark" and self.draft_vocab == V else ())
        state, ignored = {}, []
        for name, tensor in C.read_safetensors(folder).items():
            if self.kind == "dspark" and name.startswith(skipped):
                ignored.append(name)
                continue
            key = name if name in spec or name.startswith(("markov_head.", "confidence_head.")) else name.removeprefix("model.")
            if key.startswith("confidence_head.") and not self.confidence:
                continue  # SGLang's static verify mode builds no confidence head and skips its tensors
            if key not in spec:
                ignored.append(name)  # SGLang: "Ignore unexpected weights"
                continue
            if tuple(tensor.shape) != spec[key]:
                what = "DFLASH fc.weight shape mismatch" if key == "fc.weight" else "weight shape mismatch"
                raise EngineLoadError(f"{what}: {name} is {tuple(tensor.shape)}, the model's is {spec[key]}")
            state[key] = tensor.float()
        missing = sorted(set(spec) - set(state))
        if missing:
            raise EngineLoadError(f"parameters no checkpoint tensor fills (left uninitialised): {missing[:5]}")
        return state, tuple(sorted(ignored))

    # --- drafting -------------------------------------------------------------------------------------

    def _attend(self, x, positions, prefix, ctx_k, ctx_v):
        """The block's attention in one layer: queries and keys of the block rows x (n, H) at ``positions``,
        over the context's cached keys/values (S, kvh, hd) and the block's own, with no mask."""
        d, s, n = self.dims, self.state, x.shape[0]
        q = C.linear(x, s, prefix + ".q_proj").view(n, d.heads, d.head_dim)
        k = C.linear(x, s, prefix + ".k_proj").view(n, d.kv_heads, d.head_dim)
        v = C.linear(x, s, prefix + ".v_proj").view(n, d.kv_heads, d.head_dim)
        q = C.rms_norm(q, s[prefix + ".q_norm.weight"], d.rms_eps)
        k = C.rms_norm(k, s[prefix + ".k_norm.weight"], d.rms_eps)
        cos, sin = C.rope_cos_sin(positions, d.head_dim, d.rope_base)
        q, k = C.apply_rope(q, cos, sin), C.apply_rope(k, cos, sin)
        keys, values = torch.cat([ctx_k, k]), torch.cat([ctx_v, v])  # (S + n, kvh, hd)
        rep = d.heads // d.kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,shd->hns", q, keys) / math.sqrt(d.head_dim)
        out = torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), values).reshape(n, d.heads * d.head_dim)
        return C.linear(out, s, prefix + ".o_proj")

    @torch.inference_mode()
    def draft(self, sequence: list[int]) -> tuple[list[int], list[float]]:
        """The block SGLang drafts after ``sequence`` (committed tokens; the last is the anchor): target ids,
        and each one's chance of acceptance given the ones before it (behaviour 9)."""
        d, s = self.dims, self.state
        p = len(sequence) - 1
        hidden, _ = C.target_prefill(self.target, list(sequence[:-1]))
        features = torch.cat([hidden[i] for i in self.capture], dim=-1).float()  # (p, K H)
        ctx = C.rms_norm(F.linear(features, s["fc.weight"]), s["hidden_norm.weight"], d.rms_eps)
        cos, sin = C.rope_cos_sin(torch.arange(p), d.head_dim, d.rope_base)
        n = self.block_size + (0 if self.kind == "dflash" or self.sample_from_anchor else 1)
        embed = self.target.get_input_embeddings().weight.float()
        x = embed[torch.tensor([sequence[-1]] + [self.mask] * (n - 1))]
        positions = torch.arange(p, p + n)
        for i in range(self.num_layers):
            prefix = f"layers.{i}"
            ctx_k = C.linear(ctx, s, prefix + ".self_attn.k_proj").view(p, d.kv_heads, d.head_dim)
            ctx_k = C.apply_rope(C.rms_norm(ctx_k, s[prefix + ".self_attn.k_norm.weight"], d.rms_eps), cos, sin)
            ctx_v = C.linear(ctx, s, prefix + ".self_attn.v_proj").view(p, d.kv_heads, d.head_dim)
            h = C.rms_norm(x, s[prefix + ".input_layernorm.weight"], d.rms_eps)
            x = x + self._attend(h, positions, prefix + ".self_attn", ctx_k, ctx_v)
            x = x + C.swiglu(C.rms_norm(x, s[prefix + ".post_attention_layernorm.weight"], d.rms_eps), s, prefix + ".mlp")
        out = C.rms_norm(x, s["norm.weight"], d.rms_eps)
        head = s.get("lm_head.weight", self.target.get_output_embeddings().weight.float())
        if self.kind == "dflash":
            probs, tokens = (out[1:] @ head.T).softmax(-1).max(-1)
            return tokens.tolist(), probs.tolist()
        slots = out[n - self.block_size:]
        base = slots @ head.T  # (gamma, V or V')
        drafts, chances, previous = [], [], sequence[-1]
        for k in range(self.block_size):
            markov = s["markov_head.markov_w1.weight"][previous]  # (r,)
            prob, token = (base[k] + F.linear(markov, s["markov_head.markov_w2.weight"])).softmax(-1).max(-1)
            if self.confidence:
                prob = torch.sigmoid(F.linear(torch.cat([slots[k], markov]), s["confidence_head.proj.weight"],
                                              s["confidence_head.proj.bias"]))[0]
            previous = int(token) if self.d2t is None else int(self.d2t[token])
            drafts.append(previous)
            chances.append(float(prob))
        return drafts, chances


def load(folder, target, **options) -> Emulator:
    return Emulator(folder, target, **options)
