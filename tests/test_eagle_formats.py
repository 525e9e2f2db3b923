"""EAGLE engine layouts: what each writer puts where, round trips through our reader, the
conventions the reader tells apart, and the drafters an engine cannot load refused before anything
is written. (That each engine loads and drafts these folders as we do is proven in tests/engines/:
vLLM itself, and emulations of SGLang and the reference EAGLE code.)"""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from selfdraft.errors import SelfdraftError
from selfdraft.heads.kinds.eagle import new_drafter
from selfdraft.heads.kinds.eagle.layouts import ENGINES, export_eagle, folder_aux_layers, import_eagle
from selfdraft.heads.target import TargetIdentity

H, V, DV, L = 64, 97, 40, 8


def llama(vocab=V, hidden=H, layers=L):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0)).eval()


def identity(model):
    text = model.config.get_text_config()
    return TargetIdentity("tiny", model.config.architectures[0] if model.config.architectures else type(model).__name__,
                          text.vocab_size, text.hidden_size, text.num_hidden_layers, "")


def trained_like(target, kind, **dims):
    torch.manual_seed(1)
    drafter = new_drafter(target, kind, draft_vocab_size=DV if kind == "eagle3" else None, **dims)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if kind == "eagle3":
        drafter.set_vocab_map(torch.randperm(V)[:DV])  # a frequency order, not ascending
    return drafter.eval()


def logits_by_target_id(drafter, target, x, pos):
    """(1, T, V) draft logits indexed by target token id (-inf outside the draft vocabulary)."""
    with torch.no_grad():
        out = drafter.logits(drafter(x, x, pos, None), target.lm_head)
    if drafter.dims.KIND_FIELD == "eagle":
        return out
    full = torch.full((*out.shape[:-1], V), float("-inf"))
    full[..., drafter.draft_to_target()] = out
    return full


def tensors_of(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_every_engine_layout_round_trips_exactly(tmp_path, kind, engine):
    target = llama()
    drafter = trained_like(target, kind)
    folder = export_eagle(drafter, tmp_path / engine, engine, identity(target), target.get_input_embeddings().weight)
    config, tensors = json.loads((folder / "config.json").read_text()), tensors_of(folder)
    # What every engine reads: a complete one-layer Llama config, untied, RoPE base in both spellings.
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 50000.0 and config["rope_parameters"]["rope_theta"] == 50000.0 and config["rope_scaling"] is None
    assert config["head_dim"] == 16 and "bias" not in config and config["attention_bias"] is False
    assert ("embed_tokens.weight" in tensors) == (engine == "eagle-reference")
    if kind == "eagle":
        assert config["architectures"] == [{"vllm": "EagleLlamaForCausalLM"}.get(engine, "LlamaForCausalLMEagle")]
        assert ("fc.bias" in tensors) == (engine != "vllm")  # vLLM builds no fc bias, SGLang/reference always do
        assert not any("input_layernorm" in k for k in tensors)
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DV
        ids = tensors["d2t"] + torch.arange(DV)
        assert torch.equal(ids, torch.sort(drafter.draft_to_target()).values)  # ascending target ids
        if engine == "vllm":  # top level, hidden_states indices
            assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
            assert "eagle_aux_hidden_state_layer_ids" not in config["eagle_config"]
        else:  # nested, "output of layer i"
            assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
            assert "eagle_aux_hidden_state_layer_ids" not in config
    back = import_eagle(folder, target)
    assert back.layer_config.rope_parameters["rope_theta"] == 50000.0
    x, pos = torch.randn(1, 7, H), torch.arange(7)[None]
    torch.testing.assert_close(logits_by_target_id(back, target, x, pos), logits_by_target_id(drafter, target, x, pos),
                               rtol=0, atol=1e-6)
    if kind == "eagle3":
        assert back.aux_layers == [2, 4, 5]


def test_aux_layers_in_any_order_are_written_ascending_with_their_fc_columns(tmp_path):
    target = llama()
    drafter = trained_like(target, "eagle3", aux_layers=[6, 1, 3])
    for engine in ("vllm", "sglang"):
        folder = export_eagle(drafter, tmp_path / engine, engine, identity(target))
        back = import_eagle(folder, target)
        assert back.aux_layers == [1, 3, 6]
        fc, fc_back = drafter.fc.weight, back.fc.weight  # column blocks follow their layers
        for i, layer in enumerate([6, 1, 3]):
            j = [1, 3, 6].index(layer)
            assert torch.equal(fc[:, i * H:(i + 1) * H], fc_back[:, j * H:(j + 1) * H])


def test_the_reader_tells_the_engines_conventions_apart():
    assert folder_aux_layers({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}, 30)[0] == [2, 15, 27]
    assert folder_aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, 30)[0] == [2, 15, 27]
    assert folder_aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]},
                              "exported_by": {"engine": "vllm"}}, 30)[0] == [2, 15, 27]
    assert folder_aux_layers({}, 30)[0] == [2, 15, 27]  # SpecForge default [1, L/2-1, L-4] as output ids, same layers


