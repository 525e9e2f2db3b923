"""An emulator of how SGLang loads an exported EAGLE drafter folder and drafts with it.

Written from SGLang's own code (sgl-project/sglang; the commit of each stored file version read):

* python/sglang/srt/models/llama_eagle3.py  (03d5a7771f6082e7737a5f19cae7d1e863087013, d737979cbd17c6162f39c1953cfa72d3d23cc0d0)
* python/sglang/srt/models/llama_eagle.py   (034b3be819faf3f84c5aae5a4cda27bdf2e12de0)
* python/sglang/srt/models/llama.py         (00239548f1cd1a06ca145a5447a86738090a48f1)
* python/sglang/srt/models/qwen3.py         (01b5f572b7b678e2fa5a727881f1ff3ab4dd3c6d; Qwen2 captures the same way)
* python/sglang/srt/speculative/eagle_worker.py (00559eacbf0841146db7e27e445d1971e35e6294)
* python/sglang/srt/speculative/eagle_info.py   (0007d13b0099d8b0b42b74b19fc4b16b8ce1dd3a)
* python/sglang/srt/model_executor/model_runner.py (0005834cdb2a5b7472789ccbf0d3361b5cf853b8)
* spec_utils.py / eagle_utils.py: ``select_top_k_tokens``, ``organize_draft_results``,
  ``generate_draft_decode_kv_indices`` (same text in every stored version)
* sglang PR #25015 (merged 2026-05): draft decode positions are seq_len + step (before it, one more).

Behaviours encoded (each read in the files above):

1. The model class comes from ``architectures[0]``: LlamaForCausalLMEagle3 (EAGLE-3) or
   LlamaForCausalLMEagle (EAGLE-1); anything else is refused. The config is read like transformers 4's
   LlamaConfig (defaults for absent keys); ``model_type`` must be ``llama``.
2. RoPE: older SGLang reads ``getattr(config, "rope_theta", 10000)`` and ``rope_scaling``; newer reads
   ``rope_parameters["rope_theta"]`` first. The emulator computes both and refuses a folder on which they
   disagree (a folder with only ``rope_parameters`` runs at base 10000 on the older one). Only default
   (unscaled, full-dimension) rope is emulated. ``head_dim`` is ``config.head_dim`` or hidden // heads.
3. EAGLE-3 modules: ``fc`` [H, 3 H_t] with a bias iff ``config.bias``; q/k/v [., 2H] never biased; o_proj
   biased iff ``attention_bias or bias``; SwiGLU MLP unbiased; ``input_layernorm`` (on the embedding),
   ``hidden_norm``, ``post_attention_layernorm``, ``norm``; ``lm_head`` [draft_vocab_size, H]. One layer
   (the older loader raises for more).
4. EAGLE-3 forward: fc only when the fed hidden width differs from the embedding width;
   attention input cat(input_layernorm(embed), hidden_norm(feature)); residual = feature;
   logits = lm_head(norm(out))[:, :draft_vocab_size]; the next step is fed the pre-norm out.
5. Loading (EAGLE-3): ``d2t`` -> hot_token_id = d2t + arange (draft id i -> target id i + d2t[i]);
   ``t2d`` skipped; q/k/v and gate/up stacked; a ``model.`` prefix accepted; any other unknown name is
   DROPPED SILENTLY (listed in ``Emulator.ignored``); a parameter no tensor fills would stay uninitialised:
   the emulator raises. Shape mismatches raise (weight_loader asserts).
6. ``tie_word_embeddings: true``: lm_head IS the embedding, which the worker replaces by the TARGET's
   embedding (``set_embed``); the trained ``lm_head.weight`` is dropped. ``draft_vocab_size`` absent:
   lm_head is the target's head (``load_lm_head_from_target``).
7. Embedding: always the target's (``set_embed``) unless ``target_hidden_size`` != ``hidden_size``, then
   the file's ``embed_tokens.weight`` (required).
8. Target features (EAGLE-3): ``eagle_config.eagle_aux_hidden_state_layer_ids`` ids are "output of layer
   i": SGLang captures the residual stream entering layers [i + 1 for i in ids] = transformers
   ``hidden_states[i + 1]``; no ids -> layers [2, L // 2, L - 3]; captured once each, concatenated in
   ascending layer order; ``use_aux_hidden_state: false`` -> the final normed state. EAGLE-1: the final
   normed state.
9. EAGLE-1 (``LlamaForCausalLMEagle``): ``fc = nn.Linear(2H, H)`` (always a bias) over
   cat(embed, feature); ``num_hidden_layers`` Llama layers, layer 0 without input_layernorm, no final
   norm; embedding AND lm_head are the target's (``set_embed_and_head``; with a tied draft config the
   embedding becomes the target's lm_head matrix); ``lm_head.*`` in the file is never read; attention
   biases iff ``attention_bias or bias``. Unknown ``.bias`` names are skipped, other unknown names only
   warn (both listed in ``ignored``); an unknown q/k/v/gate/up name raises KeyError in SGLang.
10. Draft extend: input ids prompt[1:] + [bonus] at positions 0..T-1 with the target features of the
    T prompt positions; topk of softmax at the last position.
11. Tree: ``speculative_num_steps`` = depth, ``speculative_eagle_topk`` = topk,
    ``speculative_num_draft_tokens`` = num_draft_tokens (num_draft_tokens - 1 draft nodes);
    scores are products of probabilities; each step keeps the topk best of topk*topk children;
    the final nodes are the num_draft_tokens - 1 best of all candidates. Step i is fed at position
    T + i (PR #25015; ``legacy_positions=True`` for T + i + 1).
12. Draft attention of the topk slots (``draft_attention="sglang"``, the default): slot j at a step
    sees the prefix plus the entries slot j itself wrote at earlier steps (generate_draft_decode_kv_indices),
    NOT the ancestors of the node now in slot j (sglang issue #7523; fix PR #8409 closed unmerged).
    Exact for chains and depth <= 2; ``draft_attention="ancestors"`` gives the EAGLE-2 tree attention.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the emulators' shared pieces, beside this file
import engine_common as C  # noqa: E402
EngineLoadError, EngineUnsupported = C.EngineLoadError, C.EngineUnsupported

ENGINE = "SGLang"
ARCHITECTURES = {"LlamaForCausalLMEagle3": "eagle3", "LlamaForCausalLMEagle": "eagle"}
# transformers 4 LlamaConfig defaults (what AutoConfig gives SGLang for absent keys)
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "attention_bias": False}
STACKED = (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj")


def _get(raw: dict, key: str):
    return raw.get(key, LLAMA_DEFAULTS.get(key))


def rope_base(raw: dict, reader: str = "both") -> float:
    """The rope base SGLang uses: ``reader`` "legacy" (getattr(config, "rope_theta", 10000)), "current"
    (rope_parameters first) or "both" (the base they agree on, else an error naming the disagreement)."""
    legacy = float(raw.get("rope_theta", 10000.0))  # llama.py: getattr(config, "rope_theta", 10000)
    params = raw.get("rope_parameters")
    current = float(params["rope_theta"]) if isinstance(params, dict) and "rope_theta" in params else legacy
    if reader != "both":
        return legacy if reader == "legacy" else current
    if legacy != current:
        raise EngineLoadError(
            f"{ENGINE}: config.json gives rope_parameters.rope_theta={current} but "
            + (f"rope_theta={legacy}" if "rope_theta" in raw else "no top-level rope_theta")
            + ": SGLang before get_rope_config (llama.py 00239548: getattr(config, 'rope_theta', 10000)) "
              f"would use {legacy}")
    for what in (raw.get("rope_scaling"), params):
        kind = (what or {}).get("rope_type", (what or {}).get("type", "default")) if isinstance(what, dict) else "default"
        if kind != "default":
            raise EngineUnsupported(f"{ENGINE} emulator: rope type {kind!r} is not emulated")
    if float(raw.get("partial_rotary_factor", 1)) != 1:
        raise EngineUnsupported(f"{ENGINE} emulator: partial_rotary_factor is not emulated")
    return legacy


class Emulator:
    """One loaded drafter folder plus the target, drafting the way SGLang does (batch 1)."""

    def __init__(self, folder: Path, target, draft_attention: str = "sglang", legacy_positions: bool = False,
                 rope_reader: str = "both"):
        if draft_attention not in ("sglang", "ancestors"):
            raise ValueError(f"draft_attention must be 'sglang' or 'ancestors', got {draft_attention!r}")
        self.folder, self.target = Path(folder), target
        self.draft_attention, self.legacy_positions = draft_attention, legacy_positions
        raw = self.raw = C.read_config(self.folder)
        arch = (raw.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise EngineLoadError(f"{ENGINE}: architectures {raw.get('architectures')} name no EAGLE draft model "
                                  f"({', '.join(ARCHITECTURES)})")
        if raw.get("model_type", "llama") != "llama":
            raise EngineUnsupported(f"{ENGINE} emulator: model_type {raw.get('model_type')!r}; SGLang would read the "
                                    "draft config as that family's config class (SpecForge and SGLang use 'llama')")
        self.kind = ARCHITECTURES[arch]
        if _get(raw, "hidden_act") != "silu":
            raise EngineLoadError(f"{ENGINE}: Unsupported activation: {_get(raw, 'hidden_act')}. Only silu is supported")
        text = C.text_config(target)
        H, heads = int(_get(raw, "hidden_size")), int(_get(raw, "num_attention_heads"))
        kvh = int(raw.get("num_key_value_heads") or heads)
        self.dims = C.Dims(hidden=H, heads=heads, kv_heads=kvh, head_dim=int(raw.get("head_dim") or H // heads),
                           rms_eps=float(_get(raw, "rms_norm_eps")), rope_base=rope_base(raw, rope_reader))
        self.vocab = int(_get(raw, "vocab_size"))
        self.intermediate = int(_get(raw, "intermediate_size"))
        self.tied = bool(_get(raw, "tie_word_embeddings"))
        bias = bool(raw.get("bias", False))
        self.attn_bias = bool(_get(raw, "attention_bias")) or bias
        self.target_hidden = int(raw.get("target_hidden_size", H))
        if self.vocab != text.vocab_size:
            raise EngineLoadError(f"{ENGINE}: draft vocab_size {self.vocab}, the target's embedding has {text.vocab_size} rows "
                                  "(set_embed would swap in a table of another shape)")
        embed_t = target.get_input_embeddings().weight.detach().float()
        head_t = target.get_output_embeddings().weight.detach().float()
        self.ignored: list[str] = []
        self.hot_token_id = None
        files = C.read_safetensors(self.folder)
        if not files:
            bin_path = self.folder / "pytorch_model.bin"
            if not bin_path.is_file():
                raise EngineLoadError(f"{ENGINE}: no *.safetensors or pytorch_model.bin in {self.folder}")
            raise EngineLoadError(f"{ENGINE}: {self.folder} has only pytorch_model.bin (a pickle: not emulated)")
        if self.kind == "eagle3":
            self._load_eagle3(raw, files, bias, embed_t, head_t, text)
        else:
            self._load_eagle1(raw, files, embed_t, head_t)
        self.ignored = tuple(self.ignored)

    # --- loading ---------------------------------------------------------------------------------------

    def _fill(self, files: dict, spec: dict, lenient_unknown) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for name, tensor in files.items():
            n = name[len("model."):] if name.startswith("model.") else name
            if n in spec:
                if tuple(tensor.shape) != spec[n]:
                    raise EngineLoadError(f"{ENGINE}: {name} has shape {tuple(tensor.shape)}, the engine builds {spec[n]}")
                state[n] = tensor.float()
            else:
                lenient_unknown(name, n)
        return state

    def _load_eagle3(self, raw, files, bias, embed_t, head_t, text) -> None:
        d, H = self.dims, self.dims.hidden
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise EngineLoadError(f"{ENGINE}: EAGLE3 currently only supports 1 layer "
                                  f"(num_hidden_layers={raw.get('num_hidden_layers')})")
        if self.target_hidden != text.hidden_size:
            raise EngineLoadError(f"{ENGINE}: target_hidden_size {self.target_hidden}, the target's hidden size is "
                                  f"{text.hidden_size}")
        self.draft_vocab = raw.get("draft_vocab_size")
        spec = C.llama_layer_spec(self.dims, self.intermediate, "midlayer", 2 * H, input_norm=True)
        if self.attn_bias:  # the parent LlamaDecoderLayer's o_proj keeps attention_bias or bias
            spec["midlayer.self_attn.o_proj.bias"] = (H,)
        spec["midlayer.hidden_norm.weight"] = (H,)
        spec["fc.weight"] = (H, 3 * self.target_hidden)
        if bias:
            spec["fc.bias"] = (H,)
        spec["norm.weight"] = (H,)
        spec["embed_tokens.weight"] = (self.vocab, H)
        self.load_head_from_target = not self.tied and self.draft_vocab is None
        if not self.tied:
            spec["lm_head.weight"] = (int(self.draft_vocab or self.vocab), H)

        def unknown(name, n):
            if "d2t" in name:
                self.hot_token_id = files[name].long() + torch.arange(files[name].shape[0])
            elif "t2d" in name:
                pass
            else:  # llama_eagle3.py load_weights: `if param_name in params_dict:` ... else nothing
                self.ignored.append(name)

        state = self._fill(files, spec, unknown)
        replaced = set()
        if self.target_hidden == H:  # eagle_worker: set_embed(embed) (skipped when target_hidden_size != hidden_size)
            state["embed_tokens.weight"] = embed_t
            replaced.add("embed_tokens.weight")
        if self.load_head_from_target:  # set_embed_and_head(embed, head)
            state["lm_head.weight"] = head_t
            replaced.add("lm_head.weight")
        missing = sorted(set(spec) - set(state) - replaced)
        if missing:
            raise EngineLoadError(f"{ENGINE}: no tensor for {missing}: load_weights does not check, the parameters stay "
                                  "uninitialised")
        if self.tied:  # lm_head IS model.embed_tokens (after set_embed: the target's embedding)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        self.logits_vocab = int(self.draft_vocab) if self.draft_vocab is not None else self.vocab
        self.state = state
        # which target hidden states the model runner captures
        eagle_config = raw.get("eagle_config")
        self.use_aux, layer_ids = True, None  # model_runner: try: ... except: ids = None
        if isinstance(eagle_config, dict):
            self.use_aux = bool(eagle_config.get("use_aux_hidden_state", True))
            layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        L = text.num_hidden_layers
        capture = [2, L // 2, L - 3] if layer_ids is None else [int(i) + 1 for i in layer_ids]
        if self.use_aux and (len(set(capture)) != 3 or not all(1 <= j < L for j in capture)):
            raise EngineLoadError(f"{ENGINE}: layers_to_capture {capture} (layer ids {layer_ids}) on a {L}-layer target "
                                  "do not give 3 distinct captured layers (the loop captures layers 1..L-1 once each; "
                                  "fc takes 3)")
        self.capture = sorted(capture)  # appended in layer order

    def _load_eagle1(self, raw, files, embed_t, head_t) -> None:
        d, H = self.dims, self.dims.hidden
        self.layers = int(_get(raw, "num_hidden_layers"))
        spec = {"fc.weight": (H, 2 * H), "fc.bias": (H,), "embed_tokens.weight": (self.vocab, H)}
        for i in range(self.layers):
            spec.update(C.llama_layer_spec(self.dims, self.intermediate, f"layers.{i}", H, input_norm=i > 0))
            if self.attn_bias:
                for p in ("q", "k", "v"):
                    spec[f"layers.{i}.self_attn.{p}_proj.bias"] = (spec[f"layers.{i}.self_attn.{p}_proj.weight"][0],)
                spec[f"layers.{i}.self_attn.o_proj.bias"] = (H,)

        def unknown(name, n):
            if "lm_head" in name or "rotary_emb.inv_freq" in name:  # never loaded: the head is the target's
                return
            if any(s in n for s in STACKED) and not n.endswith(".bias"):
                raise EngineLoadError(f"{ENGINE}: {name} maps to no parameter: LlamaForCausalLM.load_weights "
                                      "indexes params_dict[name] for stacked q/k/v/gate/up names (KeyError)")
            self.ignored.append(name)  # .bias: skipped silently; others: logger.warning("... not found")

        state = self._fill(files, spec, unknown)
        # eagle_worker: set_embed_and_head(embed, head); tied draft config: lm_head is embed_tokens, the head wins
        state["embed_tokens.weight"] = head_t if self.tied else embed_t
        state["lm_head.weight"] = head_t
        missing = sorted(set(spec) - set(state))
        if missing:
            raise EngineLoadError(f"{ENGINE}: no tensor for {missing}: the parameters stay uninitialised")
        self.state = state
        self.logits_vocab = head_t.shape[0]

    # --- forward -----------------------------------------------------------------------------------------

    def _features(self, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.kind == "eagle" or not self.use_aux:
            return hidden[-1]  # the target's final normed state (logits processor input)
        return torch.cat([hidden[j] for j in self.capture], dim=-1)  # (T, 3 H_t), ascending layer order

    def _step(self, feature, ids, positions, store, visible_old, causal_new):
        """Feed m (feature, token) rows; returns (hidden for the logits (m, H), hidden fed onwards (m, H))."""
        s, d = self.state, self.dims
        embeds = s["embed_tokens.weight"][torch.as_tensor(ids)]  # (m, H)
        if self.kind == "eagle3":
            if feature.shape[-1] != embeds.shape[-1]:
                feature = C.linear(feature, s, "fc")
            residual = feature
            x = torch.cat([C.rms_norm(embeds, s["midlayer.input_layernorm.weight"], d.rms_eps),
                           C.rms_norm(feature, s["midlayer.hidden_norm.weight"], d.rms_eps)], dim=-1)  # (m, 2H)
            h = residual + C.attention(x, positions, s, "midlayer.self_attn", d, store[0], visible_old, causal_new)
            h = h + C.swiglu(C.rms_norm(h, s["midlayer.post_attention_layernorm.weight"], d.rms_eps), s, "midlayer.mlp")
            return C.rms_norm(h, s["norm.weight"], d.rms_eps), h
        h = C.linear(torch.cat([embeds, feature], dim=-1), s, "fc")  # (m, H)
        for i in range(self.layers):
            x = h if i == 0 else C.rms_norm(h, s[f"layers.{i}.input_layernorm.weight"], d.rms_eps)
            h = h + C.attention(x, positions, s, f"layers.{i}.self_attn", d, store[i], visible_old, causal_new)
            h = h + C.swiglu(C.rms_norm(h, s[f"layers.{i}.post_attention_layernorm.weight"], d.rms_eps), s, f"layers.{i}.mlp")
        return h, h

    def _probs(self, h: torch.Tensor) -> torch.Tensor:
        logits = (h @ self.state["lm_head.weight"].T)[:, : self.logits_vocab]  # LogitsProcessor truncation
        return torch.softmax(logits.float(), dim=-1)

    def _to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.hot_token_id is None else self.hot_token_id[idx]

    @torch.inference_mode()
    def propose(self, prompt_ids: list[int], depth: int, topk: int, num_draft_tokens: int) -> list[tuple[int, ...]]:
        """Prefill the prompt, draft a tree (speculative_num_steps=depth, speculative_eagle_topk=topk,
        speculative_num_draft_tokens=num_draft_tokens); the num_draft_tokens - 1 draft nodes as
        root-to-node paths of target ids (the bonus token not included)."""
        k, T = topk, len(prompt_ids)
        hidden, bonus = C.target_prefill(self.target, list(prompt_ids))
        stores = [C.KVStore() for _ in range(1 if self.kind == "eagle3" else self.layers)]
        ids = list(prompt_ids[1:]) + [bonus]  # prepare_for_extend: shifted, the verified id appended
        none_cached = torch.zeros(T, 0, dtype=torch.bool)
        logit_h, fed = self._step(self._features(hidden), ids, torch.arange(T), stores, none_cached, True)
        top = torch.topk(self._probs(logit_h[-1:])[0], k)  # capture_for_decode: fast_topk(softmax)
        topk_p, topk_index = top.values, self._to_target(top.indices)  # (k,)
        hidden_in = fed[-1:]
        score_list, token_list, parents_list = [], [], []
        lineage = [[] for _ in range(k)]  # store entries slot j's row may see beyond the prefix
        written: list[int] = []  # entry each slot wrote at the last forward
        scores = None
        for i in range(depth):
            if i == 0:  # select_top_k_tokens, first step after extend
                inputs, hidden_in, scores = topk_index, hidden_in.repeat_interleave(k, dim=0), topk_p
                score_list.append(topk_p)
                token_list.append(topk_index)
                parents_list.append(torch.arange(-1, k))
                sel = None
            else:
                expand = scores[:, None] * topk_p.reshape(k, k)  # (k, k): parent score x child prob
                cs = torch.topk(expand.flatten(), k)
                scores, flat_tokens = cs.values, topk_index.reshape(k * k)
                inputs, sel = flat_tokens[cs.indices], cs.indices // k
                hidden_in = hidden_in[sel]
                score_list.append(expand.flatten())
                token_list.append(flat_tokens)
                parents_list.append(cs.indices + (k * k * (i - 1) + k))
            if i == depth - 1:  # "We don't need to run the last forward"
                break
            if sel is not None:
                if self.draft_attention == "ancestors":
                    lineage = [lineage[p] + [written[p]] for p in sel.tolist()]
                else:  # generate_draft_decode_kv_indices: slot j keeps its own earlier entries
                    lineage = [lineage[j] + [written[j]] for j in range(k)]
            before = len(stores[0])
            visible = torch.zeros(k, before, dtype=torch.bool)
            visible[:, :T] = True
            for j in range(k):
                visible[j, lineage[j]] = True
            pos = torch.full((k,), T + i + (1 if self.legacy_positions else 0))
            logit_h, hidden_in = self._step(hidden_in, inputs.tolist(), pos, stores, visible, False)
            written = list(range(before, before + k))
            top = torch.topk(self._probs(logit_h), k, dim=-1)  # (k, k)
            topk_p, topk_index = top.values.flatten(), self._to_target(top.indices.flatten())
        # organize_draft_results
        flat_scores, flat_tokens = torch.cat(score_list), torch.cat(token_list)
        chosen = torch.sort(torch.topk(flat_scores, num_draft_tokens - 1).indices).values.tolist()
        parent_list = torch.cat(parents_list[:-1]).tolist() if len(parents_list) > 1 else [-1]
        parent_of = [parent_list[c // k] for c in range(len(flat_tokens))]
        paths = C.paths_from_parents(flat_tokens.tolist(), parent_of)
        return [paths[c] for c in chosen]


def load(folder, target, **options) -> Emulator:
    """``target``: the transformers target model (fp32, eval). Options: draft_attention ("sglang" |
    "ancestors"), legacy_positions (bool), rope_reader ("both" | "legacy" | "current")."""
    return Emulator(Path(folder), target, **options)
