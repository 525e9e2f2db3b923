"""DFlash and DSpark exported for SGLang draft, in an emulation of SGLang (``sglang_block_emulator.py``,
written from SGLang's source: files, commits and behaviours in its docstring), exactly the blocks our own
``BlockDrafter`` drafts; and what SGLang would serve wrongly is refused or caught.

For tiny random transformers targets of three families (an untied Llama, Qwen2 with q/k/v biases, Qwen3
with head_dim * heads = 2 * hidden; 8 layers, vocabulary 128; the draft layers are Qwen3 layers whatever the
target's) and drafters with perturbed random weights (two draft layers, block 4, three fused layers), the
test writes the SGLang layout, loads it through the emulator and compares the block it drafts with ours
after three prompts (the prompt extended by 0, 3 and 6 greedy tokens): the same tokens, and the same
chance of acceptance for each (DSpark's confidence head, by which SGLang sizes verification; without one
the probability of the drafted token), to 1e-4. The chances are what make the comparison bite: a random
drafter's argmax hardly reads the target's features (a shifted layer id leaves the tokens as they were),
its distributions do.

Broken folders (layer ids one off, the Markov head zeroed) and a DFlash drafter over a reduced draft
vocabulary (which SGLang would draft through the target's head) must not pass for ours.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))  # the emulator, and the EAGLE emulator tests, beside this file
import sglang_block_emulator as SGLANG  # noqa: E402
import test_engine_emulators as EMULATORS  # noqa: E402  (the tiny targets and their prompts)

EngineLoadError = SGLANG.EngineLoadError
BLOCK, REDUCED_VOCAB = 4, 48


def _case(family: str):
    return EMULATORS._case(family, None)


def _drafter(case, kind: str, vocab: int | None = None, confidence: bool = True):
    """A perturbed random block drafter for ``case``'s target; ``vocab``: a reduced draft vocabulary;
    ``confidence``: DSpark's confidence head."""
    from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims

    text = case.model.config.get_text_config()
    torch.manual_seed(5)
    extra = {"markov_rank": 8, "confidence_head": confidence} if kind == "dspark" else {}
    dims = (DSparkDims if kind == "dspark" else DFlashDims).shaped_like(
        text, block_size=BLOCK, num_layers=2, draft_vocab_size=vocab or text.vocab_size,
        mask_token_id=text.vocab_size - 1, target_layers=(2, 4, 6), **extra)
    module = BlockHead(dims)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if vocab:
        module.set_vocab_map(torch.randperm(text.vocab_size)[:vocab].sort().values)
    return module.eval()


def _export(module, case, folder: Path) -> Path:
    from selfdraft.heads.io import DrafterRecord
    from selfdraft.heads.kinds import get_kind
    from selfdraft.heads.registry import ExportContext

    record = DrafterRecord(module.dims.KIND_FIELD, module.dims, case.identity)
    context = ExportContext(record=record, out=folder, target_path=f"tiny-{case.name}", load_target=lambda: None)
    out, _ = get_kind(record.kind).writer("sglang").write(module, context)
    return out


def _ours(module, case, sequence: list[int]) -> tuple[list[int], list[float]]:
    """Our drafter's block after ``sequence`` (the last token the anchor): target ids, and each one's chance
    of acceptance given the ones before it."""
    from selfdraft.configs.decode import TreeConfig
    from selfdraft.heads.kinds.block.decode import BlockDrafter
    from selfdraft.inference.session import CausalLMSession

    drafts = module.dims.drafts_per_block
    adapter = BlockDrafter(module, case.model, TreeConfig(depth=drafts, top_k=1, max_nodes=drafts))
    prompt = list(sequence[:-1])
    out = CausalLMSession(case.model, hidden_layers=adapter.hidden_layers).prefill(prompt)
    tree, _ = adapter.propose(adapter.start(prompt, out), list(sequence))
    assert tree.parents.tolist() == list(range(-1, drafts - 1)), "a chain"
    path = list(tree.values)  # the chance of the path to each token: the product of the chances
    return tree.tokens.tolist(), [v / before for v, before in zip(path, [1.0] + path[:-1])]


def _same(theirs, ours) -> bool:
    return theirs[0] == ours[0] and torch.allclose(torch.tensor(theirs[1]), torch.tensor(ours[1]), rtol=1e-4, atol=1e-6)


def _sequences(case) -> list[list[int]]:
    """The prompt extended by 0, 3 and 6 greedy tokens, each with the next greedy token as the anchor."""
    full = case.prompt + case.continuation
    return [full[:len(case.prompt) + n + 1] for n in EMULATORS.EXTENSIONS]


def _differing(emulator, module, case) -> int:
    return sum(not _same(emulator.draft(seq), _ours(module, case, seq)) for seq in _sequences(case))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind, vocab", [("dflash", None), ("dspark", None), ("dspark", REDUCED_VOCAB)],
                         ids=["dflash", "dspark", "dspark-reduced-vocab"])
