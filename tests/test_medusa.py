"""Medusa heads and Medusa decoding: zero-init heads, sparse trees, greedy exactness."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.medusa import CPU_CHOICES, MedusaDrafter, normalise_choices, sparse_tree
from selfdraft.inference.session import CausalLMSession

VOCAB = 97


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def test_zero_initialised_heads_start_as_the_lm_head(target):
    heads = MedusaHeads(64, VOCAB, num_heads=3, num_layers=2)
    hidden = torch.randn(5, 64)
    logits = heads(hidden, target.lm_head)
    assert logits.shape == (3, 5, VOCAB)
    for k in range(3):
        torch.testing.assert_close(logits[k], target.lm_head(hidden))
    # Every block is its own module: no parameter is shared between heads or layers.
    params = [p for p in heads.parameters()]
    assert len({id(p) for p in params}) == len(params) == 3 * 2 * 2
    own = MedusaHeads(64, VOCAB, num_heads=2, own_lm_head=True)
    assert own(hidden).shape == (2, 5, VOCAB)
    with pytest.raises(ValueError, match="lm_head"):
        heads(hidden)


def test_sparse_tree_is_best_first_by_expected_acceptance():
    acc = torch.tensor([[0.6, 0.2], [0.5, 0.1]])
    # (0,) 0.6, (0,0) 0.30, (1,) 0.2, (1,0) 0.10, (0,1) 0.06, (1,1) 0.02
    assert sparse_tree(acc, 3) == [(0,), (1,), (0, 0)]
    assert sparse_tree(acc, 4) == [(0,), (1,), (0, 0), (1, 0)]
    assert sparse_tree(acc, 10) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]


def test_bad_choices_are_refused():
    with pytest.raises(SelfdraftError, match="no parent"):
        normalise_choices([(0,), (1, 0)])
    with pytest.raises(SelfdraftError, match="only 2 heads"):
        normalise_choices([(0,), (0, 0), (0, 0, 0)], num_heads=2)


def perturbed_heads(seed, num_heads=4):
    torch.manual_seed(seed)
    heads = MedusaHeads(64, VOCAB, num_heads=num_heads, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads


@pytest.mark.parametrize(
    "choices", [CPU_CHOICES, [(0,), (0, 0), (0, 0, 0)], sparse_tree(torch.tensor([[0.5, 0.3, 0.1]] * 4), 12)],
    ids=["cpu-default", "chain", "sparse"],
)
def test_medusa_greedy_matches_generate(target, choices):
    drafter = MedusaDrafter(perturbed_heads(1), target, choices)
    for prompt in ([3, 14, 15, 92, 65, 35], [7] * 5, [1, 2, 3, 4, 1, 2, 3, 4]):
        ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48)[0, len(prompt):].tolist()
        session = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
        out = speculative_decode(session, prompt, drafter, DecodeConfig(max_new_tokens=48))
        assert out.token_ids == ref
        assert sum(k * v for k, v in out.stats.accept_histogram.items()) == 48
