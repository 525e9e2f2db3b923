"""The typed config machinery: strict keys, typed values, dotted overrides, the decode configs."""

import dataclasses

import pytest

from selfdraft.configs.decode import DecodeConfig, DRAFT_MODEL_TREE, PromptLookupConfig
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
    DecodeConfig()
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)):
        with pytest.raises(SelfdraftError):
            DecodeConfig(**bad)
    with pytest.raises(SelfdraftError, match="min_ngram"):
        PromptLookupConfig(min_ngram=4, max_ngram=3)
    with pytest.raises(SelfdraftError, match="depth"):
        dataclasses.replace(DRAFT_MODEL_TREE, depth=0)


# ---------------------------------------------------------------- the shipped run presets

def _leaves(data: dict, prefix: str = "") -> dict:
    """``{"a.b": value}`` for every non-mapping value of a nested dict."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _presets():
    from selfdraft.configs.run import presets

    return sorted(presets())


def test_the_shipped_presets_are_the_yaml_files_of_configs():
    import pathlib

    from selfdraft.configs.run import presets

    folder = pathlib.Path(__file__).resolve().parents[1] / "configs"
    assert sorted(presets()) == sorted(p.stem for p in folder.glob("*.yaml"))
    assert {"smoke_cpu", "smoke_eagle", "smoke_eagle3", "medusa_smollm2", "medusa2_smollm2", "eagle_smollm2",
            "eagle3_smollm2", "quickstart"} <= set(presets())


@pytest.mark.parametrize("name", _presets())
def test_each_preset_loads_with_the_values_its_file_states_and_defaults_for_the_rest(name):
    """Every key the YAML file states is in the loaded config with that value (no key renamed or moved
    on the way, no value rewritten), and every key it leaves out has the dataclass default."""
    from selfdraft.configs.run import RunConfig, load_run_config, presets

    stated = _leaves(load_yaml(presets()[name]))
    loaded = _leaves(to_dict(load_run_config(name)))
    defaults = _leaves(to_dict(RunConfig()))
    assert stated, f"{name}: an empty preset"
    assert set(stated) <= set(loaded), f"{name} states keys the config does not hold: {sorted(set(stated) - set(loaded))}"
    wrong = {k: (v, loaded[k]) for k, v in stated.items() if loaded[k] != v or type(loaded[k]) is not type(v)
             and not (isinstance(v, int) and isinstance(loaded[k], float))}
    assert not wrong, f"{name}: (stated, loaded) differ: {wrong}"
    assert loaded.keys() == defaults.keys()
    unstated = {k: (loaded[k], defaults[k]) for k in loaded if k not in stated and loaded[k] != defaults[k]}
    assert not unstated, f"{name}: keys the file leaves out that do not have their defaults: {unstated}"


# One dotted key of every section (and nested section) of the run config, with two values: the test
# sets the first that the preset does not already hold. A section added to RunConfig without an entry
# here fails the test below.
SECTION_OVERRIDES = {
    "name": ("renamed-by-override", "renamed-again"),
    "target.spec": ("some/local-folder", "another/folder"),
    "data.max_length": (96, 80),
    "drafter.kind": ("eagle3", "medusa"),
    "drafter.tree.max_nodes": (11, 13),
    "drafter.medusa.num_heads": (7, 6),
    "drafter.medusa.lora.alpha": (3.5, 2.5),
    "drafter.eagle.ttt_steps": (5, 4),
    "drafter.block.anchors": (32, 16),
    "train.max_steps": (123, 124),
}


@pytest.mark.parametrize("name", _presets())
def test_overrides_of_every_section_change_that_key_and_nothing_else(name):
    from selfdraft.configs.run import RunConfig, load_run_config

    sections = {k.rpartition(".")[0] for k in _leaves(to_dict(RunConfig()))}
    assert sections == {k.rpartition(".")[0] for k in SECTION_OVERRIDES}, "a config section has no override here"
    before = _leaves(to_dict(load_run_config(name)))
    chosen = {key: next(v for v in values if v != before[key]) for key, values in SECTION_OVERRIDES.items()}
    for key, value in chosen.items():
        after = _leaves(to_dict(load_run_config(name, [f"{key}={value}"])))
        assert after[key] == value and {k: v for k, v in after.items() if k != key} == \
            {k: v for k, v in before.items() if k != key}, f"{name}: {key}={value}"
    together = _leaves(to_dict(load_run_config(name, [f"{k}={v}" for k, v in chosen.items()])))
    assert together == {**before, **chosen}
    with pytest.raises(SelfdraftError, match="unknown config key train.learning_rate"):
        load_run_config(name, ["train.learning_rate=1e-3"])
    with pytest.raises(SelfdraftError, match="train.max_steps must be >= 1"):
        load_run_config(name, ["train.max_steps=0"])


def test_configs_of_selfdraft_0_1_load_with_their_tree_keys_moved():
    """selfdraft 0.1 kept tree keys in the kind's section (``drafter.eagle.tree_*``,
    ``drafter.medusa.tree_nodes``): the section of the config's own kind gives ``drafter.tree``, the
    other's are dropped (they never applied), and every move is reported."""
    from selfdraft.configs.run import RunConfig, upgrade_config_dict
    from selfdraft.configs.schema import from_dict

    old = {"drafter": {"kind": "eagle3", "eagle": {"tree_depth": 5, "tree_nodes": 30, "ttt_steps": 2},
                       "medusa": {"tree_nodes": 7}}}
    data, notes = upgrade_config_dict(old)
    config = from_dict(RunConfig, data)
    assert (config.drafter.tree.depth, config.drafter.tree.max_nodes, config.drafter.eagle.ttt_steps) == (5, 30, 2)
    assert sorted(notes) == ["drafter.eagle.tree_depth is now drafter.tree.depth",
                             "drafter.eagle.tree_nodes is now drafter.tree.max_nodes",
                             "drafter.medusa.tree_nodes is now drafter.tree.max_nodes"]
    medusa, _ = upgrade_config_dict({"drafter": {"medusa": {"tree_nodes": 7}, "eagle": {"tree_depth": 5}}})
    assert from_dict(RunConfig, medusa).drafter.tree.max_nodes == 7 and "depth" not in medusa["drafter"]["tree"]
    assert upgrade_config_dict({"train": {"max_steps": 3}}) == ({"train": {"max_steps": 3}}, [])


