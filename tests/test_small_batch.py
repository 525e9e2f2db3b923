"""The few-row float32 linear path of heads/small_batch.py: same products as ``F.linear`` (up to float32
rounding), taken only where it is meant to be, switched off by its environment variable."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfdraft.heads import small_batch


def _layer(bias: bool, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias).to(dtype)
    layer.requires_grad_(False)
    assert small_batch.use_small_batch_matmul(layer) == 1
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

    assert small_batch.use_small_batch_matmul(layer) == 0  # already set: nothing to do
    monkeypatch.setenv(small_batch.ENV, "0")
    assert not small_batch.enabled() and small_batch.use_small_batch_matmul(nn.Linear(3, 3)) == 0


def test_cpu_targets_and_drafters_get_it(tiny_target):
    from selfdraft.heads.target import load_target

    from selfdraft.heads.eagle import EagleDrafter
    from selfdraft.heads.medusa import MedusaHeads
    from selfdraft.inference.eagle import EagleTreeDrafter
    from selfdraft.inference.medusa import MedusaDrafter

    target = load_target(str(tiny_target))
    assert small_batch.uses_small_batch_matmul(target.model)
    assert type(target.model.lm_head).forward is nn.Linear.forward  # the class is untouched
    eagle = EagleTreeDrafter(EagleDrafter(EagleDrafter.dims_for(target.model, "eagle")), target.model)
    medusa = MedusaDrafter(MedusaHeads(32, target.identity.vocab_size, num_heads=2), target.model, [(0,), (0, 0)])
    assert small_batch.uses_small_batch_matmul(eagle.drafter) and small_batch.uses_small_batch_matmul(medusa.heads)
