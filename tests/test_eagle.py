"""EAGLE drafters: module shapes, vocabulary maps, and exact EAGLE-2 dynamic-tree decoding.

The tiny targets live on ``SELFDRAFT_TEST_DEVICE`` (the ``test_device`` fixture, default cpu); drafters
are made on the CPU and moved to the target's device and dtype by the adapter.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.configs.decode import DecodeConfig, TreeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.eagle import new_drafter
from selfdraft.heads.kinds.eagle.eagle3 import default_aux_layers
from selfdraft.inference.decode import speculative_decode
from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
from selfdraft.inference.session import CausalLMSession

VOCAB = 97


@pytest.fixture(scope="module")
def target(test_device):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().to(test_device)
    model.generation_config.eos_token_id = None
    return model


def greedy_reference(model, prompt, n):
    x = torch.tensor([prompt], device=model.device)
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


def random_drafter(target, kind, seed, draft_vocab=None):
    torch.manual_seed(seed)
    drafter = new_drafter(target, kind, draft_vocab_size=draft_vocab)
    if kind == "eagle3":
        drafter.set_vocab_map(torch.randperm(VOCAB)[: drafter.draft_vocab_size])
    return drafter.eval()


def test_shapes_and_vocabulary_maps(target):
    assert default_aux_layers(32) == [2, 16, 29]
    e1 = random_drafter(target, "eagle", 0)
    assert e1.fc.weight.shape == (64, 128) and isinstance(e1.layer.input_layernorm, torch.nn.Identity)
    e3 = random_drafter(target, "eagle3", 0, draft_vocab=40)
    assert e3.fc.weight.shape == (64, 3 * 64) and e3.layer.self_attn.q_proj.weight.shape[1] == 128
    assert e3.lm_head.weight.shape == (40, 64) and e3.aux_layers == [2, 3, 3]
    # Hand-checked map: draft ids 0..2 are target ids 5, 1, 7.
    small = random_drafter(target, "eagle3", 0, draft_vocab=3)
    small.set_vocab_map(torch.tensor([5, 1, 7]))
    assert small.d2t.tolist() == [5, 0, 5] and small.draft_to_target().tolist() == [5, 1, 7]
    assert small.t2d.nonzero().flatten().tolist() == [1, 5, 7]
    with pytest.raises(SelfdraftError, match="distinct"):
        small.set_vocab_map(torch.tensor([5, 5, 7]))
    e1, e3 = e1.to(target.device), e3.to(target.device)
    x = torch.randn(2, 5, 64, device=target.device)
    pos = torch.arange(5, device=target.device)[None].expand(2, 5)
    assert e1(x, x, pos, None).shape == (2, 5, 64) and e3(x, x, pos, None).shape == (2, 5, 64)
    assert e3.logits(e3(x, x, pos, None)).shape == (2, 5, 40)
    assert e1.logits(e1(x, x, pos, None), target.lm_head).shape == (2, 5, VOCAB)


@pytest.mark.parametrize("kind,tree", [
    ("eagle", TreeConfig()),
    ("eagle", TreeConfig(depth=3, top_k=1, max_nodes=3)),
    ("eagle3", TreeConfig(depth=4, top_k=3, max_nodes=8)),
    ("eagle3", TreeConfig(depth=6, top_k=10, max_nodes=60)),
], ids=["eagle-cpu", "eagle-chain", "eagle3-small", "eagle3-gpu-size"])
def test_greedy_dynamic_tree_matches_generate(target, kind, tree):
    drafter = EagleTreeDrafter(random_drafter(target, kind, 1, draft_vocab=60 if kind == "eagle3" else None), target, tree)
    forwards = 0
    for prompt in ([3, 14, 15, 92, 65, 35], [7] * 5, [1, 2, 3, 4, 1, 2, 3, 4]):
        ref = greedy_reference(target, prompt, 40)
        session = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
        out = speculative_decode(session, prompt, drafter, DecodeConfig(max_new_tokens=40))
        assert out.token_ids == ref
        assert out.stats.draft_nodes > 0
        forwards += out.stats.target_forwards
    if tree.top_k > 1:  # random drafters rarely agree with the target; wide trees still hit sometimes
        assert forwards < 3 * 40  # some draft tokens were accepted, so compaction and the drafter cache were exercised



def test_drafter_cache_stays_aligned_with_the_sequence(target):
    """After each step the drafter cache holds exactly the committed positions, and its features are the
    target's: feeding the whole sequence afresh gives the same root prediction."""
    drafter = EagleTreeDrafter(random_drafter(target, "eagle", 2), target, TreeConfig(depth=3, top_k=2, max_nodes=5))
    prompt = [5, 6, 7, 8, 9]
    session = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
    out = session.prefill(prompt)
    state = drafter.start(prompt, out)
    sequence = prompt + [int(out.logits[-1].argmax())]
    from selfdraft.inference.decode import tree_buffers
    from selfdraft.inference.drafters import Verified
    from selfdraft.inference.verify import greedy_verify

    for _ in range(4):
        tree, state = drafter.propose(state, sequence)
        assert state.cache.get_seq_length() == state.length == len(sequence) - 1
        fresh = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
        fresh_state = drafter.start(sequence[:-1], fresh.prefill(sequence[:-1]))
        fresh_state = drafter._catch_up(fresh_state, sequence)
        torch.testing.assert_close(fresh_state.out, state.out, rtol=1e-4, atol=1e-5)
        buffers = tree_buffers(tree)
        step = session.verify(sequence[-1], tree, buffers)
        accepted, bonus = greedy_verify(step.logits, tree.tokens, buffers)
        session.commit([0] + accepted)
        new = [int(tree.tokens[i - 1]) for i in accepted] + [bonus]
        state = drafter.observe(state, Verified(new, tuple(h[[0] + accepted] for h in step.hidden)))
        sequence += new


