"""Decoding on any device: explicit devices, few host syncs, drafters converted to the target's dtype.

Host syncs. On a GPU every read of a tensor's value from Python (``.item()``, ``.tolist()``,
``int(t)``, ``float(t)``, ``bool(t)``, ``t.__index__``, ``.cpu()``, ``.numpy()``) waits for the device
to finish everything queued before it. Here each of them is wrapped with a counter for one
generation, so the count is the same on any device (on the CPU it is an upper bound: it also counts
reads of host tensors). EAGLE-2's 60-node dynamic tree (depth 6, top_k 10) used to cost about 1,000
reads per step (one per candidate node); the decoder now makes one copy per draft proposal and one or
two per verification. Greedy output stays token-identical to the target's own generate().

Explicit devices. While decoding, a torch function mode records every tensor factory call (``torch.tensor``,
``zeros``, ``arange``, ``rand``, ...) and every ``torch.Generator`` made by selfdraft's code without a
``device=``: there must be none, so every tensor the decoder, the drafters, the verifiers and the
sampler make lands where it is used. That is the CPU's stand-in for a CUDA run, where such a tensor
would land on the CPU and meet the target's on the GPU.

The device is ``SELFDRAFT_TEST_DEVICE`` (default cpu), as in the other exactness suites.
"""

from __future__ import annotations

import dataclasses

import random
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

import selfdraft
from selfdraft.configs.decode import GPU_TREE, DecodeConfig, DRAFT_MODEL_TREE, TreeConfig, PromptLookupConfig
from selfdraft.heads.kinds.eagle import new_drafter
from selfdraft.heads.kinds.medusa.module import MedusaHeads
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter
from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
from selfdraft.heads.kinds.medusa.decode import MedusaDrafter
from selfdraft.heads.sparse_tree import sparse_tree
from selfdraft.inference.session import CausalLMSession

VOCAB = 97
NEW_TOKENS = 32
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")
"""The Tensor methods that copy a value to the host (and so wait for the device)."""
MAX_PER_STEP = 20
"""Issue 13's bound on host reads per target forward, whoever makes them (transformers included)."""
MAX_OURS_PER_STEP = 4
"""selfdraft's own: one per proposal, at most two per verification, the prefill's spread over the steps."""


@contextmanager
def counting_host_reads():
    """Count every call of the READS methods of torch.Tensor inside the block, by (method, caller
    file:line), in the Counter it yields."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            counts[(name, f"{caller.f_code.co_filename}:{caller.f_lineno}")] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def tiny_llama(seed: int, device, layers: int, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().to(device)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def target(test_device):
    return tiny_llama(0, test_device, layers=6)


@pytest.fixture(scope="module")
def draft_model(test_device):
    return tiny_llama(1, test_device, layers=1, hidden=32)


def eagle_module(target, kind, dtype=torch.float32):
    torch.manual_seed(1)
    drafter = new_drafter(target, kind, draft_vocab_size=60 if kind == "eagle3" else None)
    if kind == "eagle3":
        drafter.set_vocab_map(torch.randperm(VOCAB)[:60])
    return drafter.eval().to(dtype)


def medusa_heads(dtype=torch.float32):
    torch.manual_seed(2)
    heads = MedusaHeads(64, VOCAB, num_heads=4, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads.to(dtype)


MEDUSA_TREE = sparse_tree(torch.tensor([[0.5, 0.3, 0.1, 0.05]] * 4), 40)
LOOKUP = PromptLookupConfig(max_branches=4, num_tokens=6, max_nodes=20)
SYNC_DRAFTERS = {
    "eagle3-60-nodes": lambda target: EagleTreeDrafter(eagle_module(target, "eagle3"), target, GPU_TREE),
    "medusa-40-nodes": lambda target: MedusaDrafter(medusa_heads(), target, MEDUSA_TREE),
    "prompt-lookup-tree": lambda target: PromptLookupDrafter(LOOKUP),
}
PROMPTS = ([3, 14, 15, 92, 65, 35], [random.Random(7).randrange(VOCAB) for _ in range(12)] * 3)


def greedy_reference(model, prompt, n=NEW_TOKENS):
    x = torch.tensor([prompt], device=model.device)
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()


def decode(target, drafter, prompt, config):
    return speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), prompt, drafter, config)


def reads_per_step(target, drafter, prompt, config):
    """(output, host reads per target forward: all, selfdraft's own; the reads by caller)."""
    with counting_host_reads() as counts:
        out = decode(target, drafter, prompt, config)
    ours = sum(n for (_, where), n in counts.items() if "/inference/" in where)
    steps = out.stats.target_forwards
    top = ", ".join(f"{name} {where.rsplit('/', 2)[-1]} x{n}" for (name, where), n in counts.most_common(4))
    print(f"\n[{config.temperature=}] {sum(counts.values()) / steps:.1f} host reads per target forward "
          f"({ours / steps:.1f} ours; {steps} forwards, {len(out.token_ids)} tokens); most: {top}", end="")
    return out, sum(counts.values()) / steps, ours / steps, counts


@pytest.mark.parametrize("kind", list(SYNC_DRAFTERS))
def test_greedy_decoding_makes_few_host_syncs_and_stays_exact(target, kind):
    drafter = SYNC_DRAFTERS[kind](target)
    for prompt in PROMPTS:
        out, per_step, ours, counts = reads_per_step(target, drafter, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS))
        assert out.token_ids == greedy_reference(target, prompt)
        assert per_step < MAX_PER_STEP and ours <= MAX_OURS_PER_STEP, f"{per_step:.1f} ({ours:.1f} ours): {counts.most_common(8)}"


