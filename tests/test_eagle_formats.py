"""EAGLE export layouts (vLLM / SGLang): a written tensor contract, round-trip logits, clear errors."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.errors import SelfdraftError
from selfdraft.heads.eagle import EagleDrafter
from selfdraft.heads.eagle_formats import engine_contract, export_eagle, import_eagle

H, V, DV = 64, 97, 40

# The layouts as vLLM's and SGLang's loaders name them (llama_eagle.py / llama_eagle3.py), for a
# target with hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 97 and a 40-token draft vocabulary.
EAGLE1_CONTRACT = {
    "fc.weight": (H, 2 * H),
    "layers.0.self_attn.q_proj.weight": (H, H), "layers.0.self_attn.k_proj.weight": (32, H),
    "layers.0.self_attn.v_proj.weight": (32, H), "layers.0.self_attn.o_proj.weight": (H, H),
    "layers.0.mlp.gate_proj.weight": (128, H), "layers.0.mlp.up_proj.weight": (128, H),
    "layers.0.mlp.down_proj.weight": (H, 128), "layers.0.post_attention_layernorm.weight": (H,),
}
EAGLE3_CONTRACT = {
    "fc.weight": (H, 3 * H),
    "midlayer.self_attn.q_proj.weight": (H, 2 * H), "midlayer.self_attn.k_proj.weight": (32, 2 * H),
    "midlayer.self_attn.v_proj.weight": (32, 2 * H), "midlayer.self_attn.o_proj.weight": (H, H),
    "midlayer.mlp.gate_proj.weight": (128, H), "midlayer.mlp.up_proj.weight": (128, H),
    "midlayer.mlp.down_proj.weight": (H, 128), "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
    "norm.weight": (H,), "lm_head.weight": (DV, H), "d2t": (DV,), "t2d": (V,),
}


def llama(vocab=V, hidden=H, layers=6):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def trained_like(target, kind):
    torch.manual_seed(1)
    drafter = EagleDrafter(EagleDrafter.dims_for(target, kind, draft_vocab_size=DV))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if kind == "eagle3":
        drafter.set_vocab_map(torch.randperm(V)[:DV])
    return drafter.eval()


@pytest.mark.parametrize("kind,contract", [("eagle", EAGLE1_CONTRACT), ("eagle3", EAGLE3_CONTRACT)])
def test_export_matches_the_engine_contract_and_round_trips(tmp_path, kind, contract):
    from safetensors import safe_open

    target = llama()
    drafter = trained_like(target, kind)
    assert engine_contract(drafter) == contract
    folder = export_eagle(drafter, tmp_path / kind)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == contract
        if kind == "eagle3":
            assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [{"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}[kind]]
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == H and config["vocab_size"] == V
    assert config["num_key_value_heads"] == 2 and ("rope_theta" in config or "rope_parameters" in config)
    if kind == "eagle3":
        assert config["draft_vocab_size"] == DV
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    back = import_eagle(folder, target)
    x = torch.randn(1, 7, H)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        a = drafter.logits(drafter(x, x, pos, None), target.lm_head)
        b = back.logits(back(x, x, pos, None), target.lm_head)
    assert torch.equal(a, b)
    if kind == "eagle3":
        assert torch.equal(back.draft_to_target(), drafter.draft_to_target()) and torch.equal(back.t2d, drafter.t2d)


def test_a_drafter_for_another_target_is_a_clear_error(tmp_path):
    folder = export_eagle(trained_like(llama(), "eagle3"), tmp_path / "e3")
    with pytest.raises(SelfdraftError, match="vocab_size 97; the target has 120"):
        import_eagle(folder, llama(vocab=120))
    with pytest.raises(SelfdraftError, match="hidden_size 64; the target has 32"):
        import_eagle(folder, llama(hidden=32))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SelfdraftError, match="not an EAGLE layout"):
        import_eagle(folder, llama())


def test_an_engine_layout_folder_decodes_exactly_through_make_drafter(tmp_path):
    from selfdraft.configs.decode import DecodeConfig
    from selfdraft.heads.target import Target, TargetIdentity
    from selfdraft.inference.decode import speculative_decode
    from selfdraft.inference.drafters import make_drafter
    from selfdraft.inference.session import CausalLMSession

    target = llama()
    folder = export_eagle(trained_like(target, "eagle3"), tmp_path / "e3")
    wrapped = Target(target, None, TargetIdentity("tiny", "LlamaForCausalLM", V, H, 6, ""))
    drafter = make_drafter(str(folder), wrapped)
    assert drafter.name == "eagle3"
    prompt = [3, 14, 15, 92, 65]
    ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0)[0, 5:].tolist()
    out = speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), prompt, drafter,
                             DecodeConfig(max_new_tokens=24, stop_on_eos=False))
    assert out.token_ids == ref
