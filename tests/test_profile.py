"""The step profiler (train/profile.py): phases recorded only while a profile records, the backward
split per training-time-test step by gradient arrival."""

import numpy as np
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.train.loop import collate
from selfdraft.train.objectives import build_objective
from selfdraft.train.profile import StepProfile, recording


def test_a_profile_records_every_phase_of_an_eagle3_step_and_nothing_outside():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    rng = np.random.default_rng(0)
    data = [(rng.integers(3, 200, n), np.r_[0, 0, np.ones(n - 2, dtype=np.int64)]) for n in (30, 18)]
    config = load_run_config("smoke_cpu", ["drafter.kind=eagle3", "drafter.eagle.draft_vocab_size=64"])
    objective = build_objective(config, model, data).train()
    batch = collate(data, 0, "cpu")

    profile = StepProfile()
    loss, _ = objective(**batch)  # not recording: nothing is timed, no hook is left behind
    loss.backward()
    assert recording() is None and not profile.seconds
    with profile.recording():
        assert recording() is profile
        loss, _ = objective(**batch)
    assert recording() is None
    with profile.backward():
        loss.backward()
    steps = range(config.drafter.eagle.ttt_steps)
    expected = {"target forward", "drafter forward, fuse", "losses", "drafter backward, fuse", "backward, the rest",
                *(f"drafter forward, step {j}" for j in steps), *(f"drafter backward, step {j}" for j in steps)}
    assert set(profile.seconds) == expected
    assert all(profile.seconds[name] > 0 for name in expected - {"backward, the rest"})
