"""Exported EAGLE drafters draft, in emulations of SGLang and of the reference EAGLE code, exactly the
tokens our own drafter drafts.

The emulators (``sglang_emulator.py``, ``eagle_reference_emulator.py``) are written from the engines'
source (files, commits and behaviours in their docstrings), not from our exporter: each loads the
folder the way its engine does (config keys, tensor names, biases, tie handling, rope base, aux-layer
convention, d2t) and drafts the engine's tree. For every target and drafter kind the test exports the
drafter, loads the folder through the emulator and compares the SET of root-to-node paths (target ids) it
proposes with ``EagleTreeDrafter``'s over three decoding positions (the prompt extended by 0, 3 and 6
greedy tokens), for a chain and small trees.

Targets: the embedded SmolLM2-135M-Instruct (tied embeddings, rope base 1e5; its drafters get three real
AdamW steps of our EAGLE objective on a short question and answer), and tiny random transformers
targets with 8 layers: an untied Llama (rope base 5e5), Qwen2 (q/k/v biases) and Qwen3 (q/k norms,
heads * head_dim = 2 * hidden like the released Qwen3 models). The tiny targets have no tokenizer and no
data, so their drafters are random weights perturbed (every parameter + 0.1 N(0, 1)) with a random
draft vocabulary map in random order. One SGLang case uses non-default aux layers.

SGLang's draft attention for topk > 1 keeps each slot's own earlier entries, not the ancestors of the
node in the slot (sglang issue #7523): exact for chains and depth-2 trees, which are compared as SGLang
runs them; the depth-3 tree is compared with the emulator's ``draft_attention="ancestors"`` (EAGLE-2's
tree attention), so that it tests the export and not that engine approximation. The SGLang emulator
runs in its strict rope mode: a folder on which SGLang's older (top-level rope_theta, default 10000) and
newer (rope_parameters) readers disagree is an error.

For the reference EAGLE, (target, kind) pairs its code cannot serve (Qwen2 EAGLE-3, Qwen3's head_dim)
must be refused by the exporter, and the emulator shows why on the SGLang layout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def _by_path(name: str):
    key = f"selfdraft_tests_engines_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, _HERE / f"{name}.py")
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


SGLANG = _by_path("sglang_emulator")
REFERENCE = _by_path("eagle_reference_emulator")
EngineLoadError = SGLANG.EngineLoadError

# Which exporter writes the folder each emulated engine reads (export_eagle's ``engine``).
EXPORT_ENGINE = {"sglang": "sglang", "eagle": "eagle-reference"}
CHAIN = (3, 1, 4)  # depth, topk, num_draft_tokens (= draft nodes + 1)
TREE2 = (2, 2, 5)
TREE3 = (3, 2, 6)
EXTENSIONS = (0, 3, 6)
TINY_VOCAB, TINY_DRAFT_VOCAB = 128, 48


# --- targets --------------------------------------------------------------------------------------------

def _tiny(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0, max_position_embeddings=256)
    torch.manual_seed({"llama": 10, "qwen2": 11, "qwen3": 12}[family])
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


class Case:
    """A target, its identity, a prompt, and the prompt's greedy continuation."""

    def __init__(self, name, model, prompt, tokenizer=None, identity=None):
        from selfdraft.heads.target import TargetIdentity

        self.name, self.model, self.prompt, self.tokenizer = name, model, list(prompt), tokenizer
        text = model.config.get_text_config()
        self.identity = identity or TargetIdentity(f"tiny-{name}", type(model).__name__, text.vocab_size,
                                                   text.hidden_size, text.num_hidden_layers, "")
        with torch.inference_mode():
            out = model.generate(torch.tensor([self.prompt]), do_sample=False, max_new_tokens=max(EXTENSIONS),
                                 pad_token_id=0, attention_mask=torch.ones(1, len(self.prompt), dtype=torch.long))
        self.continuation = out[0, len(self.prompt):].tolist()

    def prompts(self):
        return [self.prompt + self.continuation[:n] for n in EXTENSIONS]


_CASES: dict[str, Case] = {}