def test_a_published_eagle1_folder_with_a_trained_fc_bias_decodes_with_it(tmp_path):
    """SGLang and the reference EAGLE-1 train fc with a bias: the reader keeps it (and refuses to
    write it for vLLM, whose fc has none)."""
    target = llama()
    drafter = trained_like(target, "eagle", fc_bias=True)
    assert drafter.fc.bias is not None and bool(drafter.fc.bias.any())
    folder = export_eagle(drafter, tmp_path / "sglang", "sglang", identity(target))
    back = import_eagle(folder, target)
    x, pos = torch.randn(1, 5, H), torch.arange(5)[None]
    torch.testing.assert_close(logits_by_target_id(back, target, x, pos), logits_by_target_id(drafter, target, x, pos),
                               rtol=0, atol=1e-6)
    with pytest.raises(SelfdraftError, match="fc has a bias"):
        export_eagle(drafter, tmp_path / "vllm", "vllm", identity(target))
    assert not (tmp_path / "vllm").exists()


def test_drafters_an_engine_cannot_load_are_refused_and_nothing_is_written(tmp_path):
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    own_layer = trained_like(qwen, "eagle3", layer="target")  # Qwen2's layer: q/k/v biases
    for engine in ENGINES:
        with pytest.raises(SelfdraftError, match="drafter.eagle.layer=llama"):
            export_eagle(own_layer, tmp_path / engine, engine, identity(qwen))
        assert not (tmp_path / engine).exists() and not list(tmp_path.glob(f".{engine}*"))
    llama_layer = trained_like(qwen, "eagle3")  # the default: engines load it for Qwen2 targets
    export_eagle(llama_layer, tmp_path / "ok", "sglang", identity(qwen))
    with pytest.raises(SelfdraftError, match="reference EAGLE.*Qwen2ForCausalLM"):  # no EAGLE-3 capture for Qwen2 there
        export_eagle(llama_layer, tmp_path / "ref", "eagle-reference", identity(qwen), qwen.get_input_embeddings().weight)
    target = llama()
    gemma = TargetIdentity("gemma", "Gemma3ForCausalLM", V, H, L, "")
    with pytest.raises(SelfdraftError, match="not Gemma3ForCausalLM"):
        export_eagle(trained_like(target, "eagle3"), tmp_path / "g", "vllm", gemma)
    with pytest.raises(SelfdraftError, match="repeat a layer"):
        export_eagle(trained_like(target, "eagle3", aux_layers=[2, 4, 4]), tmp_path / "r", "vllm", identity(target))
    with pytest.raises(SelfdraftError, match="always fuses hidden_states"):
        export_eagle(trained_like(target, "eagle3", aux_layers=[1, 4, 5]), tmp_path / "r", "eagle-reference", identity(target),
                     target.get_input_embeddings().weight)
    assert not any(p.name.startswith((".g", ".r", "g", "r")) for p in tmp_path.iterdir())


def test_a_drafter_for_another_target_is_a_clear_error(tmp_path):
    target = llama()
    folder = export_eagle(trained_like(target, "eagle3"), tmp_path / "e3", "vllm", identity(target))
    with pytest.raises(SelfdraftError, match="vocab_size 97; the target has 120"):
        import_eagle(folder, llama(vocab=120))
    with pytest.raises(SelfdraftError, match="hidden_size 64; the target has 32"):
        import_eagle(folder, llama(hidden=32))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SelfdraftError, match="not an EAGLE layout"):
        import_eagle(folder, target)


def test_an_engine_layout_folder_decodes_exactly_through_make_drafter(tmp_path):
    from selfdraft.configs.decode import DecodeConfig
    from selfdraft.heads.target import Target
    from selfdraft.inference.decode import speculative_decode
    from selfdraft.inference.specs import make_drafter
    from selfdraft.inference.session import CausalLMSession

    target = llama()
    folder = export_eagle(trained_like(target, "eagle3"), tmp_path / "e3", "sglang", identity(target))
    wrapped = Target(target, None, identity(target))
    drafter = make_drafter(str(folder), wrapped)
    assert drafter.name == "eagle3"
    prompt = [3, 14, 15, 92, 65]
    ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0)[0, 5:].tolist()
    out = speculative_decode(CausalLMSession(target, hidden_layers=drafter.hidden_layers), prompt, drafter,
                             DecodeConfig(max_new_tokens=24, stop_on_eos=False))
    assert out.token_ids == ref


def test_published_reference_eagle1_folders_are_recognised_and_pickles_refused(tmp_path):
    """The reference EAGLE-1 checkpoints (yuhuili/EAGLE-*) say ``LlamaForCausalLM`` with one layer; their
    weights carry fc (with bias), layers.0.* (an unused input norm too) and the embedding."""
    from safetensors.torch import save_file

    from selfdraft.heads.kinds.eagle.layouts import is_engine_eagle_folder

    target = llama()
    drafter = trained_like(target, "eagle", fc_bias=True)
    folder = export_eagle(drafter, tmp_path / "ref", "eagle-reference", identity(target), target.get_input_embeddings().weight)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    tensors = tensors_of(folder)
    tensors["layers.0.input_layernorm.weight"] = torch.ones(H)
    save_file(tensors, str(folder / "model.safetensors"))
    assert is_engine_eagle_folder(folder)
    back = import_eagle(folder, target)
    x, pos = torch.randn(1, 5, H), torch.arange(5)[None]
    torch.testing.assert_close(logits_by_target_id(back, target, x, pos), logits_by_target_id(drafter, target, x, pos),
                               rtol=0, atol=1e-6)
    assert not is_engine_eagle_folder(tmp_path)  # no config.json
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(SelfdraftError, match="never unpickles"):
        import_eagle(folder, target)
