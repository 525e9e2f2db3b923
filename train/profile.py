"""Where a training step's time goes: named wall-clock phases, recorded when a profile is attached.

An objective records its phases (the target's forward, each drafter forward, the losses) into the
:class:`StepProfile` that is recording (``with profile.recording(): objective(**batch)``), and does
nothing when none is (a training run pays one context-variable read per phase). The backward pass runs inside autograd,
so it cannot be wrapped: :meth:`StepProfile.backward_marks` hooks tensors instead and records when
their gradient arrives. For EAGLE-3 the hooked tensors are each training-time-test step's output,
last step first, then the fused feature step 0 reads: the time between two arrivals is the backward
of the step in between (autograd runs a later step's graph before an earlier one's, since every step
reads its predecessor's output). ``scripts/profile_step.py`` prints the table.

On a GPU every phase boundary synchronises the device, so a profiled step is slower than a plain one;
the shares are what the table is for.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import defaultdict

import torch


_RECORDING: contextvars.ContextVar[StepProfile | None] = contextvars.ContextVar("selfdraft_step_profile", default=None)


class StepProfile:
    """Seconds per named phase, summed over the steps recorded."""

    def __init__(self, device: torch.device | str = "cpu", only: set[str] | None = None):
        """``only``: record just these phases (the training loop times the target's forward alone, so
        that a GPU run synchronises once per step for it, not at every phase)."""
        self.device = torch.device(device)
        self.only = only
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)
        self._arrivals: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def recording(self):
        """Within the block, the objectives' phases go to this profile."""
        token = _RECORDING.set(self)
        try:
            yield self
        finally:
            _RECORDING.reset(token)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Add the wall time of the block to ``seconds[name]``."""
        began = self._now()
        try:
            yield
        finally:
            self.seconds[name] += self._now() - began

    def count(self, name: str, value: float) -> None:
        """Add ``value`` to a counter (tokens, padded positions...)."""
        self.counts[name] += float(value)

    def backward_marks(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Record when the gradient of each tensor arrives (the first time), in backward order."""
        for name, tensor in named:
            if tensor.requires_grad:
                tensor.register_hook(self._arrival_hook(name))

    def _arrival_hook(self, name: str):
        def hook(grad):
            if not any(n == name for n, _ in self._arrivals):
                self._arrivals.append((name, self._now()))
        return hook

    @contextlib.contextmanager
    def backward(self, rest: str = "backward, the rest"):
        """Wrap ``loss.backward()``: the time from one gradient arrival to the next (or to the end of
        the backward) goes to the phase named by the earlier mark: the backward of the module whose
        output that gradient is; what comes before the first arrival goes to ``rest``."""
        self._arrivals = []
        began = self._now()
        try:
            yield
        finally:
            ended = self._now()
            arrivals = sorted(self._arrivals, key=lambda a: a[1])
            covered = 0.0
            for (name, t0), (_, t1) in zip(arrivals, arrivals[1:] + [("", ended)]):
                self.seconds[name] += t1 - t0
                covered += t1 - t0
            self.seconds[rest] += ended - began - covered
            self._arrivals = []


def recording() -> StepProfile | None:
    """The profile recording now, if any."""
    return _RECORDING.get()


def phase(name: str):
    """``profile.phase(name)`` of the profile recording now, else a no-op context."""
    profile = _RECORDING.get()
    if profile is None or (profile.only is not None and name not in profile.only):
        return contextlib.nullcontext()
    return profile.phase(name)
