"""Faster float32 linear layers for the few-row forwards of speculative decoding on a CPU.

A tree verification runs the target over a handful of tokens (2-64 rows), and an EAGLE drafter over
top_k rows per depth. On a CPU, ``F.linear(x, W)`` with 2-64 rows takes a general matrix-multiply
path that costs far more than its one-row matrix-vector path: on the 2-core AVX2 machine this
project is built on, SmolLM2-135M's 49152 x 576 LM head takes 7.8 ms for 1 row and 18.2 ms for
2 rows, while the same product with the weight as the left operand, ``(W @ x.T).T``, takes 4.6 ms
for 2 rows, 14 ms for 13 rows padded to 16 (20 ms with ``F.linear``); a whole forward over 4 tokens
drops from 91 ms (1.7x a one-token forward) to 50 ms.
Verifying a small tree then costs about what one decoding step costs, which is what makes drafting
pay here.

:func:`use_small_batch_matmul` gives every ``nn.Linear`` of a module that path for float32 CPU
inputs of 2-64 rows; one row, more rows, other dtypes (bf16 gains nothing on a CPU without bf16
instructions), other devices and autograd all take ``F.linear`` unchanged. The product is the same
up to float32 rounding (another summation order, as any change of matrix-multiply kernel gives).
``SELFDRAFT_SMALL_BATCH_MATMUL=0`` switches it off, e.g. to measure what it buys.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64
"""Above this many rows the general kernel is as fast (a prefill keeps it)."""
DIRECT_ROWS = 5
ROW_MULTIPLE = 8
"""Up to DIRECT_ROWS rows go as they are; more are zero-padded to a multiple of ROW_MULTIPLE, since
the kernel is slow on other row counts (LM head, unpadded: 9 ms for 8 rows, 22 ms for 13, 14 ms for 16)."""
ENV = "SELFDRAFT_SMALL_BATCH_MATMUL"


def enabled() -> bool:
    """Whether :func:`use_small_batch_matmul` patches anything (``SELFDRAFT_SMALL_BATCH_MATMUL`` not 0)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features if x.dim() >= 2 else 1
    if (2 <= rows <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
            and self.weight.dtype == torch.float32 and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
        flat = x.reshape(rows, self.in_features)
        padded = rows if rows <= DIRECT_ROWS else -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        y = torch.matmul(self.weight, flat.t()).t()[:rows].contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)
    return F.linear(x, self.weight, self.bias)


def use_small_batch_matmul(module: nn.Module) -> int:
    """Give every ``nn.Linear`` in ``module`` the few-row path (an instance-level ``forward``, so
    hooks and the class are untouched); returns how many layers it set, 0 when switched off."""
    if not enabled():
        return 0
    count = 0
    for layer in module.modules():
        if type(layer) is nn.Linear and getattr(layer.forward, "__func__", None) is not _forward:
            layer.forward = types.MethodType(_forward, layer)
            count += 1
    return count


def uses_small_batch_matmul(module: nn.Module) -> bool:
    """Whether any ``nn.Linear`` in ``module`` has the few-row path."""
    return any(getattr(layer.forward, "__func__", None) is _forward for layer in module.modules()
               if isinstance(layer, nn.Linear))
