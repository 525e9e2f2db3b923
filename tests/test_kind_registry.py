"""The registry of drafter kinds: a kind declared at run time, in this file alone, trains through the
one loop, exports (native, its own engine layout, from a finished run and from a checkpoint without
loading the target) and decodes greedy-exactly, with no other file of selfdraft touched. That is what
"a new kind is one folder" means. Also: unknown kinds, formats and folders name what exists."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from selfdraft.configs.run import load_run_config
from selfdraft.errors import SelfdraftError
from selfdraft.heads.folders import load_strict, read_folder, write_folder
from selfdraft.heads.kinds import (Dims, DrafterKind, EngineReader, EngineWriter, get_kind, register, registered,
                                   unregister)
from selfdraft.inference.drafters import Drafter, Verified
from selfdraft.inference.tree import DraftTree
from selfdraft.train.objectives import DrafterObjective

# --- the toy kind: one residual layer on the target's final state, predicting the token after next ----


@dataclass(frozen=True)
class ToyDims(Dims):
    hidden_size: int
    vocab_size: int


class ToyHead(nn.Module):
    def __init__(self, dims: ToyDims):
        super().__init__()
        self.dims = dims
        self.proj = nn.Linear(dims.hidden_size, dims.hidden_size)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., H)
        return hidden + self.proj(hidden)


class ToyObjective(DrafterObjective):
    def __init__(self, run, target_model, train_data=None):
        super().__init__()
        text = target_model.config.get_text_config()
        target_model.requires_grad_(False)
        self.target = target_model
        torch.manual_seed(run.train.seed)
        self.head = ToyHead(ToyDims(text.hidden_size, text.vocab_size))
        self.feature_layers = [text.num_hidden_layers]

    def drafter_module(self, state=None):
        if state is None:
            return self.head
        head = ToyHead(self.head.dims)
        head.load_state_dict({k[len("head."):]: v for k, v in state.items() if k.startswith("head.")})
        return head

    def decode_defaults(self, rank_accuracy):
        return {}

    def predicted_tau(self, rank_accuracy):
        return 1.0 + float(rank_accuracy[0, 0])

    def forward(self, input_ids, attention_mask, loss_mask, features=None, position_ids=None):
        from selfdraft.train.features import target_features

        if features is None:
            features = target_features(self.target, input_ids, attention_mask, self.feature_layers, position_ids)
        sel = (loss_mask.bool() & attention_mask.bool())[:, 2:]  # (B, T-2): token t+2 is an assistant token
        h = self.head(features[:, :-2, -1][sel])  # (M, H)
        logits = self.target.get_output_embeddings()(h).float()  # (M, V)
        labels = input_ids[:, 2:][sel]
        n = float(len(labels))
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum") / max(n, 1.0)
        hits = (logits.argmax(-1) == labels).sum().float() if n else torch.zeros(())
        stats = {"head_loss": (loss.detach() * n).reshape(1), "head_tokens": torch.tensor([n]),
                 "top1": hits.reshape(1), "topk": hits.reshape(1), "rank_hits": hits.reshape(1, 1)}
        return loss + 0.0 * sum(p.sum() for p in self.head.parameters()), stats


class ToyDrafter(Drafter):
    name = "toy"

    def __init__(self, head: ToyHead, target):
        self.head, self.lm_head = head.eval(), target.model.get_output_embeddings()
        self.hidden_layers = (target.model.config.get_text_config().num_hidden_layers,)

    def start(self, prompt_ids, prefill):
        return prefill.hidden[0][-1]

    @torch.inference_mode()
    def propose(self, hidden, sequence):
        return DraftTree.chain([int(self.lm_head(self.head(hidden)).argmax())]), hidden

    def observe(self, hidden, verified: Verified):
        return verified.hidden[0][-1]


def toy_adapter(head, decode, target, tree):
    return ToyDrafter(head, target)


def _write_toy_engine(head: ToyHead, ctx):
    config = {"architectures": ["ToyHead"], "hidden_size": head.dims.hidden_size, "vocab_size": head.dims.vocab_size}
    folder = write_folder(ctx.out, "toy.safetensors", head.state_dict(), config)
    return folder, f"wrote the toy drafter for the toy engine to {folder}"


def _read_toy_engine(folder: pathlib.Path, target):
    config, tensors = read_folder(folder, "toy.safetensors")
    head = ToyHead(ToyDims(config["hidden_size"], config["vocab_size"]))
    load_strict(head, tensors, f"{folder}: not a toy head")
    return head, {}


TOY = DrafterKind(
    name="toy", title="Toy", dims=ToyDims, build=ToyHead,
    feature_layers=lambda config, num_layers: [num_layers],
    objective=f"{__name__}:ToyObjective", adapter=f"{__name__}:toy_adapter",
    writers=(EngineWriter("toy-engine", "the toy engine", _write_toy_engine),),
    readers=(EngineReader("toy engine", lambda folder, config: config.get("architectures") == ["ToyHead"], _read_toy_engine),),
)


@pytest.fixture
def toy_kind():
    register(TOY)
    yield TOY
    unregister(TOY.name)


def toy_config(tiny_target, out, *overrides):
    return load_run_config("smoke_cpu", [
        f"target.spec={tiny_target}", f"train.output_dir={out}", "drafter.kind=toy", "data.max_conversations=24",
        "data.max_length=64", "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1",
        "train.max_steps=3", "train.eval_every=0", "train.eval_batches=2", "train.save_every=1", "train.lr=1e-2",
        *overrides])


def greedy_reference(target, ids, n):
    return target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n, pad_token_id=0)[0, len(ids):].tolist()


@pytest.mark.slow
def test_a_kind_registered_at_run_time_trains_exports_and_decodes_exactly(toy_kind, tiny_target, tmp_path, monkeypatch):
    from selfdraft.heads.io import load_drafter, read_record
    from selfdraft.heads.target import load_target
    from selfdraft.inference.api import generate
    from selfdraft.train import checkpoint as ckpt
    from selfdraft.train.export import export
    from selfdraft.train.loop import train

    # Train it with the one loop, twice: to the end, and interrupted after two steps.
    result = train(toy_config(tiny_target, tmp_path / "run"))
    head, record = load_drafter(result.drafter_dir)
    assert record.kind == "toy" and isinstance(record.dims, ToyDims) and isinstance(head, ToyHead)
    assert head.proj.weight.abs().sum() > 0, "training changed nothing"
    train(toy_config(tiny_target, tmp_path / "cut"), stop_after=2)
    latest = ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert json.loads((latest / "state.json").read_text())["drafter"]["kind"] == "toy"

    # Export: from the finished run, and from the checkpoint with the target out of reach.
    engine, message = export(result.output_dir, "toy-engine", tmp_path / "engine")
    assert "toy engine" in message and json.loads((engine / "config.json").read_text())["architectures"] == ["ToyHead"]

    def no_target(*args, **kwargs):
        raise AssertionError("export loaded the target")

    monkeypatch.setattr("selfdraft.heads.target.load_target", no_target)
    native, _ = export(tmp_path / "cut", "native", tmp_path / "from-checkpoint")
    monkeypatch.undo()
    assert read_record(native).kind == "toy"
    with pytest.raises(SelfdraftError, match="Toy drafters export as native, toy-engine, not 'vllm'"):
        export(result.drafter_dir, "vllm", tmp_path / "vllm")

    # Decode: the native folder and the engine folder, each greedy-exact against the target's generate().
    target = load_target(str(tiny_target))
    ids = target.tokenizer("The quick brown fox", add_special_tokens=True)["input_ids"]
    reference = greedy_reference(target, ids, 24)
    for folder in (result.drafter_dir, engine, native):
        out = generate(target, input_ids=ids, drafter=str(folder), max_new_tokens=24, stop_on_eos=False)
        assert out.token_ids == reference and out.drafter == "toy"
        assert out.draft_nodes_per_step > 0.5  # it drafted (one node a step) and the output stayed the target's


def test_unknown_kinds_and_formats_name_the_ones_that_exist(tmp_path):
    from selfdraft.train.export import export

    with pytest.raises(SelfdraftError, match=r"unknown drafter kind 'nope'; known kinds: dflash, dspark, eagle, eagle3, medusa"):
        get_kind("nope")
    assert {"medusa", "eagle", "eagle3"} <= set(registered())
    with pytest.raises(SelfdraftError, match=r"unknown export format 'engine-x'; choose one of native, vllm, sglang, eagle-reference"):
        export(tmp_path, "engine-x", tmp_path / "out")
    with pytest.raises(SelfdraftError, match="already registered"):
        register(DrafterKind(name="medusa", title="x", dims=ToyDims, build=ToyHead, feature_layers=lambda c, n: [n],
                             objective="x:y", adapter="x:y"))


def test_a_run_of_an_unknown_kind_is_refused_before_anything_runs(tiny_target, tmp_path):
    from selfdraft.train.loop import train

    with pytest.raises(SelfdraftError, match="unknown drafter kind 'nope'; known kinds: dflash, dspark, eagle, eagle3, medusa"):
        train(toy_config(tiny_target, tmp_path / "run", "drafter.kind=nope"))
    assert not (tmp_path / "run").exists()


class _Fixed:
    """A toy untrained drafter for the spec registry test: always drafts the chain ARGUMENT's digits."""

    @classmethod
    def from_spec(cls, argument, target, options):
        from selfdraft.inference.drafters import Drafter
        from selfdraft.inference.tree import DraftTree

        class Chain(Drafter):
            name = f"digits:{argument}"
            max_nodes = len(argument)

            def propose(self, state, sequence):
                return DraftTree.chain([int(c) for c in argument]), state

        return Chain()