def _case(name: str, request) -> Case:
    if name not in _CASES:
        if name == "smollm2":
            from selfdraft.inference.api import encode_prompt

            target = request.getfixturevalue("embedded_fp32")
            text = "Here is a short list of the three longest rivers in Europe, with their lengths:"
            prompt = encode_prompt(target.tokenizer, text, False)
            _CASES[name] = Case(name, target.model, prompt, target.tokenizer, target.identity)
        else:
            _CASES[name] = Case(name, _tiny(name), [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26])
    return _CASES[name]


# --- drafters ---------------------------------------------------------------------------------------------

def _perturbed_drafter(model, kind: str, aux_layers=None):
    from selfdraft.heads.kinds.eagle import new_drafter

    torch.manual_seed(7)
    drafter = new_drafter(model, kind, draft_vocab_size=TINY_DRAFT_VOCAB, aux_layers=aux_layers)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if kind == "eagle3":
        drafter.set_vocab_map(torch.randperm(TINY_VOCAB)[:TINY_DRAFT_VOCAB])
    return drafter.eval()


def _trained_drafter(case: Case, kind: str):
    """Three AdamW steps of our EAGLE objective (KL to the target's own distributions) on one short
    question and answer (any text serves: the labels are the target's)."""
    import numpy as np

    from selfdraft.configs.run import DrafterConfig, RunConfig, TrainConfig
    from selfdraft.heads.kinds.eagle.config import EagleConfig
    from selfdraft.inference.api import encode_prompt
    from selfdraft.train.objectives import build_objective

    prompt = encode_prompt(case.tokenizer, "Why is the sky blue?", False)
    answer = case.tokenizer(" Sunlight is scattered by the air, and blue light is scattered the most.",
                            add_special_tokens=False)["input_ids"]
    ids = torch.tensor(prompt + list(answer))
    loss_mask = torch.zeros_like(ids)
    loss_mask[len(prompt):] = 1
    run = RunConfig(drafter=DrafterConfig(kind=kind, eagle=EagleConfig(draft_vocab_size=2048, ttt_steps=2)),
                    train=TrainConfig(top_k=4, seed=0))
    objective = build_objective(run, case.model, [(ids.numpy(), loss_mask.numpy().astype(np.int64))])
    optimizer = torch.optim.AdamW([p for p in objective.drafter.parameters() if p.requires_grad], lr=3e-4)
    objective.train()
    for _ in range(3):
        loss, _ = objective(ids[None], torch.ones_like(ids)[None], loss_mask[None])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return objective.drafter.eval()


_DRAFTERS: dict = {}


def _drafter(case: Case, kind: str, aux_layers=None):
    key = (case.name, kind, tuple(aux_layers or ()))
    if key not in _DRAFTERS:
        if case.name == "smollm2":
            _DRAFTERS[key] = _trained_drafter(case, kind)
        else:
            _DRAFTERS[key] = _perturbed_drafter(case.model, kind, aux_layers)
    return _DRAFTERS[key]


def _export(drafter, folder: Path, engine: str, case: Case) -> Path:
    from selfdraft.heads.kinds.eagle.layouts import export_eagle

    embed = case.model.get_input_embeddings().weight.detach()
    out = export_eagle(drafter, folder, engine=EXPORT_ENGINE[engine], target=case.identity, embed_weight=embed)
    return Path(out) if out is not None else folder


# --- our side ---------------------------------------------------------------------------------------------

def our_trees(drafter, model, prompt, trees) -> list[set[tuple[int, ...]]]:
    """EagleTreeDrafter's tree (as root-to-node paths) for each (depth, topk, num_draft_tokens) in
    ``trees`` after one prefill of ``prompt`` (root: the target's greedy token)."""
    from selfdraft.configs.decode import TreeConfig
    from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
    from selfdraft.inference.session import CausalLMSession

    results, out = [], None
    for depth, topk, n in trees:
        adapter = EagleTreeDrafter(drafter, model, TreeConfig(depth=depth, top_k=topk, max_nodes=n - 1))
        if out is None:
            out = CausalLMSession(model, hidden_layers=adapter.hidden_layers).prefill(prompt)
        tree, _ = adapter.propose(adapter.start(prompt, out), list(prompt) + [int(out.logits[-1].argmax())])
        results.append(set(SGLANG.C.paths_from_parents(tree.tokens.tolist(), tree.parents.tolist())))
    return results