@pytest.mark.parametrize("kind", list(SYNC_DRAFTERS))
def test_sampled_decoding_makes_few_host_syncs(target, kind):
    drafter = SYNC_DRAFTERS[kind](target)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=0)
    out, per_step, ours, counts = reads_per_step(target, drafter, PROMPTS[1], config)
    assert per_step < MAX_PER_STEP and ours <= MAX_OURS_PER_STEP, f"{per_step:.1f} ({ours:.1f} ours): {counts.most_common(8)}"
    assert decode(target, drafter, PROMPTS[1], config).token_ids == out.token_ids, "one seed, one device: the same tokens"


def device_drafters(target, draft):
    """kind -> a function that wraps a drafter around modules made here (on the real default device)."""
    medusa, eagle1, eagle3 = medusa_heads(), eagle_module(target, "eagle"), eagle_module(target, "eagle3")
    return {
        "none": lambda: NoDrafter(),
        "prompt-lookup": lambda: PromptLookupDrafter(LOOKUP),
        "draft-model": lambda: DraftModelDrafter(draft, dataclasses.replace(DRAFT_MODEL_TREE, depth=3, top_k=2, max_nodes=6)),
        "medusa": lambda: MedusaDrafter(medusa, target, MEDUSA_TREE),
        "eagle": lambda: EagleTreeDrafter(eagle1, target, TreeConfig(3, 3, 6)),
        "eagle3": lambda: EagleTreeDrafter(eagle3, target, TreeConfig(3, 3, 6)),
    }


CONFIGS = {
    "greedy": DecodeConfig(max_new_tokens=12),
    "sampled": DecodeConfig(max_new_tokens=12, temperature=0.9, top_k=20, seed=3),
    "typical": DecodeConfig(max_new_tokens=12, temperature=0.9, acceptance="typical", seed=3),
}


SELFDRAFT = str(Path(__file__).resolve().parents[1])
SELFDRAFT_ROOTS = (SELFDRAFT, str(Path(selfdraft.__file__).parent))
"""Where selfdraft's code is: the repository, and the imported package (on the GPU machine a folder of links
to the repository's folders, under another path)."""
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.eye,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace}


class DevicelessFactories(TorchFunctionMode):
    """Records (function, file:line) of each tensor factory call from selfdraft's own code without device=."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.checked = 0  # factory calls from selfdraft's code: the check saw something

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = sys._getframe(1).f_code.co_filename
        if func in FACTORIES and caller.startswith(SELFDRAFT_ROOTS) and "/tests/" not in caller:
            self.checked += 1
            if kwargs.get("device") is None:
                self.found.append(f"torch.{func.__name__} at {caller}:{sys._getframe(1).f_lineno}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "draft-model", "medusa", "eagle", "eagle3"])
def test_every_tensor_is_made_on_an_explicit_device(target, draft_model, kind, monkeypatch):
    prompt = PROMPTS[1][:20]
    make = device_drafters(target, draft_model)[kind]
    generator = torch.Generator
    generators: list[str] = []

    def checked_generator(*args, **kwargs):
        if "device" not in kwargs:
            generators.append(f"torch.Generator at {sys._getframe(1).f_code.co_filename}:{sys._getframe(1).f_lineno}")
        return generator(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", checked_generator)
    for name, config in CONFIGS.items():
        with DevicelessFactories() as mode:  # the adapter and the whole decode
            got = decode(target, make(), prompt, config).token_ids
        assert mode.checked > 0, f"no tensor factory call from {SELFDRAFT} was seen: is selfdraft imported from elsewhere?"
        assert not mode.found and not generators, f"{kind} {name}: made without a device: {mode.found + generators}"
        if name == "greedy":
            assert got == greedy_reference(target, prompt, 12)


def test_a_drafter_in_another_dtype_is_converted_and_said(target, capsys):
    """Medusa heads in float64 and an EAGLE-3 drafter in bfloat16 meet a float32 target: each is
    converted to the target's dtype, with a line on stderr, and decodes exactly."""
    prompt = PROMPTS[0]
    reference = greedy_reference(target, prompt)
    dtype = target.dtype
    for make, what in ((lambda: MedusaDrafter(medusa_heads(torch.float64), target), "Medusa heads"),
                       (lambda: EagleTreeDrafter(eagle_module(target, "eagle3", torch.bfloat16), target), "eagle3 drafter")):
        drafter = make()
        said = capsys.readouterr().err
        assert what in said and f"to {target.device}/{dtype}" in said, said
        module = drafter.heads if isinstance(drafter, MedusaDrafter) else drafter.drafter
        assert {p.dtype for p in module.parameters()} == {dtype}
        assert decode(target, drafter, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS)).token_ids == reference
    MedusaDrafter(medusa_heads(dtype).to(target.device), target)
    assert "moved" not in capsys.readouterr().err, "nothing to convert: nothing said"
