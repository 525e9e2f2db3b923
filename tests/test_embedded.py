"""Greedy exactness on the real embedded target (SmolLM2-135M-Instruct, fp32), every drafter.

A handful of MT-bench first turns (chat template) and HumanEval prompts, 64 new tokens: our
token_ids must equal the target's own generate(do_sample=False) output token for token.
"""

import dataclasses
import pytest
import torch

from selfdraft.configs.decode import DRAFT_MODEL_TREE, PromptLookupConfig
from selfdraft.inference.api import encode_prompt, generate
from selfdraft.inference.drafters import NoDrafter, PromptLookupDrafter
from selfdraft.inference.specs import make_drafter
from selfdraft.inference.prompts import humaneval_prompts, mt_bench_prompts

pytestmark = [pytest.mark.embedded, pytest.mark.slow]
NEW_TOKENS = 64


def reference(target, ids):
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = target.model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
            pad_token_id=target.tokenizer.pad_token_id or target.eos_token_ids[0],
        )
    return out[0, len(ids):].tolist()


def test_every_drafter_is_token_identical(embedded_fp32, truncated_smollm2):
    target = embedded_fp32
    prompts = [mt_bench_prompts()[i] for i in (0, 25)] + humaneval_prompts()[:1]  # writing, reasoning, code
    drafters = {
        "none": NoDrafter(),
        "prompt-lookup": PromptLookupDrafter(),
        "prompt-lookup-tree": PromptLookupDrafter(PromptLookupConfig(max_branches=3, num_tokens=6, max_nodes=14)),
        # A separate (weak) draft model: a 4-layer cut of the target, saved as its own HF folder.
        "draft-model-chain": make_drafter(f"draft-model:{truncated_smollm2}", target, tree=dataclasses.replace(DRAFT_MODEL_TREE, depth=3)),
        # The target drafting for itself through the draft-model path: a strong drafter, a real tree.
        "draft-model-tree": make_drafter(
            "draft-model:smollm2-135m", target, tree=dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=2, max_nodes=8)
        ),
    }
    # Every step drafts (policy cut), so every step's draft is verified; "draft-model-tree, adaptive"
    # decodes the writing prompt with the default policy, which switches that (slow on a CPU) drafter
    # off and on (tests/test_adaptive.py checks the adaptive policy with every drafter kind).
    runs = {name: (drafter, "cut") for name, drafter in drafters.items()}
    runs["draft-model-tree, adaptive"] = (drafters["draft-model-tree"], "adaptive")
    accepted = {name: [] for name in runs}
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
        ref = reference(target, ids)
        for name, (drafter, policy) in runs.items():
            if policy == "adaptive" and i > 0:
                continue
            result = generate(target, input_ids=ids, drafter=drafter, max_new_tokens=NEW_TOKENS, policy=policy)
            assert result.token_ids == ref, f"{name} on {prompt.id} diverges from generate()"
            accepted[name].append(result.acceptance_length)
    assert all(t == 1.0 for t in accepted["none"])
    # Real drafting happened: code prompts repeat themselves, and a model drafting for itself is
    # right almost always (only the tree budget limits it).
    assert max(accepted["prompt-lookup"]) > 1.2, accepted
    assert sum(accepted["draft-model-tree"]) / len(prompts) > 3.0, accepted