def test_a_kind_declares_its_config_section_and_its_checks():
    """The ``drafter.<section>`` keys come from the registered kinds (configs names none): a toy kind's
    section parses, round-trips, is checked by its own ``problems`` and goes when the kind does."""
    import dataclasses as dc

    from selfdraft.configs.run import RunConfig, drafter_sections, load_run_config
    from selfdraft.heads.kinds import get_kind, register, unregister

    @dc.dataclass(frozen=True)
    class ToySection:
        width: int = 3

        def problems(self, run) -> list[str]:
            return [] if self.width >= 1 else ["drafter.toy.width must be >= 1"]

    register(dc.replace(get_kind("medusa"), name="toy-kind", section=("toy", ToySection), default=False))
    try:
        assert list(drafter_sections())[-1] == "toy"
        config = load_run_config("smoke_cpu", ["drafter.toy.width=5"])
        assert config.drafter.toy == ToySection(5) and from_dict(RunConfig, to_dict(config)) == config
        with pytest.raises(SelfdraftError, match="drafter.toy.width must be >= 1"):
            load_run_config("smoke_cpu", ["drafter.toy.width=0"])
        with pytest.raises(SelfdraftError, match="unknown config key drafter.toy.depth"):
            load_run_config("smoke_cpu", ["drafter.toy.depth=0"])
        with pytest.raises(SelfdraftError, match="already declared"):
            register(dc.replace(get_kind("medusa"), name="toy-kind-2", section=("toy", dc.make_dataclass("Other", [])),
                               default=False))
    finally:
        unregister("toy-kind")
    assert "toy" not in drafter_sections() and "toy" not in to_dict(RunConfig())["drafter"]
    with pytest.raises(SelfdraftError, match="unknown config key drafter.toy; known keys here: drafter.block"):
        load_run_config("smoke_cpu", ["drafter.toy.width=5"])
