"""What this machine's processor can do fast: the vector extensions that decide CPU speed here.

Machines of the project's kind differ (FACTS.md): AVX2 only, where bf16 matmuls are slower than fp32,
or AVX-512 with native bf16 (``avx512_bf16``, ``amx_bf16``), where bf16 is about twice as fast.
Benchmarks record :func:`cpu_flags` with every figure, and training's ``mixed_precision: auto`` picks
bf16 autocast on a CPU only where :func:`cpu_has_bf16` is true.
"""

from __future__ import annotations

import pathlib

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    """Which of :data:`FLAGS` the processor has (from /proc/cpuinfo; empty where it cannot be read)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in FLAGS if f in have]
    except OSError:
        pass
    return []


def cpu_has_bf16() -> bool:
    """Whether the processor multiplies bf16 natively (AVX-512 BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory so far (VmHWM; None where /proc cannot tell)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
