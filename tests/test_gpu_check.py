"""The prepared GPU check (scripts/gpu_check.py) runs end to end here, on the CPU with toy bodies, with
the packages the device machine lacks hidden (datasets, wandb, deepspeed, gguf), and its prediction
combines a bench's acceptance lengths with the measured verify costs."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
pytestmark = pytest.mark.slow  # the smoke run: every section of the GPU check on the CPU, minutes


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, embedded_fp32):
    """One smoke run: --prepare from the converted SmolLM2 folder, then every section on the CPU."""
    root = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, str(SCRIPT), "--prepare", "--assets", str(root / "assets")], check=True, env=env,
                   cwd=REPO, timeout=300)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--assets", str(root / "assets"),
                           "--out", str(root / "out"), "--budget", "900"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=1200)
    return root, proc


def test_every_section_runs_without_the_packages_the_gpu_machine_lacks(smoke):
    root, proc = smoke
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((root / "out" / "gpu_check.json").read_text())
    sections = report["sections"]
    assert {k for k, v in sections.items() if v["status"] == "ok"} == {
        "environment", "exactness_fp32", "training_bf16", "training_bf16_128k_vocab", "verify_cost", "drafter_cost",
        "verify_cost_batched", "bench", "pytest"}, {k: v.get("error") or v.get("reason") for k, v in sections.items()}
    assert sections["exactness_fp32"]["all_exact"]
    drafters = sections["exactness_fp32"]["drafters"]
    assert set(drafters) >= {"none", "prompt-lookup", "eagle3-60-nodes", "medusa", "self-draft-tree", "dflash-block-8",
                             "dspark-block-8"}
    assert all(row["sampling_reproducible"] for row in drafters.values())
    for which in ("training_bf16", "training_bf16_128k_vocab"):
        rows = next(v for k, v in sections[which].items() if isinstance(v, dict))
        assert all(row["finite"] and row["tokens_per_second"] > 0 for row in rows.values()), rows
    assert sections["training_bf16_128k_vocab"]["llama8b"]["eagle3"]["vocab"] == 128256
    curve = sections["verify_cost"]["verify_ms"]
    assert all(set(row) == {"1", "2", "4", "8", "16", "32", "64", "128"} for row in curve.values())
    assert set(sections["drafter_cost"]["eagle3_propose"]) == {str(d) for d in range(1, 9)}
    surface = sections["verify_cost_batched"]["verify_ms"]
    assert set(surface) == {"1", "4"} and all(set(row) == {"1", "4"} and min(row.values()) > 0 for row in surface.values())
    assert "tests collected" in sections["pytest"]["summary"], sections["pytest"]["tail"]
    bench = json.loads((root / "out" / "bench" / "results.json").read_text())
    assert all(row["exact"] for row in bench["rows"])
    assert bench["meta"]["machine"]["cpu_flags"] is not None


def test_prediction_combines_cpu_acceptance_with_gpu_costs(smoke):
    root, _ = smoke
    bench, gpu = root / "out" / "bench" / "results.json", root / "out" / "gpu_check.json"
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rows = gpu_check.predict(bench, gpu)
    methods = {row["method"] for row in rows}
    assert "prompt-lookup" in methods and any("random-eagle3" in m for m in methods), methods
    curve = json.loads(gpu.read_text())["sections"]["verify_cost"]["verify_ms"]
    context = max(curve, key=int)
    for row in rows:
        want = row["tau"] * row["plain_ms"] / (row["verify_ms"] + row["draft_ms"])
        assert abs(row["predicted_speedup"] - want) < 0.01 * want + 0.01
        assert row["plain_ms"] == curve[context]["1"]["tree"]
        assert (row["draft_ms"] > 0) == ("eagle" in row["method"])
    out = subprocess.run([sys.executable, str(SCRIPT), "--predict", str(bench), "--gpu", str(gpu)], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and "predicted GPU speed-up" in out.stdout.splitlines()[0], out.stderr
    assert len(out.stdout.strip().splitlines()) == 2 + len(rows)
