"""The processor flags every measured figure is recorded with, and the AVX2 cap that makes an AVX-512
machine measure as an AVX2-only one."""

import pathlib

import pytest

from selfdraft import machine

CPUINFO = pathlib.Path("/proc/cpuinfo")


@pytest.fixture
def uncapped(monkeypatch):
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)


def test_flags_come_from_the_processor(uncapped):
    if not CPUINFO.is_file():
        pytest.skip("no /proc/cpuinfo here")
    line = next(l for l in CPUINFO.read_text().splitlines() if l.startswith("flags"))
    have = set(line.split(":", 1)[1].split())
    assert machine.cpu_flags() == [f for f in machine.FLAGS if f in have]
    assert machine.isa_caps() == {}


@pytest.mark.parametrize("name,value", [("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                                        ("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ATEN_CPU_CAPABILITY", "default")])
def test_a_cap_at_avx2_hides_avx512_and_amx(uncapped, monkeypatch, name, value):
    """Under any one cap the machine reads as AVX2-only: no bf16 autocast, its own cost-surface cache key."""
    monkeypatch.setenv(name, value)
    flags = machine.cpu_flags()
    assert not [f for f in flags if f.startswith(("avx512", "amx"))]
    assert not machine.cpu_has_bf16()
    assert machine.isa_caps() == {name: value}
    assert machine.describe()["isa_caps"] == {name: value}


def test_a_cap_above_avx2_changes_nothing(uncapped, monkeypatch):
    plain = machine.cpu_flags()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert machine.cpu_flags() == plain
