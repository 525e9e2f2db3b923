"""Serving-engine layouts: vLLM MedusaModel export/import and FasterDecoding import, round-tripped."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.medusa.formats import export_vllm_medusa, import_fasterdecoding_medusa, import_vllm_medusa
from selfdraft.heads.kinds.medusa.module import MedusaHeads

D, V = 48, 101


def heads_with_weights(own_lm_head, num_heads=3, num_layers=2):
    torch.manual_seed(1)
    heads = MedusaHeads(D, V, num_heads, num_layers, own_lm_head=own_lm_head)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return heads


def test_vllm_layout_contract_and_round_trip_with_own_heads(tmp_path):
    heads = heads_with_weights(own_lm_head=True)
    folder = export_vllm_medusa(heads, tmp_path / "vllm")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (3, 2, D, V)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is False
    tensors = load_file(str(folder / "model.safetensors"))
    expected = {f"blocks.{h}.layers.{l}.{k}": (D, D) if k == "weight" else (D,) for h in range(3) for l in range(2) for k in ("weight", "bias")}
    expected |= {f"lm_heads.{h}.weight": (V, D) for h in range(3)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    back, shared = import_vllm_medusa(folder)
    assert shared is None
    hidden = torch.randn(4, D)
    assert torch.equal(back(hidden), heads(hidden))


def test_vllm_layout_with_the_targets_lm_head(tmp_path):
    heads = heads_with_weights(own_lm_head=False)
    lm_head = torch.nn.Linear(D, V, bias=False)
    with pytest.raises(SelfdraftError, match="share the target's LM head"):
        export_vllm_medusa(heads, tmp_path / "x")
    folder = export_vllm_medusa(heads, tmp_path / "vllm", lm_head.weight)
    assert json.loads((folder / "config.json").read_text())["original_lm_head"] is True
    assert "lm_head.weight" in load_file(str(folder / "model.safetensors"))
    back, shared = import_vllm_medusa(folder)
    assert torch.equal(shared, lm_head.weight.detach())
    hidden = torch.randn(4, D)
    assert torch.equal(back(hidden, lm_head), heads(hidden, lm_head))


def test_vllm_default_without_bias_imports_as_zero_bias(tmp_path):
    heads = heads_with_weights(own_lm_head=True, num_heads=2, num_layers=1)
    folder = export_vllm_medusa(heads, tmp_path / "vllm")
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.endswith(".bias")}
    save_file({"medusa_heads." + k: v for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    del config["medusa_fc_bias"]
    (folder / "config.json").write_text(json.dumps(config))
    back, _ = import_vllm_medusa(folder)
    assert all(torch.count_nonzero(p) == 0 for n, p in back.named_parameters() if n.endswith(".bias"))


def test_fasterdecoding_layout_imports(tmp_path):
    heads = heads_with_weights(own_lm_head=True)
    # The original layout: medusa_head.{h} = Sequential(ResBlock x L, Linear(D, V, bias=False)).
    tensors = {}
    for h in range(3):
        for l in range(2):
            tensors[f"{h}.{l}.linear.weight"] = heads.blocks[h][l].linear.weight.detach()
            tensors[f"{h}.{l}.linear.bias"] = heads.blocks[h][l].linear.bias.detach()
        tensors[f"{h}.2.weight"] = heads.lm_heads[h].weight.detach()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "x"}))
    back = import_fasterdecoding_medusa(tmp_path)
    hidden = torch.randn(4, D)
    assert torch.equal(back(hidden), heads(hidden))


def test_bad_foreign_folders_are_clear(tmp_path):
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"pickle")
    with pytest.raises(SelfdraftError, match="never unpickles"):
        import_fasterdecoding_medusa(tmp_path)
    folder = export_vllm_medusa(heads_with_weights(own_lm_head=True), tmp_path / "vllm")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_heads": 4}))
    with pytest.raises(SelfdraftError, match="do not form the Medusa heads"):
        import_vllm_medusa(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(SelfdraftError, match="truncated or corrupt"):
        import_vllm_medusa(folder)