def assert_same_trees(emulator_for, drafter, case: Case, trees):
    """``emulator_for(tree)``: the loaded emulator that drafts ``tree`` = (depth, topk, num_draft_tokens)."""
    for prompt in case.prompts():
        for (depth, topk, n), ours in zip(trees, our_trees(drafter, case.model, prompt, trees)):
            theirs = emulator_for((depth, topk, n)).propose(prompt, depth, topk, n)
            assert len(theirs) == n - 1
            assert set(theirs) == ours, (
                f"{case.name}: tree depth={depth} topk={topk} nodes={n - 1} after {len(prompt) - len(case.prompt)} "
                f"greedy tokens: the engine drafts {sorted(theirs)}, our drafter {sorted(ours)}")


# --- the tests --------------------------------------------------------------------------------------------

TARGETS = [pytest.param("smollm2", marks=pytest.mark.embedded), "llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("target", TARGETS)
def test_sglang_drafts_what_we_draft(target, kind, tmp_path, request):
    case = _case(target, request)
    drafter = _drafter(case, kind)
    folder = _export(drafter, tmp_path / "export", "sglang", case)
    loaded = SGLANG.load(folder, case.model)
    assert loaded.kind == kind
    assert loaded.ignored == (), f"SGLang's load_weights would silently drop {list(loaded.ignored)}"
    tree_attention = SGLANG.load(folder, case.model, draft_attention="ancestors")
    assert_same_trees(lambda tree: tree_attention if tree == TREE3 else loaded, drafter, case, [CHAIN, TREE2, TREE3])


def test_sglang_reads_non_default_aux_layers(tmp_path, request):
    """hidden_states indices (1, 3, 6) of an 8-layer target: SGLang must be told ids (0, 2, 5)."""
    case = _case("llama", request)
    drafter = _drafter(case, "eagle3", aux_layers=[1, 3, 6])
    folder = _export(drafter, tmp_path / "export", "sglang", case)
    loaded = SGLANG.load(folder, case.model)
    assert loaded.capture == [1, 3, 6]
    assert_same_trees(lambda tree: loaded, drafter, case, [CHAIN, TREE2])


REFERENCE_REFUSES = {  # (target, kind) -> why the reference code cannot run it (the emulator's words)
    ("qwen2", "eagle3"): "collects no EAGLE-3 hidden states",
    ("qwen3", "eagle3"): "size mismatch",  # head_dim = hidden // heads there; Qwen3's is twice that
    ("qwen3", "eagle"): "size mismatch",
}


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("target", TARGETS)
def test_reference_eagle_drafts_what_we_draft(target, kind, tmp_path, request):
    from selfdraft.errors import SelfdraftError

    case = _case(target, request)
    drafter = _drafter(case, kind)
    if (target, kind) in REFERENCE_REFUSES:
        # The exporter refuses (nothing written), and rightly: the engine cannot load the layout it
        # would have to take, the one written for SGLang.
        with pytest.raises(SelfdraftError):
            _export(drafter, tmp_path / "export", "eagle", case)
        assert not (tmp_path / "export" / "config.json").exists()
        folder = _export(drafter, tmp_path / "for-sglang", "sglang", case)
        with pytest.raises(EngineLoadError, match=REFERENCE_REFUSES[target, kind]):
            REFERENCE.load(folder, case.model)
        return
    folder = _export(drafter, tmp_path / "export", "eagle", case)
    loaded = REFERENCE.load(folder, case.model)
    assert loaded.kind == kind
    dropped = [n for n in loaded.ignored if n.startswith(("midlayer.", "layers.", "fc.", "norm."))]
    assert not dropped, f"the reference EAGLE would ignore the trained {dropped}"
    assert_same_trees(lambda tree: loaded, drafter, case, [CHAIN, TREE3])
