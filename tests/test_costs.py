"""The verify-cost surface T(B, m) (inference/costs.py) and ``selfdraft costs``: measured on a tiny
Llama, cached, read between grid points, printed and plotted; a batch beyond memory refused before
anything is allocated, naming the largest that fits."""

from __future__ import annotations

import json

import pytest

from selfdraft.cli import main
from selfdraft.errors import SelfdraftError
from selfdraft.inference import batch
from selfdraft.inference import costs as cs
from selfdraft.inference.cost_report import plot_cost_surface


def toy(seconds=((1.0, 1.0, 2.0), (2.0, 3.0, 6.0))):
    return cs.CostSurface((1, 4), (1, 2, 4), seconds, "toy", "float32", "cpu", 256, {})


def test_the_surface_reads_between_grid_points_and_prints_a_table():
    s = toy()
    assert s(1, 1) == 1.0 and s(4, 4) == 6.0
    assert s(1, 3) == pytest.approx(1.5) and s(2, 1) == pytest.approx(1 + 1 / 3)  # linear in m, then in B
    assert s(4, 8) == pytest.approx(6.0 + 1.5 * 4)  # beyond the grid: along the last slope
    assert s.relative(4, 4) == pytest.approx(3.0)
    table = s.table()
    assert "| batch \\ tokens per row | 1 | 2 | 4 |" in table and "| 4 | 2000.0 ms (1.00x) | 3000.0 ms (1.50x) | 6000.0 ms (3.00x) |" in table
    assert cs.CostSurface.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(SelfdraftError, match="increasing positive tokens"):
        cs.CostSurface((1,), (2, 1), ((1.0, 1.0),), "t", "f", "c", 1, {})
    with pytest.raises(SelfdraftError, match="2 x 3 times"):
        toy(((1.0, 1.0, 2.0),))


def test_measured_once_cached_and_plotted(tiny_target, tmp_path, monkeypatch):
    from selfdraft.heads.target import load_target

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    target = load_target(str(tiny_target))
    surface = cs.cost_surface(target, [2, 1], [4, 1, 2])
    assert surface.batch_sizes == (1, 2) and surface.tokens == (1, 2, 4) and surface.context == cs.COST_CONTEXT
    assert all(0 < a <= b for row in surface.seconds for a, b in zip(row, row[1:]))  # never falls with m
    monkeypatch.setattr(cs, "measure_cost_surface", lambda *a, **k: pytest.fail("measured twice"))
    assert cs.cost_surface(target, [1, 2], [1, 2, 4]) == surface
    png = plot_cost_surface(surface, tmp_path / "plot" / "costs.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_batch_beyond_memory_is_refused_before_allocation(tiny_target, monkeypatch):
    from selfdraft.heads.target import load_target

    target = load_target(str(tiny_target))
    row = batch.kv_bytes_per_row(target.model, 260) + 4 * 260 * target.model.config.vocab_size
    monkeypatch.setattr(batch, "free_bytes", lambda device: int(10.5 * row / 0.8))  # room for 10 rows
    with pytest.raises(SelfdraftError, match="the largest batch that fits is 10"):
        cs.measure_cost_surface(target, [1, 64], [4])


def test_selfdraft_costs_prints_the_table_and_writes_json_and_png(tiny_target, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["costs", "--target", str(tiny_target), "--batch-sizes", "1,2", "--tokens", "1,3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| batch \\ tokens per row | 1 | 3 |" in printed and "| 2 | " in printed
    assert json.loads((out / "costs.json").read_text())["batch_sizes"] == [1, 2]
    assert (out / "costs.png").stat().st_size > 1000


def test_bad_grids_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["costs", "--batch-sizes", "0,4"])
    assert "integers >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_batch_ones_curve_is_measured_once_and_cached_with_the_other_batch_sizes(tiny_target, tmp_path, monkeypatch):
    """``verify_cost`` (batch 1's row) and a batched decode's grid share one cost file per target and machine:
    a cell is measured once, a damaged file is measured again and replaced."""
    from selfdraft.heads.target import load_target

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))
    target = load_target(str(tiny_target))
    first = cs.verify_cost(target, 5)
    assert first.batch_sizes == (1,) and first.tokens == (1, 2, 3, 4, 5) and all(s > 0 for s in first.seconds[0])
    assert list(first.seconds[0]) == sorted(first.seconds[0])  # never falls
    assert first.machine["cpu_flags"] is not None and first.target == target.identity.name
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the costs are cached")

    monkeypatch.setattr(cs, "measure_cost_surface", no_measuring)
    assert cs.verify_cost(target, 5) == first
    assert cs.verify_cost(target, 4).seconds[0] == first.seconds[0][:4]  # a smaller grid: the same cells
    monkeypatch.undo()
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))
    both = cs.cost_surface(target, (1, 2), (1, 2, 4))  # batch 2 measured; batch 1's cells kept
    assert both.seconds[0] == (first.seconds[0][0], first.seconds[0][1], first.seconds[0][3])
    assert list((tmp_path / "costs").glob("*.json")) == files
    files[0].write_text("{ half a file")  # damaged: measured again and replaced
    again = cs.verify_cost(target, 5)
    cells = json.loads(files[0].read_text())["cells"]
    assert [t for b, m, t in cells if b == 1] == list(again.seconds[0])
