"""The typed config machinery: strict keys, typed values, dotted overrides, the decode configs."""

import pytest

from selfdraft.configs.decode import DecodeConfig, DraftModelConfig, PromptLookupConfig
from selfdraft.configs.schema import DataConfig, apply_overrides, from_dict, load_yaml, to_dict
from selfdraft.errors import SelfdraftError


def test_from_dict_round_trips_and_converts_ints_for_floats():
    cfg = from_dict(DataConfig, {"source": "x.jsonl", "eval_fraction": 0, "max_conversations": None})
    assert cfg.eval_fraction == 0.0 and isinstance(cfg.eval_fraction, float)
    assert from_dict(DataConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "data, message",
    [
        ({"max_lenght": 3}, "unknown config key max_lenght"),
        ({"format": "csv"}, "'csv' is not one of"),
        ({"max_length": "long"}, "config max_length: expected int"),
        ({"max_length": True}, "config max_length: expected int"),
        ({"max_conversations": 1.5}, "config max_conversations"),
    ],
)
def test_bad_keys_and_values_are_named(data, message):
    with pytest.raises(SelfdraftError, match=message):
        from_dict(DataConfig, data)


def test_dotted_overrides_parse_yaml_scalars_and_fail_on_misspelt_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  source: a.jsonl\n  max_length: 256\n")
    data = apply_overrides(load_yaml(path), ["data.max_length=512", "data.max_conversations=null", "data.format=messages"])
    cfg = from_dict(DataConfig, data["data"])
    assert (cfg.max_length, cfg.max_conversations, cfg.format) == (512, None, "messages")
    with pytest.raises(SelfdraftError, match="unknown config key data.eval_frac"):
        from_dict(DataConfig, apply_overrides(data, ["data.eval_frac=0.1"])["data"], prefix="data.")
    with pytest.raises(SelfdraftError, match="section.key=value"):
        apply_overrides(data, ["data.max_length"])


def test_bad_yaml_files_are_clear(tmp_path):
    with pytest.raises(SelfdraftError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SelfdraftError, match="mapping"):
        load_yaml(tmp_path / "list.yaml")


def test_decode_configs_validate():
    DecodeConfig().validate()
    for bad in (DecodeConfig(max_new_tokens=0), DecodeConfig(temperature=-1), DecodeConfig(top_p=0), DecodeConfig(top_k=-2)):
        with pytest.raises(SelfdraftError):
            bad.validate()
    with pytest.raises(SelfdraftError, match="min_ngram"):
        PromptLookupConfig(min_ngram=4, max_ngram=3).validate()
    with pytest.raises(SelfdraftError, match="depth"):
        DraftModelConfig(depth=0).validate()