def test_sglang_drafts_the_block_we_draft(family, kind, vocab, tmp_path):
    case = _case(family)
    module = _drafter(case, kind, vocab)
    folder = _export(module, case, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == BLOCK and "speculators_config" not in config
    loaded = SGLANG.load(folder, case.model)
    assert loaded.kind == kind and loaded.capture == [2, 4, 6]
    assert loaded.ignored == (), f"SGLang would silently drop {list(loaded.ignored)}"
    for sequence in _sequences(case):
        theirs, ours = loaded.draft(sequence), _ours(module, case, sequence)
        assert len(theirs[0]) == module.dims.drafts_per_block
        assert _same(theirs, ours), f"{family} {kind} after {len(sequence)} tokens: SGLang {theirs}, ours {ours}"
    card = (folder / "README.md").read_text()
    algorithm, verified = ("DFLASH", BLOCK) if kind == "dflash" else ("DSPARK", BLOCK + 1)
    assert f"--speculative-algorithm {algorithm} " in card and f"--speculative-num-draft-tokens {verified}" in card


def test_a_dflash_drafter_over_a_reduced_vocabulary_is_refused_for_sglang(tmp_path):
    """SGLang's DFlash keeps no LM head: the exporter refuses and writes nothing; the vLLM layout of the
    same drafter, given to SGLang, loads with its head dropped and drafts something else."""
    from selfdraft.errors import SelfdraftError
    from selfdraft.heads.kinds.block.layouts import _write_vllm
    from selfdraft.heads.io import DrafterRecord
    from selfdraft.heads.registry import ExportContext

    case = _case("llama")
    module = _drafter(case, "dflash", REDUCED_VOCAB)
    with pytest.raises(SelfdraftError, match=r"through the target's own LM head.*draft_vocab_size=128"):
        _export(module, case, tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()
    record = DrafterRecord("dflash", module.dims, case.identity)
    folder, _ = _write_vllm(module, ExportContext(record=record, out=tmp_path / "vllm", target_path="t", load_target=lambda: None))
    loaded = SGLANG.load(folder, case.model)
    assert set(loaded.ignored) == {"d2t", "lm_head.weight"}
    assert _differing(loaded, module, case) == 3


def test_broken_sglang_exports_do_not_pass_for_ours(tmp_path):
    """Layer ids one off (the mistake the conventions invite), a zeroed Markov head, a reduced DSpark
    vocabulary in an SGLang older than 67d00001, a fused layer SGLang never captures."""
    case = _case("qwen3")
    for kind in ("dflash", "dspark"):
        module = _drafter(case, kind)
        folder = _export(module, case, tmp_path / kind)
        config = json.loads((folder / "config.json").read_text())
        ids = config["dflash_config"]["target_layer_ids"]
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in ids]
        if "target_layer_ids" in config:
            config["target_layer_ids"] = [i + 1 for i in ids]
        (folder / "config.json").write_text(json.dumps(config))
        assert _differing(SGLANG.load(folder, case.model), module, case) == 3, f"{kind}: shifted layer ids"
    module = _drafter(case, "dspark", confidence=False)  # its chances: the Markov-biased distribution's
    folder = _export(module, case, tmp_path / "zeroed")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["markov_head.markov_w2.weight"] = torch.zeros_like(tensors["markov_head.markov_w2.weight"])
    save_file(tensors, str(folder / "model.safetensors"))
    assert _differing(SGLANG.load(folder, case.model), module, case) == 3, "the Markov head zeroed"
    reduced = _export(_drafter(case, "dspark", REDUCED_VOCAB), case, tmp_path / "reduced")
    with pytest.raises(EngineLoadError, match="shape mismatch"):
        SGLANG.load(reduced, case.model, reduced_vocab=False)
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 3, 7]  # 7: the last layer's output, after which nothing runs
    (tmp_path / "dflash" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineLoadError, match="feature dim mismatch"):
        SGLANG.load(tmp_path / "dflash", case.model)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_trained_over_the_whole_vocabulary_exported_by_the_cli_sglang_drafts_what_we_draft(kind, tiny_target, tmp_path):
    """The path an SGLang user takes: train through the one loop with drafter.block.draft_vocab_size at
    least the target's vocabulary (the target's own LM head), `selfdraft export --format sglang`; the
    emulated SGLang drafts our decoder's block (a tied 7-layer Llama with the embedded tokenizer)."""
    from selfdraft.cli import main
    from selfdraft.configs.run import load_run_config
    from selfdraft.heads.io import load_drafter
    from selfdraft.heads.target import load_target
    from selfdraft.train.loop import train

    config = load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={tmp_path / 'run'}", f"drafter.kind={kind}",
        "data.max_conversations=16", "data.max_length=64", "train.micro_batch_size=2", "train.max_steps=3",
        "train.eval_batches=0", "drafter.block.block_size=4", "drafter.block.anchors=8",
        "drafter.block.draft_vocab_size=1000000", "drafter.block.markov_rank=8"])
    result = train(config)
    module, record = load_drafter(result.drafter_dir)
    assert not module.own_head  # drafts through the target's LM head
    assert main(["export", str(result.drafter_dir), "--format", "sglang", "--out", str(tmp_path / "sglang")]) == 0
    target = load_target(str(tiny_target), dtype="float32")
    loaded = SGLANG.load(tmp_path / "sglang", target.model)
    assert loaded.ignored == () and loaded.draft_vocab == target.model.config.vocab_size
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog and", add_special_tokens=True)["input_ids"]
    case = EMULATORS.Case("tiny", target.model, ids[:6], identity=target.identity)
    assert _differing(loaded, module.eval(), case) == 0
