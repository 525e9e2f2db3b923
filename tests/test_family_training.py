"""EAGLE-3 and DFlash on targets of other families than Llama, through the one training loop: a sliding-
window target with attention sinks and experts (gpt_oss: sliding and full layers in turn, eager
attention) and a mixture-of-experts one (qwen3_moe). Each run trains a few steps from
``selfdraft train``, with the features of the right target layers (sliding ones among them), resumes
bit for bit, decodes greedily token for token as the target's ``generate()`` (alone and batched), and
exports in vLLM's layout, which decodes the same here. vLLM 0.32 serves both drafters for both families
(their models capture hidden states: heads/vllm_targets.py; tests/engines/test_vllm.py serves them in
vLLM itself); a family it does not (gemma3_text) is refused with the reason. Also: the drafter's own decoder layer of the target's family (``layer:
target``) on sliding, soft-capped and expert layers, and packed training rows on every layer kind.

Tiny random targets over SmolLM2's vocabulary with SmolLM2's tokenizer (conftest.py ``family_folder``,
7 layers: the fewest whose default EAGLE-3 layers (2, L // 2, L - 3) are distinct)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

from selfdraft.configs.run import load_run_config

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import families  # noqa: E402  (tests/families.py, beside this file)

LAYERS = 7
NEW_TOKENS = 24
RUNS = [("gpt_oss", "eagle3"), ("gpt_oss", "dflash"), ("qwen3_moe", "eagle3"), ("qwen3_moe", "dflash")]
EXPECTED_LAYERS = {"eagle3": [2, 3, 4], "dflash": [2, 3, 5]}
"""hidden_states indices each kind fuses on a 7-layer target by default (EAGLE-3: vLLM's (2, L // 2, L - 3);
DFlash: z-lab's spread); index i is the output of decoder layer i - 1."""


def run_overrides(folder, kind: str, out) -> tuple[str, list[str]]:
    preset = "smoke_eagle3" if kind == "eagle3" else "smoke_cpu"
    common = [f"target.spec={folder}", f"train.output_dir={out}", "data.max_conversations=24", "data.max_length=64",
              "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1", "train.max_steps=4",
              "train.eval_every=2", "train.eval_batches=1", "train.save_every=2", "train.log_every=1", "train.lr=3e-3",
              "train.mixed_precision=no"]
    if kind == "eagle3":
        return preset, [*common, "drafter.eagle.draft_vocab_size=512", "drafter.tree.max_nodes=4"]
    return preset, [*common, "drafter.kind=dflash", "drafter.block.block_size=4", "drafter.block.anchors=8",
                    "drafter.block.draft_vocab_size=512"]


def references(target, n: int = 2) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (tokenized by the target folder's own tokenizer) and the target's greedy continuations."""
    texts = ["The quick brown fox jumps over the lazy dog, and then the dog", "def fibonacci(n):"][:n]
    prompts = [target.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return prompts, outs


def decodes_exactly(target, drafter, prompts, refs) -> None:
    from selfdraft.inference.api import generate, generate_batch

    for ids, ref in zip(prompts, refs):
        out = generate(target, input_ids=ids, drafter=drafter, max_new_tokens=NEW_TOKENS, stop_on_eos=False,
                       policy="fixed")
        assert out.token_ids == ref, f"{drafter} at batch 1"
    outs = generate_batch(target, input_ids=prompts, drafter=drafter, max_new_tokens=NEW_TOKENS, stop_on_eos=False,
                          policy="fixed")
    assert [o.token_ids for o in outs] == refs, f"{drafter} batched"


@pytest.mark.slow
@pytest.mark.parametrize("family,kind", RUNS)
def test_a_drafter_for_the_family_trains_resumes_decodes_exactly_and_exports_for_vllm(family, kind, family_folder, tmp_path,
                                                                                         capsys):
    from safetensors.torch import load_file

    from selfdraft.cli import main
    from selfdraft.heads.io import load_drafter
    from selfdraft.heads.target import load_target
    from selfdraft.train.features import feature_layers
    from selfdraft.train.loop import train

    folder = family_folder(family, LAYERS)
    preset, overrides = run_overrides(folder, kind, tmp_path / "full")
    assert main(["train", "--config", preset, *overrides]) == 0, capsys.readouterr().err[-2000:]
    drafter_dir = tmp_path / "full" / "drafter"

    # The features of the right layers: the run's hidden_states indices, the final normed state last; on
    # gpt_oss they take sliding-window layers' outputs as well as full ones.
    config = load_run_config(preset, overrides)
    layers = feature_layers(config, LAYERS)
    assert layers == [*EXPECTED_LAYERS[kind], LAYERS]
    module, record = load_drafter(drafter_dir)
    assert record.kind == kind and record.target.num_layers == LAYERS
    fused = list(module.aux_layers) if kind == "eagle3" else list(record.dims.target_layers)
    assert fused == EXPECTED_LAYERS[kind]
    text = families.tiny_config(family, vocab_size=49152, num_layers=LAYERS)
    kinds = {text.layer_types[i - 1] for i in fused} if getattr(text, "layer_types", None) else {"full_attention"}
    assert kinds == ({"sliding_attention", "full_attention"} if family == "gpt_oss" else {"full_attention"})

    # Interrupted after 2 of 4 steps and resumed: the same drafter, bit for bit.
    _, cut = run_overrides(folder, kind, tmp_path / "cut")
    train(load_run_config(preset, cut), stop_after=2)
    resumed = train(load_run_config(preset, cut), resume=True)
    a, b = load_file(drafter_dir / "model.safetensors"), load_file(resumed.drafter_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resume did not continue bit for bit"

    target = load_target(str(folder))
    prompts, refs = references(target)
    decodes_exactly(target, str(drafter_dir), prompts, refs)

    # vLLM's layout, from the run folder; it reads back and decodes the same here.
    capsys.readouterr()
    assert main(["export", str(tmp_path / "full"), "--format", "vllm", "--out", str(tmp_path / "vllm")]) == 0, \
        capsys.readouterr().err[-2000:]
    engine = json.loads((tmp_path / "vllm" / "config.json").read_text())
    if kind == "eagle3":
        assert engine["architectures"] == ["LlamaForCausalLMEagle3"] and engine["hidden_act"] == "silu"
        assert engine["eagle_aux_hidden_state_layer_ids"] == EXPECTED_LAYERS[kind]
    else:
        assert engine["architectures"] == ["DFlashDraftModel"]
        assert engine["dflash_config"]["target_layer_ids"] == [i - 1 for i in EXPECTED_LAYERS[kind]]
    decodes_exactly(target, str(tmp_path / "vllm"), prompts[:1], refs[:1])


@pytest.mark.slow
def test_vllm_layouts_for_a_family_vllm_does_not_capture_are_refused_with_the_reason(family_folder, tmp_path, capsys):
    """gemma3_text (five sliding layers to one full): trains, decodes exactly, and vLLM's layouts are refused
    (its Gemma 3 model captures no hidden states), nothing written; SGLang's EAGLE-3 layout is refused too."""
    from selfdraft.cli import main
    from selfdraft.heads.target import load_target

    folder = family_folder("gemma3_text", LAYERS)
    preset, overrides = run_overrides(folder, "eagle3", tmp_path / "run")
    assert main(["train", "--config", preset, *overrides, "train.max_steps=2", "train.eval_every=0"]) == 0
    target = load_target(str(folder))
    prompts, refs = references(target, 1)
    decodes_exactly(target, str(tmp_path / "run" / "drafter"), prompts, refs)
    capsys.readouterr()
    for fmt in ("vllm", "speculators", "sglang"):
        assert main(["export", str(tmp_path / "run"), "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err
        assert "not Gemma3ForCausalLM" in err and "Traceback" not in err, err
        assert not (tmp_path / fmt).exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma2", "gemma3_text", "qwen3_moe", "qwen3_next"])
def test_the_targets_own_layer_as_draft_layer_on_sliding_soft_capped_and_expert_layers(family):
    """``drafter.eagle.layer=target``: the family's own decoder layer, made a full-attention one (a draft
    layer sees its whole context), with its family's attention backend (eager for soft-capping and sinks,
    which then gets explicit causal masks) and experts; an untrained drafter of it decodes exactly."""
    from selfdraft.configs.decode import DecodeConfig, TreeConfig
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
    from selfdraft.heads.target_layers import attention_backend
    from selfdraft.inference.decode import speculative_decode
    from selfdraft.inference.session import CausalLMSession

    target = families.tiny_model(family, vocab_size=512, num_layers=LAYERS)
    target.generation_config.eos_token_id = target.generation_config.forced_eos_token_id = None
    torch.manual_seed(0)
    head = new_drafter(target, "eagle3", draft_vocab_size=64, layer="target").eval()
    head.set_vocab_map(torch.arange(64) * 7 % 512)
    cfg = head.layer_config
    if getattr(cfg, "layer_types", None) is not None:
        assert cfg.layer_types == ["full_attention"]
    else:
        assert not getattr(cfg, "sliding_window", None)
    assert cfg._attn_implementation == attention_backend(cfg)
    # Causal: the output at a position does not depend on later ones (also where eager takes no mask of its own).
    H = head.hidden_size
    x, e = torch.randn(1, 6, H), torch.randn(1, 6, H)
    with torch.no_grad():
        whole = head(x, e, torch.arange(6)[None], None)
        prefix = head(x[:, :4], e[:, :4], torch.arange(4)[None], None)
    torch.testing.assert_close(whole[:, :4], prefix, rtol=1e-4, atol=1e-5)
    prompt = families.prompt_ids(512)[0].tolist()
    ids = torch.tensor([prompt])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                          min_new_tokens=16)[0, len(prompt):].tolist()
    drafter = EagleTreeDrafter(head, target, TreeConfig(depth=3, top_k=2, max_nodes=6))
    session = CausalLMSession(target, hidden_layers=drafter.hidden_layers)
    out = speculative_decode(session, prompt, drafter, DecodeConfig(max_new_tokens=16, stop_on_eos=False))
    assert out.token_ids == ref


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "gemma2", "gemma3_text", "qwen3_next", "lfm2"])
def test_packed_training_rows_give_each_conversations_own_features(family):
    """The GPU default runs a packed row of conversations as one forward: the target's masks keep each
    conversation to itself in every layer kind (the decoder's masks; GPT-OSS's own read across them), and
    a target with recurrent layers, whose state would carry from one conversation into the next, runs
    each conversation alone."""
    from selfdraft.heads.target_layers import attention_backend
    from selfdraft.train.features import target_features

    config = families.tiny_config(family, vocab_size=512)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=attention_backend(config)).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(10, 500, (20,), generator=g), torch.randint(10, 500, (25,), generator=g)
    ids = torch.cat([a, b, torch.zeros(3, dtype=torch.long)])[None]  # two conversations and padding
    positions = torch.cat([torch.arange(20), torch.arange(25), torch.zeros(3, dtype=torch.long)])[None]
    mask = torch.cat([torch.ones(45, dtype=torch.long), torch.zeros(3, dtype=torch.long)])[None]
    layers = [1, 2, config.get_text_config().num_hidden_layers]
    with torch.no_grad():
        alone = target_features(model, ids, mask, layers, positions, per_conversation=True)
        packed = target_features(model, ids, mask, layers, positions, per_conversation=False)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