def test_a_drafter_for_another_target_is_refused(target):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(SelfdraftError, match="vocabulary"):
        EagleTreeDrafter(random_drafter(target, "eagle", 0), other)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_sampling_has_the_target_distribution(kind, law, test_device):
    """Exact law of 3 new tokens (T=0.8, top-p 0.9) against 3,000 runs of the full loop with a dynamic
    tree: the shared chi-square harness of the decoder tests."""
    vocab, prompt, n_new, runs = 6, [1, 4, 2], 3, 3000
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
    torch.manual_seed(4)
    drafter = new_drafter(model, kind, draft_vocab_size=5 if kind == "eagle3" else None)
    if kind == "eagle3":  # a draft vocabulary of 5 of the 6 tokens, its head started from the target's rows
        draft_ids = torch.tensor([4, 1, 0, 2, 5])
        drafter.set_vocab_map(draft_ids)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(model.lm_head.weight[draft_ids])
    model.to(test_device)
    tree = EagleTreeDrafter(drafter.eval(), model, TreeConfig(depth=3, top_k=2, max_nodes=5))
    cfg = DecodeConfig(max_new_tokens=n_new, temperature=0.8, top_p=0.9, stop_on_eos=False)
    counts, accepted = law.sample(lambda: CausalLMSession(model, hidden_layers=tree.hidden_layers),
                                  tree, prompt, n_new, cfg, runs, vocab)
    with torch.inference_mode():  # the exact law from the device's logits, read on the host
        exact = law.exact_logits(lambda c: model(torch.tensor([c], device=model.device)).logits[0, -1].cpu(),
                                 vocab, prompt, n_new, cfg)
    p_value, tv, cells = law.goodness_of_fit(counts, exact)
    assert accepted > runs // 10, f"too few accepted drafts ({accepted}) for the test to mean anything"
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e} over {cells} cells (TV {tv:.4f}): the sampler's law differs"


@pytest.mark.slow
@pytest.mark.embedded
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_trained_eagle_on_the_embedded_target_is_greedy_exact(embedded_fp32, trained_smollm2, kind):
    """A drafter trained on the real target (the engine tests' ``trained_smollm2``), then greedy decoding
    with a dynamic tree equals transformers' greedy output on chat prompts (fp32)."""
    from selfdraft.inference.api import encode_prompt
    from selfdraft.inference.prompts import mt_bench_prompts
    from selfdraft.inference.specs import make_drafter

    drafter = make_drafter(str(trained_smollm2[kind]), embedded_fp32)
    model = embedded_fp32.model
    accepted = 0
    for prompt in mt_bench_prompts(2):
        ids = encode_prompt(embedded_fp32.tokenizer, prompt.text, True)
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                             max_new_tokens=32, pad_token_id=0)[0, len(ids):].tolist()
        out = speculative_decode(CausalLMSession(model, hidden_layers=drafter.hidden_layers), ids, drafter,
                                 DecodeConfig(max_new_tokens=32), eos_token_ids=embedded_fp32.eos_token_ids)
        assert out.token_ids == ref[: len(out.token_ids)] and (len(out.token_ids) == 32 or out.stop_reason == "eos")
        accepted += sum(out.stats.depth_accepted.values())
    assert accepted > 0, "the trained drafter never had a draft token accepted: the exactness above was never tested on drafts"
