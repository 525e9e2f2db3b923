"""What a verify forward needs to know about the target's layers, read from its config.

transformers builds every target from its config: ``config.layer_types`` (or, where a config has
none, ``sliding_window`` / ``attention_chunk_size``) names each decoder layer's kind, and
``cache_utils.get_layer_types_and_kwargs`` maps the kinds to cache layers (transformers 5.25,
``cache_utils.py``: ``DynamicLayer``, ``DynamicSlidingWindowLayer``, ``LinearAttentionLayer``,
``LinearAttentionAndFullAttentionLayer``, ``DummyLayer``). selfdraft meets each kind through those
interfaces, never through modeling code:

- **Attention layers** (full, sliding window, chunked; with sinks, soft-capping, latent attention or
  expert routing inside, which change nothing here) take the decoder's own additive 4D mask, which
  transformers' models pass on as it is (``masking_utils._preprocess_mask_arguments``: "If the mask
  is already 4D, simply return as-is"). A model that mixes kinds takes one mask per kind, as a dict
  keyed by layer type (its forward: ``if not isinstance(causal_mask_mapping := attention_mask,
  dict)``). Full attention sees the tree's pattern; a sliding layer of window W also requires
  ``q_pos - k_pos < W`` (``masking_utils.sliding_window_overlay``), a chunked one of size C the same
  chunk (``chunked_overlay``). The masks are built from position ids, not cache slots, so they hold
  for a batch whose rows leave holes in the cache (inference/batch.py).
- **Sliding and chunked caches keep every key.** ``DynamicSlidingWindowLayer`` keeps the last W - 1
  slots, which is right for one row fed in order but loses keys of a batch row with holes, and it
  can be cropped past its window only while recording. So the decoder's cache holds a plain
  ``DynamicLayer`` for those layers (the mask applies the window): rollback is ``DynamicLayer.crop``
  at any length. The price is memory: a sliding layer holds the whole text, as a full one does.
- **Recurrent layers** (linear attention, state-space and short-convolution layers: ``conv``,
  ``linear_attention``, ``hybrid``) keep one state per row, which has one history: a branching tree
  cannot be verified in one forward, so such a target verifies a chain (the best path of the draft
  tree; :meth:`~selfdraft.inference.tree.DraftTree.best_path`). Their rollback is transformers' own:
  ``Cache.activate_past_recording(recurrent_states_to_keep=K)`` once the prompt is in (as
  ``generation/utils.py`` does for assisted decoding), then ``Cache.crop(-n)`` after every verify,
  which restores the state recorded n tokens back and shrinks the conv window again
  (``LinearAttentionCacheLayerMixin.crop``). Their mask entry is None
  (``masking_utils.create_recurrent_attention_mask`` returns None for a 4D mask too).

Attention backends: the mask is additive float, which ``sdpa`` and ``eager`` both take (a bool mask
is wrong under eager, docs/architecture.md); flash and flex kernels take no custom mask here, so a
model loaded with one is refused with a message that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs,
)

from selfdraft.errors import SelfdraftError

MASKED_BACKENDS = ("sdpa", "eager")
"""Attention implementations that take selfdraft's additive 4D float mask."""

# Layer types (``config.layer_types`` values, transformers 5.25) by what their mask entry is.
_ATTENTION = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
              "hybrid": "full", "hybrid_sliding": "sliding"}
_UNSUPPORTED = {  # known layer types the decoder refuses, and why
    "indexed_attention": "its sparse-attention indexer keeps keys of its own in the cache (DynamicIndexedLayer), "
                         "which a commit and a batch's rows do not keep in step",
    "compressed_sparse_attention": "its cache holds compressed keys that a draft's rollback cannot cut by token",
    "heavily_compressed_attention": "its cache holds compressed keys that a draft's rollback cannot cut by token",
}
_NO_MASK = {"linear_attention", "conv", "mamba", "moe", "mlp", "dummy"}
_RECURRENT_CACHE = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}
_PADDED = {"linear_attention", "conv", "mamba"}  # mask entries that take a 2D padding mask

RECURRENT_HISTORY = 64
"""Recurrent states recorded per forward: the most tokens one verify (or a drafter's catch-up) can roll back."""


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(Q, K) or (B, Q, K) bool "may attend" -> (1 or B, 1, Q, K) additive mask of ``dtype`` on
    ``visible``'s device: 0 where allowed, the dtype's most negative value elsewhere. A float mask, never
    a bool one: the eager attention path adds the mask."""
    rows = visible.reshape(-1, *visible.shape[-2:])  # (B, Q, K); B = 1 for a (Q, K) pattern
    mask = torch.zeros(rows.shape[0], 1, *rows.shape[1:], dtype=dtype, device=visible.device)
    return mask.masked_fill_(~rows[:, None], torch.finfo(dtype).min)


def attention_backend(config) -> str:
    """The attention implementation to load a target of ``config`` with: ``sdpa`` where the family's model
    class has it, else ``eager`` (soft-capping, attention sinks: transformers refuses sdpa for those,
    ``PreTrainedModel._supports_sdpa``). Both take the decoder's float 4D mask; neither needs a package
    beyond torch. A remote-code architecture, whose class the mapping does not hold, gets sdpa."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
    return "eager" if model_class is not None and not getattr(model_class, "_supports_sdpa", False) else "sdpa"