def test_a_drafter_that_needs_no_training_is_found_by_its_registry_entry():
    """make_drafter finds the untrained drafters the way trained kinds are found: by their registry entry
    (one added at run time included), never by a name written in make_drafter; an unknown spec names
    every registered one; the CLI's help lists them without importing torch."""
    import subprocess
    import sys

    from selfdraft.inference import drafter_specs
    from selfdraft.inference.drafter_specs import DrafterSpec, register_spec
    from selfdraft.inference.specs import make_drafter

    entry = register_spec(DrafterSpec("digits", "drafts the digits of its argument", f"{__name__}:_Fixed.from_spec",
                                      argument="DIGITS"))
    try:
        drafter = make_drafter("digits:123", None)
        assert drafter.name == "digits:123" and drafter.propose(None, [1])[0].token_ids == (1, 2, 3)
        assert make_drafter("none", None).max_nodes == 0 and make_drafter("copy", None).name == "copy"
        with pytest.raises(SelfdraftError, match="unknown drafter 'digits'.*none, prompt-lookup, copy, "
                                                 "draft-model:SPEC, hybrid:SPEC, digits:DIGITS, PATH"):
            make_drafter("digits", None)
        with pytest.raises(SelfdraftError, match="a drafter named 'digits' is already registered"):
            register_spec(DrafterSpec("digits", "another", "x:y"))
    finally:
        drafter_specs._SPECS.pop(entry.name)
    code = ("import sys; from selfdraft.cli import build_parser; build_parser(); "
            "print(any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    source = open(make_drafter.__code__.co_filename, encoding="utf-8").read()
    assert not any(f'"{e.name}"' in source for e in drafter_specs.drafter_specs()), "make_drafter names a drafter"
