"""The few-row float32 linear path of heads/small_batch.py: same products as ``F.linear`` (up to float32
rounding), taken only where it is meant to be, switched off by its environment variable."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfdraft.heads import small_batch


@pytest.fixture(autouse=True)
def always(monkeypatch):
    """The path at every 2-64 row count, without timing (the default, ``auto``, times it: see the last test)."""
    monkeypatch.setenv(small_batch.ENV, "1")


def _layer(bias: bool, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias).to(dtype)
    layer.requires_grad_(False)
    assert len(small_batch.use_small_batch_matmul(layer)) == 1
    return layer


@pytest.fixture
def linear_calls(monkeypatch):
    """Rows of every input that went to F.linear inside the patched forward."""
    calls = []
    real = F.linear

    def spy(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    monkeypatch.setattr(small_batch.F, "linear", spy)
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 5), (1, 6), (1, 13), (2, 8), (16,), (4, 16), (1, 64), (1, 65), (3, 40)])
def test_same_product_as_f_linear_and_the_path_by_rows(bias, shape, linear_calls):
    layer = _layer(bias)
    x = torch.randn(*shape, 24)
    with torch.inference_mode():
        got = layer(x)
    want = x @ layer.weight.t() + (layer.bias if bias else 0)  # not F.linear: the spy counts the layer's calls
    assert got.shape == want.shape and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rows = x.numel() // 24
    assert linear_calls == ([] if 2 <= rows <= small_batch.MAX_ROWS else [rows])


def test_autograd_bf16_and_switched_off_take_f_linear(linear_calls, monkeypatch):
    layer = _layer(bias=True)
    x = torch.randn(1, 4, 24, requires_grad=True)
    out = layer(x)
    out.sum().backward()  # gradients flow through the ordinary path
    assert linear_calls == [4] and x.grad is not None

    half = _layer(bias=False, dtype=torch.bfloat16)
    with torch.inference_mode():
        half(torch.randn(1, 4, 24, dtype=torch.bfloat16))
    assert linear_calls == [4, 4]

    assert len(small_batch.use_small_batch_matmul(layer)) == 0  # already set: nothing to do
    monkeypatch.setenv(small_batch.ENV, "0")
    assert not small_batch.enabled() and len(small_batch.use_small_batch_matmul(nn.Linear(3, 3))) == 0


def test_cpu_targets_and_drafters_get_it(tiny_target):
    from selfdraft.heads.target import load_target

    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.kinds.medusa.module import MedusaHeads
    from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
    from selfdraft.heads.kinds.medusa.decode import MedusaDrafter

    target = load_target(str(tiny_target))
    assert small_batch.uses_small_batch_matmul(target.model)
    assert isinstance(target.small_batch, small_batch.SmallBatchMatmul) and len(target.small_batch) > 0
    assert type(target.model.lm_head).forward is nn.Linear.forward  # the class is untouched
    eagle = EagleTreeDrafter(new_drafter(target.model, "eagle"), target.model)
    medusa = MedusaDrafter(MedusaHeads(32, target.identity.vocab_size, num_heads=2), target.model, [(0,), (0, 0)])
    assert small_batch.uses_small_batch_matmul(eagle.drafter) and small_batch.uses_small_batch_matmul(medusa.heads)


def _model() -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 24, bias=False))
    return nn.Sequential(nn.Linear(24, 24), inner, nn.Linear(24, 7)).requires_grad_(False)


def test_apply_then_remove_restores_the_module_exactly(caplog):
    model = _model()
    x = torch.randn(1, 6, 24)  # 6 rows: the few-row path, padded to 8
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.inference_mode():
        before = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    with caplog.at_level("INFO", logger="selfdraft"):
        handle = small_batch.SmallBatchMatmul.apply(model, reason="a test")
    assert len(handle) == 4 and small_batch.uses_small_batch_matmul(model)
    said = [r.getMessage() for r in caplog.records if r.name == small_batch.__name__]
    assert len(said) == 1 and "4 linear layers of Sequential for a test" in said[0] and small_batch.ENV in said[0]
    with torch.inference_mode():
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)  # the same product, another kernel

    again = small_batch.use_small_batch_matmul(model)  # idempotent: nothing is wrapped twice
    assert len(again) == 0
    assert all(layer.forward.__func__ is small_batch._forward for layer in layers)
    again.remove()  # owns nothing: the first handle's layers stay wrapped
    assert small_batch.uses_small_batch_matmul(model)

    handle.remove()
    assert len(handle) == 0 and not small_batch.uses_small_batch_matmul(model)
    for layer in layers:  # the class's own forward, no instance attribute left behind
        assert "forward" not in layer.__dict__ and layer.forward.__func__ is nn.Linear.forward
    with torch.inference_mode():
        assert torch.equal(model(x), before)  # bit for bit
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and state.keys() == model.state_dict().keys()
    handle.remove()  # idempotent

    with small_batch.SmallBatchMatmul.apply(model) as scoped:  # a with block removes it at its end
        assert len(scoped) == 4 and small_batch.uses_small_batch_matmul(model)
    assert not small_batch.uses_small_batch_matmul(model)


def test_a_forward_set_by_someone_else_is_left_alone():
    model = _model()
    first = model[0]
    foreign = first.forward = lambda x: x  # e.g. accelerate's offloading hook
    handle = small_batch.SmallBatchMatmul.apply(model)
    assert len(handle) == 3 and first.forward is foreign
    handle.remove()
    assert first.forward is foreign


def test_load_target_applies_it_visibly_and_can_take_it_off(tiny_target):
    from selfdraft.heads.target import load_target

    target = load_target(str(tiny_target))  # float32 on a CPU: on by default
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        fast = target.model(ids).logits
    target.small_batch.remove()
    assert not small_batch.uses_small_batch_matmul(target.model)
    plain = load_target(str(tiny_target), small_batch_kernel=False)
    assert plain.small_batch is None and not small_batch.uses_small_batch_matmul(plain.model)
    with torch.inference_mode():
        slow = plain.model(ids).logits
        assert torch.equal(target.model(ids).logits, slow)  # removed: exactly the plain model
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)

    assert load_target(str(tiny_target), dtype="bfloat16").small_batch is None  # bf16 forwards never take it
    assert len(load_target(str(tiny_target), dtype="bfloat16", small_batch_kernel=True).small_batch) > 0


def test_auto_takes_the_path_only_where_it_was_measured_faster(monkeypatch, linear_calls, caplog, tmp_path):
    """``auto`` (the default) times both products per weight shape and row count once per process; a
    layer takes the weight-first product only at the counts where it won, and a shape that never wins
    is not wrapped."""
    monkeypatch.delenv(small_batch.ENV)
    assert small_batch.mode() == "auto"
    monkeypatch.setattr(small_batch, "_FAST", {})
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))  # no verdicts of earlier processes
    timed = []

    def scripted(out_features, in_features):  # the 24 -> 40 shape wins up to 4 rows; the 40 -> 24 shape never
        timed.append((out_features, in_features))
        return frozenset({2, 3, 4}) if (out_features, in_features) == (40, 24) else frozenset()

    monkeypatch.setattr(small_batch, "_measure_fast_rows", scripted)
    wins, loses = nn.Linear(24, 40).requires_grad_(False), nn.Linear(40, 24).requires_grad_(False)
    with caplog.at_level("INFO", logger="selfdraft"):
        handle = small_batch.use_small_batch_matmul(nn.Sequential(wins, loses))
    assert len(handle) == 1 and small_batch._is_wrapped(wins) and not small_batch._is_wrapped(loses)
    assert "1 where it was not faster here keep F.linear" in caplog.text
    with torch.inference_mode():
        for rows in (3, 4, 6, 9):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(wins(x), x @ wins.weight.t() + wins.bias, rtol=1e-5, atol=1e-5)
    assert linear_calls == [6, 9]  # 2-4 rows took the weight-first product; 6 (padded to 8) and 9 did not
    assert sorted(timed) == [(24, 40), (40, 24)]  # once per shape: layers of a shape share the verdict
    small_batch.use_small_batch_matmul(nn.Linear(24, 40))
    assert len(timed) == 2
    monkeypatch.setattr(small_batch, "_FAST", {})  # a later process: the verdicts come from disk, not a new timing
    small_batch.use_small_batch_matmul(nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24)))
    assert len(timed) == 2 and small_batch.fast_rows(40, 24) == {2, 3, 4} and small_batch.fast_rows(24, 40) == set()
    monkeypatch.undo()  # a real measurement answers with row counts the path serves
    measured = small_batch._measure_fast_rows(16, 8)
    assert measured <= set(small_batch.MEASURED_ROWS)

