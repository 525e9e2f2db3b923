"""Medusa heads and Medusa decoding: zero-init heads, sparse trees, greedy exactness.

The decoding tests build their models on ``SELFDRAFT_TEST_DEVICE`` (the ``test_device`` fixture, default
cpu); heads made on the CPU are moved to the target's device and dtype by the drafter.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.medusa.module import MedusaHeads
from selfdraft.inference.decode import speculative_decode
from selfdraft.heads.kinds.medusa.decode import MedusaDrafter
from selfdraft.heads.sparse_tree import CPU_CHOICES, normalise_choices, sparse_tree
from selfdraft.inference.session import CausalLMSession

VOCAB = 97


@pytest.fixture(scope="module")
def target(test_device):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval().to(test_device)
    model.generation_config.eos_token_id = None
    return model


def test_zero_initialised_heads_start_as_the_lm_head(target):
    heads = MedusaHeads(64, VOCAB, num_heads=3, num_layers=2).to(target.device)
    hidden = torch.randn(5, 64, device=target.device)
    logits = heads(hidden, target.lm_head)
    assert logits.shape == (3, 5, VOCAB)
    for k in range(3):
        torch.testing.assert_close(logits[k], target.lm_head(hidden))
    # Every block is its own module: no parameter is shared between heads or layers.
    params = [p for p in heads.parameters()]
    assert len({id(p) for p in params}) == len(params) == 3 * 2 * 2
    own = MedusaHeads(64, VOCAB, num_heads=2, own_lm_head=True).to(target.device)
    assert own(hidden).shape == (2, 5, VOCAB)
    with pytest.raises(SelfdraftError, match="lm_head"):
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
        x = torch.tensor([prompt], device=target.device)
        ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48)[0, len(prompt):].tolist()
        session = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
        out = speculative_decode(session, prompt, drafter, DecodeConfig(max_new_tokens=48))
        assert out.token_ids == ref
        assert sum(k * v for k, v in out.stats.accept_histogram.items()) == 48


@pytest.mark.slow
def test_medusa_sampling_has_the_target_distribution(law, test_device):
    """Exact law of 3 new tokens (product of the target's conditionals at T=0.8, top-p 0.9) against
    4,000 runs of the full loop with Medusa heads and the real session: the shared chi-square harness."""
    vocab, prompt, n_new, runs = 6, [1, 4, 2], 3, 4000
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )).eval().to(test_device)
    torch.manual_seed(4)
    heads = MedusaHeads(32, vocab, num_heads=2, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    cfg = DecodeConfig(max_new_tokens=n_new, temperature=0.8, top_p=0.9, stop_on_eos=False)
    drafter = MedusaDrafter(heads, model, [(0,), (1,), (0, 0), (0, 1)])
    counts, accepted_drafts = law.sample(lambda: CausalLMSession(model, hidden_layers=drafter.hidden_layers),
                                         drafter, prompt, n_new, cfg, runs, vocab)
    with torch.inference_mode():  # the exact law from the device's logits, read on the host
        exact = law.exact_logits(lambda c: model(torch.tensor([c], device=model.device)).logits[0, -1].cpu(),
                                 vocab, prompt, n_new, cfg)
    p_value, tv, cells = law.goodness_of_fit(counts, exact)
    assert accepted_drafts > runs * 0.2, "the heads' drafts were hardly ever accepted: the test would prove little"
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e} over {cells} cells (TV {tv:.4f})"


def test_typical_acceptance_is_opt_in_lossy_and_follows_its_threshold(test_device):
    from selfdraft.inference.tree import DraftTree, build_tree_buffers
    from selfdraft.inference.verify import typical_verify

    with pytest.raises(SelfdraftError, match="sampling mode"):
        DecodeConfig(acceptance="typical")
    assert DecodeConfig(acceptance="typical", temperature=1.0).lossy
    assert not DecodeConfig(temperature=1.0).lossy
    # Root: p = (0.5, 0.3, 0.2, 0, ...); a chain root -> token 1 -> token 2.
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.05, 0.05, 0.9, 0.0], [0.0, 0.0, 0.0, 1.0]],
                         dtype=torch.float64, device=test_device)
    tree = DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]))
    buffers = build_tree_buffers(tree)
    gen = torch.Generator(device=test_device).manual_seed(0)
    accepted, bonus = typical_verify(probs, tree.tokens, buffers, gen, epsilon=0.09, delta=0.3)
    assert accepted == [1, 2] and bonus == 3  # 0.3 and 0.9 pass their thresholds; the bonus comes from node 2
    accepted, bonus = typical_verify(probs, tree.tokens, buffers, gen, epsilon=0.5, delta=10.0)
    assert accepted == [] and bonus in (0, 1, 2)  # 0.3 < min(0.5, 10 * exp(-H)) at the root
