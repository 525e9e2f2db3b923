"""An emulator of how the reference EAGLE code (SafeAILab/EAGLE) loads an exported drafter and drafts.

Written from SafeAILab/EAGLE at cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b (2026-02-19):
eagle/model/ea_model.py (EaModel.__init__ / from_pretrained), eagle/model/cnets.py (EAGLE-3 ``Model``,
``LlamaDecoderLayeremb``, ``topK_genrate``), eagle/model/cnets1.py (EAGLE-1), eagle/model/configs.py
(``EConfig``), eagle/model/utils.py (``initialize_tree``), eagle/model/modeling_llama_kv.py,
modeling_qwen2_kv.py, modeling_qwen3_kv.py (which target hidden states are collected).

Behaviours encoded (each read in the files above):

1. EAGLE-1 vs EAGLE-3 is the caller's ``use_eagle3`` flag (here ``kind``, by default taken from
   ``architectures``). Config through ``EConfig`` (LlamaConfig-like, extra JSON keys become attributes):
   ``rope_scaling`` must be null or a 2-key {"type", "factor"} dict (validation error otherwise; scaled
   rope is not emulated); base = ``rope_theta`` if the key exists else 10000 (``rope_parameters`` is not
   read); ``rms_norm_eps`` default 1e-6; ``num_key_value_heads`` default heads.
2. head_dim = hidden_size // num_attention_heads, which must divide (ValueError); ``head_dim`` in the
   config is ignored, so a file whose q/k/v shapes assume another head_dim fails to load.
3. Weights: ``pytorch_model.bin`` first, else ``model.safetensors``; ``load_state_dict(strict=False)``:
   unexpected names are ignored (``Emulator.ignored``), shape mismatches raise, and a parameter the file
   does not fill would keep its random init (the emulator raises).
4. EAGLE-3 draft: q/k/v [., 2H], o_proj, MLP and ``fc`` [H, 3 H_t] all without bias (the ``bias`` key is
   unused); ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}``, ``norm``,
   ``lm_head`` [draft_vocab_size, H] from the file (no tie handling; ``draft_vocab_size`` required);
   ``d2t``/``t2d`` buffers, deleted when vocab_size == draft_vocab_size (then ids are used as they are);
   target id = draft id + d2t[draft id].
5. Embedding: read from the BASE model's files (``load_emb``) unless the config has
   ``target_hidden_size``; a file ``embed_tokens.weight`` then overrides it. (The base model must have a
   ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``; the emulator assumes it has.)
6. EAGLE-3 target features: hard-coded inputs of decoder layers {2, L // 2, L - 3}
   (transformers ``hidden_states`` indices), ascending, once each; the config's aux ids are never read;
   Qwen2 targets collect none (modeling_qwen2_kv.py): unsupported. Base class by the target's
   ``architectures[0]``: Llama, Qwen2, Qwen3 (else Mixtral, not emulated).
7. EAGLE-1 draft: ``fc`` = Linear(2H, H, bias=config.get("bias", True)) over cat(embed, feature);
   ``num_hidden_layers`` Llama layers, layer 0 without input_layernorm, q/k/v bias iff ``qkv_bias`` in
   the config (value), o_proj unbiased; no final norm; logits by the base model's ``lm_head``;
   feature = the base model's final normed hidden state.
8. Tree (``topK_genrate``): prefill input ids prompt[1:] + [sampled token] at positions 0..T-1; log-softmax
   scores summed along the path; ``depth`` forwards after the prefill (so tree depth = depth + 1); the
   top_k best of top_k*top_k children per step; true-ancestor tree mask; finally the
   ``total_token - 1`` best candidates. ``propose(depth=D, topk, num_draft_tokens=N)`` runs
   ``EaModel.from_pretrained(depth=D - 1, top_k=topk, total_token=N)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the emulators' shared pieces, beside this file
import engine_common as C  # noqa: E402
EngineLoadError, EngineUnsupported = C.EngineLoadError, C.EngineUnsupported

ENGINE = "reference EAGLE"
ECONFIG_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6}
BASE_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _get(raw: dict, key: str):
    return raw.get(key, ECONFIG_DEFAULTS.get(key))


class Emulator:
    def __init__(self, folder: Path, target, kind: str | None = None):
        self.folder, self.target = Path(folder), target
        raw = self.raw = C.read_config(self.folder)
        if kind is None:
            arch = (raw.get("architectures") or [None])[0]
            kind = {"LlamaForCausalLMEagle3": "eagle3", "LlamaForCausalLMEagle": "eagle"}.get(arch)
            if kind is None:
                raise EngineLoadError(f"{ENGINE}: pass kind: architectures {raw.get('architectures')} say neither")
        self.kind = kind
        scaling = raw.get("rope_scaling")
        if scaling is not None:
            if not isinstance(scaling, dict) or len(scaling) != 2:
                raise EngineLoadError(f"{ENGINE}: EConfig._rope_scaling_validation: rope_scaling {scaling} must be a "
                                      "dictionary with two fields, type and factor")
            raise EngineUnsupported(f"{ENGINE} emulator: scaled rope {scaling} is not emulated")
        if _get(raw, "hidden_act") != "silu":
            raise EngineUnsupported(f"{ENGINE} emulator: activation {_get(raw, 'hidden_act')}")
        H, heads = int(_get(raw, "hidden_size")), int(_get(raw, "num_attention_heads"))
        if (H // heads) * heads != H:
            raise EngineLoadError(f"{ENGINE}: hidden_size must be divisible by num_heads (got {H} and {heads})")
        self.dims = C.Dims(hidden=H, heads=heads, kv_heads=int(raw.get("num_key_value_heads") or heads),
                           head_dim=H // heads, rms_eps=float(_get(raw, "rms_norm_eps")),
                           rope_base=float(raw["rope_theta"]) if "rope_theta" in raw else 10000.0)
        self.vocab, self.intermediate = int(_get(raw, "vocab_size")), int(_get(raw, "intermediate_size"))
        text = C.text_config(target)
        model_type = getattr(text, "model_type", None)
        archs = getattr(target.config, "architectures", None) or [BASE_CLASSES.get(model_type, "MixtralForCausalLM")]
        self.base_class = archs[0]
        if self.base_class not in BASE_CLASSES.values():
            raise EngineUnsupported(f"{ENGINE} emulator: base model class {self.base_class} (the code would load it as "
                                    "Mixtral) is not emulated")
        files = self._read_weights()
        self.ignored: list[str] = []
        if kind == "eagle3":
            self._load_eagle3(raw, files, text)
        else:
            self._load_eagle1(raw, files)
        self.ignored = tuple(self.ignored)

    def _read_weights(self) -> dict[str, torch.Tensor]:
        bin_path = self.folder / "pytorch_model.bin"
        if bin_path.is_file():
            # The engine would unpickle it first; selfdraft never writes one and this emulator never unpickles.
            raise EngineLoadError(f"{ENGINE}: {self.folder} has pytorch_model.bin, which the engine would read first "
                                  "(a pickle: not emulated)")
        st = self.folder / "model.safetensors"
        if not st.is_file():  # the next try is hf_hub_download(ea_model_path, "model.safetensors")
            raise EngineLoadError(f"{ENGINE}: {self.folder} has neither pytorch_model.bin nor model.safetensors "
                                  "(sharded or renamed weight files are not read)")
        return C.read_safetensors(self.folder, ("model.safetensors",))

    def _load_state_dict(self, files: dict, spec: dict, from_base: dict) -> dict[str, torch.Tensor]:
        """load_state_dict(strict=False) into modules whose parameters ``spec`` lists; ``from_base``: tensors
        already set before it (the base model's embedding)."""
        state = dict(from_base)
        for name, tensor in files.items():
            if name not in spec:
                self.ignored.append(name)
                continue
            if tuple(tensor.shape) != spec[name]:
                raise EngineLoadError(f"{ENGINE}: size mismatch for {name}: copying a param with shape "
                                      f"{tuple(tensor.shape)}, the model has {spec[name]}")
            state[name] = tensor.float() if tensor.is_floating_point() else tensor
        missing = sorted(set(spec) - set(state))
        if missing:
            raise EngineLoadError(f"{ENGINE}: {missing} missing from the file: load_state_dict(strict=False) keeps "
                                  "their random initialisation")
        return state

    def _load_eagle3(self, raw, files, text) -> None:
        d, H = self.dims, self.dims.hidden
        if "draft_vocab_size" not in raw:
            raise EngineLoadError(f"{ENGINE}: the EAGLE-3 Model reads config.draft_vocab_size (AttributeError)")
        self.draft_vocab = int(raw["draft_vocab_size"])
        if self.base_class == "Qwen2ForCausalLM":
            raise EngineUnsupported(f"{ENGINE}: modeling_qwen2_kv.py collects no EAGLE-3 hidden states "
                                    "(outputs['hidden_states'] is None in initialize_tree)")
        target_hidden = int(raw.get("target_hidden_size", H))
        if target_hidden != text.hidden_size:
            raise EngineLoadError(f"{ENGINE}: fc takes 3 x {target_hidden}, the target's hidden size is {text.hidden_size}")
        spec = C.llama_layer_spec(self.dims, self.intermediate, "midlayer", 2 * H, input_norm=True, qkv_bias=False)
        spec.update({"midlayer.hidden_norm.weight": (H,), "fc.weight": (H, 3 * target_hidden), "norm.weight": (H,),
                     "lm_head.weight": (self.draft_vocab, H), "embed_tokens.weight": (self.vocab, H)})
        self.mapped = self.vocab != self.draft_vocab
        if self.mapped:  # else `del self.ea_layer.d2t, self.ea_layer.t2d`
            spec.update({"d2t": (self.draft_vocab,), "t2d": (self.vocab,)})
        base = {}
        if "target_hidden_size" not in raw:  # load_emb: the base model's model.embed_tokens.weight
            emb = self.target.get_input_embeddings().weight.detach().float()
            if tuple(emb.shape) != (self.vocab, H):  # `self.embed_tokens.weight.data = tensor` then load_state_dict
                raise EngineLoadError(f"{ENGINE}: the base embedding is {tuple(emb.shape)}, the draft config says "
                                      f"vocab_size {self.vocab} x hidden {H}")
            base["embed_tokens.weight"] = emb
        if self.mapped and "t2d" not in files:  # an unused buffer (zeros) at inference: tolerated
            base["t2d"] = torch.zeros(self.vocab, dtype=torch.bool)
        self.state = self._load_state_dict(files, spec, base)
        L = text.num_hidden_layers
        self.capture = sorted({2, L // 2, L - 3})  # modeling_*_kv.py: idx==len-3 or idx==len//2 or idx==2
        if len(self.capture) != 3:
            raise EngineLoadError(f"{ENGINE}: a {L}-layer target gives hidden states {self.capture}; fc takes 3")

    def _load_eagle1(self, raw, files) -> None:
        d, H = self.dims, self.dims.hidden
        self.layers = int(_get(raw, "num_hidden_layers"))
        qkv_bias = bool(raw.get("qkv_bias", False))
        spec = {"fc.weight": (H, 2 * H), "embed_tokens.weight": (self.vocab, H)}
        if raw.get("bias", True):  # ea_model.py: try: bias = con["bias"] except: bias = True
            spec["fc.bias"] = (H,)
        for i in range(self.layers):
            spec.update(C.llama_layer_spec(self.dims, self.intermediate, f"layers.{i}", H, input_norm=i > 0, qkv_bias=qkv_bias))
        emb = self.target.get_input_embeddings().weight.detach().float()  # load_emb=True always in cnets1
        if tuple(emb.shape) != (self.vocab, H):
            raise EngineLoadError(f"{ENGINE}: the base embedding is {tuple(emb.shape)}, the draft config says "
                                  f"vocab_size {self.vocab} x hidden {H}")
        self.state = self._load_state_dict(files, spec, {"embed_tokens.weight": emb})

    # --- forward -----------------------------------------------------------------------------------------

    def _step(self, feature, ids, positions, stores, visible_old, causal_new) -> torch.Tensor:
        """Rows (feature, token) -> the draft's output hidden (m, H) (pre-norm for EAGLE-3)."""
        s, d = self.state, self.dims
        embeds = s["embed_tokens.weight"][torch.as_tensor(ids)]
        if self.kind == "eagle3":
            if feature.shape[-1] != embeds.shape[-1]:
                feature = C.linear(feature, s, "fc")
            residual = feature
            x = torch.cat([C.rms_norm(embeds, s["midlayer.input_layernorm.weight"], d.rms_eps),
                           C.rms_norm(feature, s["midlayer.hidden_norm.weight"], d.rms_eps)], dim=-1)
            h = residual + C.attention(x, positions, s, "midlayer.self_attn", d, stores[0], visible_old, causal_new)
            return h + C.swiglu(C.rms_norm(h, s["midlayer.post_attention_layernorm.weight"], d.rms_eps), s, "midlayer.mlp")
        h = C.linear(torch.cat([embeds, feature], dim=-1), s, "fc")
        for i in range(self.layers):
            x = h if i == 0 else C.rms_norm(h, s[f"layers.{i}.input_layernorm.weight"], d.rms_eps)
            h = h + C.attention(x, positions, s, f"layers.{i}.self_attn", d, stores[i], visible_old, causal_new)
            h = h + C.swiglu(C.rms_norm(h, s[f"layers.{i}.post_attention_layernorm.weight"], d.rms_eps), s, f"layers.{i}.mlp")
        return h

    def _log_probs(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "eagle3":
            logits = C.rms_norm(h, self.state["norm.weight"], self.dims.rms_eps) @ self.state["lm_head.weight"].T
        else:
            logits = h @ self.target.get_output_embeddings().weight.detach().float().T
        return torch.log_softmax(logits.float(), dim=-1)

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx + self.state["d2t"][idx] if self.kind == "eagle3" and self.mapped else idx

    def _features(self, hidden):
        if self.kind == "eagle3":
            return torch.cat([hidden[j] for j in self.capture], dim=-1)
        return hidden[-1]

    @torch.inference_mode()
    def propose(self, prompt_ids: list[int], depth: int, topk: int, num_draft_tokens: int) -> list[tuple[int, ...]]:
        """topK_genrate with EaModel(depth=depth - 1, top_k=topk, total_token=num_draft_tokens): the
        num_draft_tokens - 1 draft nodes as root-to-node paths of target ids."""
        k, T, ref_depth, total = topk, len(prompt_ids), depth - 1, num_draft_tokens - 1
        hidden, bonus = C.target_prefill(self.target, list(prompt_ids))
        stores = [C.KVStore() for _ in range(1 if self.kind == "eagle3" else self.layers)]
        ids = list(prompt_ids[1:]) + [bonus]  # input_ids = input_ids[:, 1:] of prompt + sample_token
        out = self._step(self._features(hidden), ids, torch.arange(T), stores, torch.zeros(T, 0, dtype=torch.bool), True)
        last = out[-1:]
        top = torch.topk(self._log_probs(last)[0], k)
        scores = top.values  # (k,)
        scores_list, parents_list, ss_token = [scores], [torch.zeros(1, dtype=torch.long)], [self._to_target(top.indices)]
        input_ids, input_hidden = self._to_target(top.indices), last.repeat(k, 1)
        tree_entries: list[int] = []  # store index of every tree node fed so far
        tree_mask = torch.eye(k, dtype=torch.bool)  # (k, fed tree nodes incl. the current k)
        topk_cs_index = torch.arange(k)
        for i in range(ref_depth):
            before = len(stores[0])
            visible = torch.zeros(k, before, dtype=torch.bool)
            visible[:, :T] = True
            visible[:, tree_entries] = tree_mask[:, : len(tree_entries)]
            out = self._step(input_hidden, input_ids.tolist(), torch.full((k,), T + i), stores, visible, False)
            tree_entries += list(range(before, before + k))
            bias = 1 + k * k * max(0, i - 1) + (k if i > 0 else 0)
            parents_list.append(topk_cs_index + bias)
            top = torch.topk(self._log_probs(out), k, dim=-1)  # (k, k)
            cu_scores = top.values + scores[:, None]
            cs = torch.topk(cu_scores.flatten(), k)
            topk_cs_index, scores = cs.indices, cs.values
            out_ids = topk_cs_index // k
            input_hidden = out[out_ids]
            input_ids = self._to_target(top.indices.flatten()[topk_cs_index])
            ss_token.append(self._to_target(top.indices).flatten())
            scores_list.append(cu_scores.flatten())
            tree_mask = torch.cat([tree_mask[out_ids], torch.eye(k, dtype=torch.bool)], dim=1)
        flat_scores, flat_tokens = torch.cat(scores_list), torch.cat(ss_token)
        chosen = torch.sort(torch.topk(flat_scores, total).indices).values.tolist()
        group_parent = torch.cat(parents_list).tolist()  # value p: parent candidate p - 1, 0 = root
        parent_of = [group_parent[c // k] - 1 for c in range(len(flat_tokens))]
        paths = C.paths_from_parents(flat_tokens.tolist(), parent_of)
        return [paths[c] for c in chosen]


def load(folder, target, kind: str | None = None) -> Emulator:
    """``target``: the transformers target model (fp32, eval); ``kind``: "eagle3" or "eagle" (the
    ``use_eagle3`` flag of EaModel.from_pretrained), by default from ``architectures``."""
    return Emulator(Path(folder), target, kind)
