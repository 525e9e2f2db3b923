"""What this machine's processor can do fast: the vector extensions that decide CPU speed here.

Machines of the project's kind differ: AVX2 only, where bf16 matmuls are slower than fp32, or AVX-512
with native bf16 (``avx512_bf16``, ``amx_bf16``), where bf16 is faster (docs/results/training-profiles.md).
Benchmarks record :func:`cpu_flags` with every figure, and training's ``mixed_precision: auto`` picks
bf16 autocast on a CPU only where :func:`cpu_has_bf16` is true.

An AVX-512 machine can run as an AVX2-only one: ``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels),
``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's matrix products) cap
what the libraries use; :func:`cpu_flags` then reports the capped flags, so bf16 autocast, the cached
cost surfaces and the benchmarks' records follow the capped machine, not the processor's own flags.
"""

from __future__ import annotations

import os
import pathlib
import platform

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# The variables that cap the instruction sets torch's kernels, oneDNN and MKL use (each library's own
# spelling; the values at or below AVX2 are the ones that matter here).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
_AT_MOST_AVX2 = {"default", "sse41", "sse42", "avx", "avx2", "avx2_vnni", "avx2_vnni_2"}


def isa_caps() -> dict[str, str]:
    """The set variables of :data:`ISA_CAPS` and their values."""
    return {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}


def cpu_flags() -> list[str]:
    """Which of :data:`FLAGS` the processor has (from /proc/cpuinfo; empty where it cannot be read), less
    the AVX-512 and AMX ones where a variable of :data:`ISA_CAPS` caps the libraries at AVX2 or below."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                if any(v.lower() in _AT_MOST_AVX2 for v in isa_caps().values()):
                    have = {f for f in have if not f.startswith(("avx512", "amx"))}
                return [f for f in FLAGS if f in have]
    except OSError:
        pass
    return []


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo; ``platform.processor()`` where it cannot be read)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def describe(device: str = "cpu") -> dict:
    """What a measured speed depends on: processor (or GPU), its flags, cores, torch's threads."""
    import torch

    gpu = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None
    return {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "isa_caps": isa_caps(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "gpu": gpu, "torch": torch.__version__}


def cpu_has_bf16() -> bool:
    """Whether the processor multiplies bf16 natively (AVX-512 BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def _proc_kib(path: str, field: str) -> int | None:
    """Bytes of a ``field:  N kB`` line of a /proc file (None where /proc cannot tell)."""
    try:
        for line in pathlib.Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory so far (VmHWM; None where /proc cannot tell)."""
    return _proc_kib("/proc/self/status", "VmHWM")


def available_host_bytes() -> int | None:
    """Memory the host can still give (MemAvailable; None where /proc cannot tell)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")