@dataclass(frozen=True)
class TargetLayers:
    """The mask rules, cache and tree ability of one target, read from its config by :meth:`of`.

    rules:     per mask key (a layer type, or "" for the one mask of a model that takes a single one):
               ("full" | "sliding" | "chunked" | "none", size); size is the window or chunk, else 0.
    keyed:     the model takes a dict of masks keyed by layer type (it mixes layer kinds).
    recurrent: some layer keeps a recurrent or convolution state: rollback by recording.
    trees:     a branching tree can be verified in one forward (False: chains only, for recurrent layers).
    backend:   the attention implementation the model was loaded with.
    """

    family: str
    rules: tuple[tuple[str, str, int], ...]
    keyed: bool
    recurrent: bool
    trees: bool
    backend: str

    @property
    def windowed(self) -> bool:
        """Some layer sees less than the whole causal past: masks are built for every forward."""
        return any(rule in ("sliding", "chunked") for _, rule, _ in self.rules)

    @classmethod
    def of(cls, model) -> "TargetLayers":
        """Read ``model``'s layer kinds; a clear error for a kind or backend the decoder cannot mask."""
        config = model.config
        text = config.get_text_config(decoder=True)
        family = getattr(text, "model_type", None) or type(model).__name__
        backend = getattr(config, "_attn_implementation", None) or "eager"
        if backend not in MASKED_BACKENDS:
            raise SelfdraftError(
                f"the {family} target was loaded with attn_implementation={backend!r}, which takes no custom 4D mask; "
                f"tree verification needs one of {', '.join(MASKED_BACKENDS)}: load it with attn_implementation='sdpa' "
                "(or 'eager' where the family has no sdpa path)")
        try:
            cache_types, kwargs = get_layer_types_and_kwargs(text)
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise SelfdraftError(f"{family}: transformers cannot lay out a cache for this config ({type(err).__name__}: "
                                 f"{err}); this family is not supported") from err
        named = getattr(text, "layer_types", None)
        mask_types = list(named) if named is not None else list(cache_types)
        by_type: dict[str, tuple[str, int]] = {}
        for index, (layer_type, cache_type, extra) in enumerate(zip(mask_types, cache_types, kwargs)):
            if layer_type in _ATTENTION:
                rule = _ATTENTION[layer_type]
                size = 0
                if rule != "full":  # a KV-sharing layer's cache entry has no kwargs: the config's own window then
                    size = int(extra.get("sliding_window") or getattr(text, "sliding_window" if rule == "sliding"
                                                                      else "attention_chunk_size", None) or 0)
                if rule != "full" and size <= 0:
                    raise SelfdraftError(f"{family}: layer {index} is {layer_type} but its config gives no window size")
            elif layer_type in _NO_MASK or cache_type == "dummy":
                rule, size = "none", 0
            elif layer_type in _UNSUPPORTED:
                raise SelfdraftError(f"{family}: layer {index} is {layer_type}: {_UNSUPPORTED[layer_type]}; this family "
                                     "is not supported")
            else:
                raise SelfdraftError(
                    f"{family}: layer {index} is of type {layer_type!r}, which selfdraft's verify forward does not know "
                    f"how to mask (it knows {', '.join(sorted(set(_ATTENTION) | _NO_MASK))}); this family is not supported")
            if by_type.setdefault(layer_type, (rule, size)) != (rule, size):
                raise SelfdraftError(
                    f"{family}: {layer_type} layers with different windows ({by_type[layer_type][1]} and {size}) take one "
                    "mask between them in transformers; this family is not supported")
        keyed = named is not None and len(set(named)) > 1
        attention = [r for r in by_type.values() if r[0] != "none"]
        if not keyed and len(set(attention)) > 1:
            raise SelfdraftError(f"{family}: layers with different windows ({sorted(set(attention))}) but no layer_types "
                                 "to key their masks by; this family is not supported")
        rules = tuple((t, *r) for t, r in by_type.items()) if keyed else (("", *(attention[0] if attention else ("none", 0))),)
        recurrent = any(t in _RECURRENT_CACHE for t in cache_types)
        trees = not recurrent
        return cls(family=family, rules=rules, keyed=keyed, recurrent=recurrent, trees=trees, backend=backend)

    def probe(self, model) -> None:
        """Check, once at load, that the decoder's forwards reproduce the model's own: a prompt, then a draft
        tree (a right chain and, where trees are verified, a wrong sibling fed before it, so that positions
        and slots differ) with explicit masks and position ids, the accepted path moved and the rest
        rolled back as a commit does, and a second feed, against plain forwards over the whole text. The
        prompt is longer than every window the config names (up to 256 tokens) and the tree crosses a
        window's boundary, so that a window or chunk the masks do not apply shows. A family whose layers compute something these forwards do not feed
        (positions made from token ids or cache slots, a cache of its own, an attention the mask does not
        reach) is refused here with what went wrong, rather than decoding wrongly or failing mid-decode."""
        text_config = model.config.get_text_config(decoder=True)
        vocab = int(text_config.vocab_size)
        device, dtype = model.device, next(model.parameters()).dtype
        windows = [v for k, v in text_config.to_dict().items()
                   if ("window" in k or "chunk" in k) and isinstance(v, int) and not isinstance(v, bool) and v > 0]
        window = min(max(windows, default=0), 256)
        p = 2 * window - 2 if window > 4 else 6  # prompt tokens: the tree crosses a window's (or chunk's) boundary
        n = p + 7
        text = (torch.arange(n, device=device) * 7 + 3) % max(vocab - 3, 1) + 3  # (n,) ids inside the vocabulary
        arange = torch.arange(n, device=device)
        problem = None
        try:
            with torch.inference_mode():
                # Logits of the last n - p + 1 positions only (p - 1 .. n - 1): a large vocabulary makes the rest costly.
                kept = n - p + 1
                reference = model(input_ids=text[None], use_cache=False, logits_to_keep=kept).logits[0].float()  # (kept, V)
                cache = self.new_cache(model)
                scale = float(reference.abs().max()) + 1.0
                tolerance = (1e-3 if dtype == torch.float32 else 5e-2) * scale

                def feed(ids, positions, visible, keep=0):
                    past = cache_length[0]
                    keys = torch.arange(past + ids.numel(), device=device)
                    if visible is None:
                        visible = keys[None, :] <= positions[:, None]
                    mask = self.masks(visible[None], positions[None], keys[None], dtype)
                    cache_length[0] += ids.numel()
                    return model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, cache=cache,
                                 use_cache=True, logits_to_keep=keep).logits[0].float()

                def compare(got, want, what):
                    worst = float((got - want).abs().max())
                    if worst > tolerance:
                        return f"{what}: logits differ from the model's own forward by {worst:.3g} (scale {scale:.3g})"
                    return None

                cache_length = [0]
                problem = compare(feed(text[:p], arange[:p], None, keep=1)[-1], reference[0], "the prompt")
                # The root (position p) and a chain of 4 drafts (p + 1 .. p + 4); with trees, a wrong sibling of
                # the first draft fed right after the root.
                root, chain = text[p:p + 1], text[p + 1:p + 5]
                wrong = (chain[:1] + 1) % vocab
                tokens = torch.cat([root, wrong, chain]) if self.trees else torch.cat([root, chain])
                m = tokens.numel()
                positions = torch.cat([arange[p:p + 1], arange[p + 1:p + 2] if self.trees else arange[:0], arange[p + 1:p + 5]])
                ancestors = torch.ones(m, m, dtype=torch.bool, device=device).tril()  # (m, m)
                if self.trees:
                    ancestors[2:, 1] = False  # the chain does not see the sibling
                visible = torch.cat([ancestors.new_ones(m, p), ancestors], dim=1)
                self.start_recording(cache)
                logits = feed(tokens, positions, visible)
                path = [0, *range(m - 4, m)]  # the root and the chain
                problem = problem or compare(logits[path], reference[1:6], "a draft tree")
                if self.trees:
                    alone = model(input_ids=torch.cat([text[:p + 1], wrong])[None], use_cache=False,
                                  logits_to_keep=1).logits[0, -1].float()
                    problem = problem or compare(logits[1], alone, "a draft's sibling")
                    for layer in cache.layers:  # keep the root and two drafts: move them forward, as a commit does
                        if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] == p + m:
                            for states in (layer.keys, layer.values):
                                states[..., p + 1:p + 3, :] = states[..., p + 2:p + 4, :].clone()
                cache.crop(-(m - 3))  # keep the root and two drafts
                cache_length[0] = p + 3
                problem = problem or compare(feed(text[p + 3:n], arange[p + 3:n], None), reference[4:],
                                             "after a rollback")
        except Exception as err:  # whatever a forward raised, a family that fails here is not one to decode with
            problem = f"a verify forward failed ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
        if problem is not None:
            raise SelfdraftError(
                f"the {self.family} target does not verify drafts exactly under selfdraft's forwards ({problem}); "
                "this family is not supported (docs/families.md lists the families checked)")

    def new_cache(self, model) -> DynamicCache:
        """An empty cache for one generation: transformers' ``DynamicCache`` for ``model``, with every
        sliding or chunked layer holding all its keys (see the module docstring)."""
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
                cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
            elif isinstance(layer, DynamicSlidingWindowLayer):
                cache.layers[i] = DynamicLayer()
        return cache

    def start_recording(self, cache: DynamicCache) -> None:
        """After the prompt: record recurrent states so that rejected drafts can be cropped away."""
        if self.recurrent:
            cache.activate_past_recording(recurrent_states_to_keep=RECURRENT_HISTORY)
            for layer in _recurrent_layers(cache):  # transformers 5.25 gives every state one shared list
                layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}

    def keep_rows(self, cache: DynamicCache, fed: int, kept: list[int]) -> None:
        """Roll a batch back after a verify that fed ``fed`` tokens to every row, row i keeping its first
        ``kept[i]``: recurrent states per row, attention layers cropped to the longest kept.

        transformers' ``Cache.crop(-n)`` rolls every row back by the same n; a batch's rows accept
        different numbers of drafts. So each recurrent layer's row i takes, from what the layer
        recorded during the verify (``LinearAttentionCacheLayerMixin.update_recurrent_state`` keeps the
        state before each fed token in ``recurrent_states_history``; ``update_conv_state`` keeps the
        whole convolution input while recording), the state after its kept tokens and the convolution
        window ending there, as ``LinearAttentionCacheLayerMixin.crop`` does for one count
        (transformers 5.25 ``cache_utils.py``).
        """
        most = max(kept)
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                rows = torch.tensor(kept, device=layer.device)
                for s in range(layer.number_of_states):
                    if layer.is_recurrent_states_initialized[s]:
                        history = layer.recurrent_states_history[s]
                        if len(history) < fed:
                            raise SelfdraftError(f"the {self.family} target recorded {len(history)} recurrent states "
                                                 f"for a verify of {fed} tokens: cannot roll it back")
                        states = torch.stack([*history[len(history) - fed:], layer.recurrent_states[s]])  # (fed + 1, B, ...)
                        chosen = states[rows, torch.arange(len(kept), device=layer.device)]  # (B, ...)
                        layer.recurrent_states[s].copy_(chosen)
                        layer.recurrent_states_history[s] = []
                    if layer.is_conv_states_initialized[s]:
                        buffer, width = layer.conv_states[s], layer.conv_kernel_size[s]  # (B, C, past + fed)
                        ends = buffer.shape[-1] - fed + rows  # (B,): one past each row's last kept input
                        index = ends[:, None] - width + torch.arange(width, device=layer.device)[None, :]  # (B, K)
                        layer.conv_states[s] = buffer.gather(-1, index[:, None, :].expand(-1, buffer.shape[1], -1))
                layer.cumulative_length_linear.sub_(fed - most)
            if isinstance(layer, DynamicLayer) and fed > most:  # the attention part of a layer (hybrid ones too)
                DynamicLayer.crop(layer, most - fed)

    def masks(self, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
              dtype: torch.dtype, padding: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor | None]:
        """The attention mask(s) of one forward.

        visible: (B, T, K) bool, which keys each fed token may see by the tree and the cache's validity;
        query_positions (B, T) and key_positions (B, K): position ids of the fed tokens and of every key
        slot (cached slots first, then the fed tokens). Returns (B, 1, T, K) additive float masks: one,
        or a dict keyed by layer type. ``padding`` (B, T), 1 at real tokens: what recurrent layers get
        (transformers' 2D padding mask, which zeroes a left-padded prompt's padding before it reaches
        their state); None: nothing padded before a real token.
        """
        made: dict[tuple[str, int], torch.Tensor | None] = {}

        def build(rule: str, size: int, key: str = "") -> torch.Tensor | None:
            if rule == "none":
                return padding if padding is not None and key in _PADDED else None
            if (rule, size) not in made:
                allowed = visible
                if rule == "sliding":
                    allowed = visible & (query_positions[:, :, None] - key_positions[:, None, :] < size)  # (B, T, K)
                elif rule == "chunked":
                    allowed = visible & (query_positions[:, :, None] // size == key_positions[:, None, :] // size)
                made[rule, size] = additive_mask(allowed, dtype)
            return made[rule, size]

        if not self.keyed:
            return build(*self.rules[0][1:], key=self.rules[0][0] or "linear_attention")
        return {key: build(rule, size, key) for key, rule, size in self.rules}


def _recurrent_layers(cache: DynamicCache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
