"""The native drafter format: round trip, strict loading, clear errors, atomic writes."""

import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.heads.io import DrafterRecord, load_drafter, save_drafter
from selfdraft.heads.kinds.medusa.module import MedusaHeads
from selfdraft.heads.target import Target, TargetIdentity
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.specs import make_drafter
from selfdraft.inference.session import CausalLMSession

IDENTITY = TargetIdentity("tiny", "LlamaForCausalLM", 97, 64, 2, "abc123")


def trained_looking_heads(own_lm_head):
    torch.manual_seed(0)
    heads = MedusaHeads(64, 97, num_heads=3, num_layers=2, own_lm_head=own_lm_head)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return heads


def export(tmp_path, heads, **changes):
    record = DrafterRecord("medusa", heads.dims, IDENTITY, decode={"choices": [[0], [1], [0, 0]]}, run_config={"lr": 1e-3})
    return save_drafter(tmp_path / "medusa", heads, dataclasses.replace(record, **changes))


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_round_trip_gives_identical_logits(tmp_path, own_lm_head):
    heads = trained_looking_heads(own_lm_head)
    folder = export(tmp_path, heads)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"
    loaded, record = load_drafter(folder, IDENTITY)
    lm_head = torch.nn.Linear(64, 97, bias=False)
    hidden = torch.randn(4, 64)
    assert torch.equal(loaded(hidden, lm_head), heads(hidden, lm_head))
    assert record.decode == {"choices": [[0], [1], [0, 0]]} and record.run_config == {"lr": 1e-3}
    # Exporting again replaces the folder atomically.
    export(tmp_path, heads)
    assert load_drafter(folder)[1].target == IDENTITY


def test_another_target_is_refused_naming_the_field(tmp_path):
    folder = export(tmp_path, trained_looking_heads(False))
    other = dataclasses.replace(IDENTITY, name="big", hidden_size=896, tokenizer_hash="fff000")
    with pytest.raises(SelfdraftError, match="hidden_size: 896 here, 64 in the drafter.*tokenizer_hash"):
        load_drafter(folder, other)


def test_truncated_and_corrupt_weights_are_clear(tmp_path):
    folder = export(tmp_path, trained_looking_heads(False))
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(SelfdraftError, match="truncated or corrupt"):
        load_drafter(folder)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(SelfdraftError, match="truncated or corrupt"):
        load_drafter(folder)


def test_config_problems_are_named(tmp_path):
    folder = export(tmp_path, trained_looking_heads(False))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for broken, message in [
        ({k: v for k, v in config.items() if k != "decode"}, r"missing fields \['decode'\]"),
        ({**config, "extra": 1}, r"unknown fields \['extra'\]"),
        ({**config, "format_version": 99}, "format version 99"),
        ({**config, "kind": "hydra"}, "unknown drafter kind 'hydra'"),
        ({**config, "dims": {**config["dims"], "num_heads": 4}}, "does not match a medusa drafter"),
        ({**config, "target": {k: v for k, v in config["target"].items() if k != "vocab_size"}}, "missing keys"),
    ]:
        config_path.write_text(json.dumps(broken))
        with pytest.raises(SelfdraftError, match=message):
            load_drafter(folder)
    config_path.write_text("{not json")
    with pytest.raises(SelfdraftError, match="not valid JSON"):
        load_drafter(folder)


def test_an_exported_folder_decodes_through_make_drafter(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )).eval()
    model.generation_config.eos_token_id = None
    target = Target(model=model, tokenizer=None, identity=IDENTITY)
    folder = export(tmp_path, trained_looking_heads(False))
    drafter = make_drafter(str(folder), target)
    assert drafter.name == "medusa" and drafter.choices == [(0,), (1,), (0, 0)]
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)[0, len(prompt):].tolist()
    out = speculative_decode(CausalLMSession(model, drafter.hidden_layers), prompt, drafter, DecodeConfig(max_new_tokens=32))
    assert out.token_ids == ref
