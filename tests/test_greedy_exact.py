"""Greedy speculative output equals the target's own greedy generate(), token for token (fp32).

On a tiny random Llama here, for every drafter and several tree shapes, including scripted drafters
that are right sometimes and always wrong. The real embedded target is in test_embedded.py. The
models live on ``SELFDRAFT_TEST_DEVICE`` (the ``test_device`` fixture, default cpu).
"""

import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.configs.decode import DecodeConfig, DRAFT_MODEL_TREE, PromptLookupConfig
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.drafters import DraftModelDrafter, Drafter, NoDrafter, PromptLookupDrafter
from selfdraft.inference.session import CausalLMSession
from selfdraft.inference.tree import DraftTree

VOCAB = 97


def tiny_llama(seed, device, hidden=64, layers=2, vocab=VOCAB):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval().to(device)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def target(test_device):
    return tiny_llama(0, test_device)


@pytest.fixture(scope="module")
def draft(test_device):
    return tiny_llama(1, test_device, hidden=32, layers=1)


def prompts():
    rng = random.Random(7)
    repetitive = [rng.randrange(VOCAB) for _ in range(15)] * 3  # prompt lookup finds matches here
    return [repetitive, [rng.randrange(VOCAB) for _ in range(9)], [4]]


def hf_greedy(model, prompt, n):
    x = torch.tensor([prompt], device=model.device)
    out = model.generate(x, do_sample=False, max_new_tokens=n, attention_mask=torch.ones_like(x))
    return out[0, len(prompt):].tolist()


class OracleDrafter(Drafter):
    """Knows the target's greedy continuation and drafts it with planted mistakes.

    Each draft token is corrupted with probability ``error_rate``; with ``siblings`` each depth also
    gets wrong siblings (a tree). error_rate 1 with siblings gives an always-wrong tree.
    """

    name = "oracle"

    def __init__(self, truth, error_rate, depth=5, siblings=0, seed=0):
        self.truth, self.error_rate, self.depth, self.siblings = truth, error_rate, depth, siblings
        self.rng = random.Random(seed)

    def propose(self, state, sequence):
        t = len(sequence)
        paths, prefix = [], []
        for d in range(self.depth):
            right = self.truth[t + d] if t + d < len(self.truth) else 0
            tok = right if self.rng.random() >= self.error_rate else (right + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
            for s in range(self.siblings):
                wrong = (right + 1 + s) % VOCAB
                paths.append(prefix + [wrong])
            prefix = prefix + [tok]
            paths.append(prefix)
        return DraftTree.from_paths(paths), state


def drafters(target, draft, truth):
    return {
        "none": NoDrafter(),
        "lookup-chain": PromptLookupDrafter(),
        "lookup-tree": PromptLookupDrafter(PromptLookupConfig(max_branches=4, num_tokens=6, max_nodes=20)),
        "lookup-short": PromptLookupDrafter(PromptLookupConfig(max_ngram=1, num_tokens=2)),
        "draft-chain": DraftModelDrafter(draft, dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=1)),
        "draft-tree": DraftModelDrafter(draft, dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=3, max_nodes=12)),
        "self-draft-tree": DraftModelDrafter(target, dataclasses.replace(DRAFT_MODEL_TREE, depth=6, top_k=2, max_nodes=10)),
        "oracle-half-right": OracleDrafter(truth, 0.5, depth=5, seed=1),
        "oracle-tree-mostly-right": OracleDrafter(truth, 0.2, depth=4, siblings=2, seed=2),
        "oracle-always-wrong-chain": OracleDrafter(truth, 1.0, depth=5, seed=3),
        "oracle-always-wrong-tree": OracleDrafter(truth, 1.0, depth=3, siblings=3, seed=4),
        "oracle-perfect": OracleDrafter(truth, 0.0, depth=7),
    }


@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_every_drafter_matches_generate(target, draft, prompt_index):
    prompt = prompts()[prompt_index]
    n = 64
    ref = hf_greedy(target, prompt, n)
    truth = prompt + ref
    for name, drafter in drafters(target, draft, truth).items():
        out = speculative_decode(CausalLMSession(target), prompt, drafter, DecodeConfig(max_new_tokens=n))
        assert out.token_ids == ref, f"{name}: first divergence at {next(i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)}"
        stats = out.stats
        assert sum(k * v for k, v in stats.accept_histogram.items()) == n
        assert stats.target_forwards == sum(stats.accept_histogram.values())
        if name == "none" or "always-wrong" in name:
            assert stats.target_forwards == n, name
        if name == "oracle-perfect":
            assert stats.target_forwards == 1 + -(-(n - 1) // 8), stats.accept_histogram  # 8 tokens per step
        if name == "self-draft-tree":
            assert stats.target_forwards < n / 2


def test_eos_stops_like_generate(target):
    prompt = prompts()[1]
    free = hf_greedy(target, prompt, 40)
    eos = free[17]  # a token the target emits: generation must stop at its first occurrence
    target.generation_config.eos_token_id = eos
    try:
        ref = hf_greedy(target, prompt, 40)
    finally:
        target.generation_config.eos_token_id = None
    assert ref[-1] == eos and len(ref) <= 18
    for drafter in (NoDrafter(), OracleDrafter(prompt + free, 0.0, depth=6)):
        out = speculative_decode(CausalLMSession(target), prompt, drafter, DecodeConfig(max_new_tokens=40), eos_token_ids=[eos])
        assert out.token_ids == ref and out.stop_reason == "eos"


def test_max_new_tokens_and_context_limits(target):
    prompt = prompts()[0]
    truth = prompt + hf_greedy(target, prompt, 30)
    for n in (1, 2, 7):
        out = speculative_decode(CausalLMSession(target), prompt, OracleDrafter(truth, 0.0, depth=6), DecodeConfig(max_new_tokens=n))
        assert out.token_ids == truth[len(prompt) : len(prompt) + n] and out.stop_reason == "max_new_tokens"
    # A context of len(prompt) + 5 positions: 5 more tokens can be fed, the 6th new token ends it.
    out = speculative_decode(
        CausalLMSession(target), prompt, OracleDrafter(truth, 0.0, depth=6), DecodeConfig(max_new_tokens=30),
        max_context=len(prompt) + 5,
    )
    assert out.token_ids == truth[len(prompt) : len(prompt) + 6] and out.stop_reason == "context"
