"""heads/target_layers.py: the layer kinds read from a config, the masks per kind, the cache, the
backend chosen at load, and the check that refuses a family the decoder cannot verify exactly.

The exactness of whole decodes on every family is tests/test_families.py; the sampled law on a
sliding-window and a recurrent family is tests/test_sampling_exact.py.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import families  # noqa: E402

from selfdraft.errors import SelfdraftError  # noqa: E402
from selfdraft.heads.target import load_target  # noqa: E402
from selfdraft.heads.target_layers import TargetLayers, attention_backend  # noqa: E402
from selfdraft.inference.tree import DraftTree  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def test_layer_kinds_are_read_from_the_config():
    llama = TargetLayers.of(families.tiny_model("llama"))
    assert (llama.rules, llama.keyed, llama.recurrent, llama.trees, llama.windowed) == \
        ((("", "full", 0),), False, False, True, False)
    mistral = TargetLayers.of(families.tiny_model("mistral"))  # every layer sliding: one mask
    assert mistral.rules == (("", "sliding", 16),) and not mistral.keyed and mistral.windowed
    gemma3 = TargetLayers.of(families.tiny_model("gemma3_text"))  # sliding and full layers: a mask per type
    assert gemma3.keyed and dict((k, (r, n)) for k, r, n in gemma3.rules) == {
        "sliding_attention": ("sliding", 16), "full_attention": ("full", 0)}
    qwen3_next = TargetLayers.of(families.tiny_model("qwen3_next"))
    assert qwen3_next.recurrent and not qwen3_next.trees
    assert dict((k, r) for k, r, _ in qwen3_next.rules) == {"linear_attention": "none", "full_attention": "full"}


def test_sliding_layers_keep_every_key_and_recurrent_layers_are_transformers_own():
    model = families.tiny_model("qwen3_next")
    cache = TargetLayers.of(model).new_cache(model)
    assert {type(layer) for layer in cache.layers} == {DynamicLayer, LinearAttentionLayer}
    model = families.tiny_model("gemma3_text")
    assert all(type(layer) is DynamicLayer for layer in TargetLayers.of(model).new_cache(model).layers)


def test_masks_apply_windows_by_position_not_by_slot():
    """Row 0 holds positions 0..6 in slots 0..6; row 1 has a hole (slot 5 invalid), so its slot 6 holds
    position 5. With window 3, row 0's query at position 6 sees positions 4..6 (slots 4..6), row 1's at
    position 5 sees positions 3..5: slots 3, 4 and 6 (a window by slots would drop slot 3)."""
    layers = TargetLayers(family="toy", rules=(("sliding_attention", "sliding", 3), ("full_attention", "full", 0)),
                          keyed=True, recurrent=False, trees=True, backend="sdpa")
    keys = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 5]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    queries = keys[:, -1:]
    masks = layers.masks(valid[:, None, :], queries, keys, torch.float32)
    seen = {k: (m[:, 0, 0] == 0) for k, m in masks.items()}
    assert seen["full_attention"].tolist() == valid.tolist()
    assert seen["sliding_attention"].tolist() == [[False, False, False, False, True, True, True],
                                                  [False, False, False, True, True, False, True]]
    chunked = TargetLayers(family="toy", rules=(("", "chunked", 4),), keyed=False, recurrent=False, trees=True,
                           backend="sdpa")
    assert (chunked.masks(valid[:1, None, :], queries[:1], keys[:1], torch.float32)[0, 0, 0] == 0).tolist() == \
        [False, False, False, False, True, True, True]


def test_best_path_follows_values_else_first_children():
    tree = DraftTree.from_lists([10, 11, 12, 13, 14], [-1, -1, 0, 1, 1], [0.3, 0.6, 0.2, 0.1, 0.5])
    assert tree.best_path().token_ids == (11, 14)
    plain = DraftTree.from_lists([10, 11, 12, 13], [-1, -1, 0, 2])
    assert plain.best_path().token_ids == (10, 12, 13)
    assert DraftTree.chain([1, 2]).best_path().token_ids == (1, 2)


def test_backend_is_sdpa_where_the_family_has_it_else_eager():
    assert attention_backend(families.tiny_config("mistral")) == "sdpa"
    assert attention_backend(families.tiny_config("gemma2")) == "eager"  # soft-capping: transformers refuses sdpa
    assert attention_backend(families.tiny_config("gpt_oss")) == "eager"  # attention sinks


def test_a_backend_without_custom_masks_is_refused_with_the_fix():
    model = families.tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(SelfdraftError, match="attn_implementation='sdpa'"):
        TargetLayers.of(model)


@pytest.mark.parametrize("model_type, what", [
    ("roberta", "the prompt"),  # positions made from token ids: explicit position ids differ
    ("pegasus", "a draft tree"),  # positions made from cache slots
    ("deepseek_v32", "indexed_attention"),  # its indexer's own keys in the cache
])
def test_families_the_decoder_cannot_serve_are_refused_at_load(tmp_path, model_type, what):
    """load_target runs the check: a clear one-line error naming the family and what went wrong, from a
    folder as a user brings it."""
    model = families.tiny_model(model_type)
    model.save_pretrained(tmp_path)
    with pytest.raises(SelfdraftError) as err:
        load_target(str(tmp_path), dtype="float32")
    assert what in str(err.value) and "not supported" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model_type, backend", [("gemma2", "eager"), ("gpt_oss", "eager"), ("qwen3_next", "sdpa")])
def test_load_target_takes_families_that_need_another_backend_or_rollback(tmp_path, model_type, backend):
    families.tiny_model(model_type).save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype="float32")
    assert target.model.config._attn_implementation == backend
