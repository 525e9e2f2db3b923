"""The GPU check (tests/gpu, ``-m gpu``) runs end to end here, on the CPU with toy bodies, in a pytest of its
own with the packages the device machine lacks hidden (datasets, wandb, deepspeed, gguf), from the assets
folder a device run carries; its report holds every section's figures."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
GPU = REPO / "tests" / "gpu"
pytestmark = pytest.mark.slow  # every test of the GPU check on the CPU: minutes


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, embedded_fp32):
    """One smoke run: the assets written by the script `scripts/gpu_check.sh prepare` runs, then `pytest -m gpu
    tests/gpu` with SELFDRAFT_GPU_SMOKE=1 and the blocker on PYTHONPATH."""
    root = tmp_path_factory.mktemp("gpu_check")
    subprocess.run([sys.executable, str(GPU / "assets.py"), str(root / "assets")], check=True, cwd=REPO, timeout=300,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", SELFDRAFT_GPU_SMOKE="1", SELFDRAFT_GPU_ASSETS=str(root / "assets"),
               SELFDRAFT_GPU_REPORT=str(root / "out" / "gpu_check.json"),
               PYTHONPATH=os.pathsep.join([str(GPU / "blocker"), os.environ.get("PYTHONPATH", "")]))
    env.pop("SELFDRAFT_TEST_DEVICE", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(GPU)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    return root, proc


def test_every_gpu_test_runs_without_the_packages_the_gpu_machine_lacks(smoke):
    root, proc = smoke
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
    sections = json.loads((root / "out" / "gpu_check.json").read_text())["sections"]
    assert set(sections) == {"environment", "exactness_fp32", "training_bf16", "training_bf16_128k_vocab", "cost_surface",
                             "draft_cost", "bench", "prediction"}, set(sections)
    assert sections["environment"]["tiny"] and sections["environment"]["cpu_flags"] is not None
    drafters = sections["exactness_fp32"]["drafters"]
    assert set(drafters) == {"none", "prompt-lookup", "eagle3-60-nodes", "eagle-cpu-tree", "medusa", "self-draft-tree",
                             "dflash-block-8", "dspark-block-8"}
    assert all(row["exact_prompts"] == "2/2" and row["sampling_reproducible"] for row in drafters.values()), drafters
    assert set(sections["training_bf16"]) == {"eagle3", "medusa", "eagle", "dflash", "dspark"}
    for which in ("training_bf16", "training_bf16_128k_vocab"):
        assert all(row["finite"] and row["tokens_per_second"] > 0 for row in sections[which].values()), sections[which]
    assert sections["training_bf16_128k_vocab"]["eagle3"]["vocab"] == 128256
    surface = sections["cost_surface"]["surface"]
    assert surface["batch_sizes"] == [1, 4] and surface["tokens"] == [1, 2, 4] and surface["target"] == "random-llama8b"
    assert set(sections["draft_cost"]["eagle3_propose_ms"]) == {"1", "2", "3"}
    assert all(row["exact"] for row in sections["bench"]["rows"])


def test_the_prediction_reads_the_measured_costs_through_the_products_cost_model(smoke):
    """Each predicted speed-up is tau * T(1, 1) / (T(1, 1 + nodes) + D) with T the measured surface read by
    inference/costs.py's interpolation and D the EAGLE-3 proposal at the row's depth."""
    from selfdraft.inference.costs import CostSurface

    root, _ = smoke
    sections = json.loads((root / "out" / "gpu_check.json").read_text())["sections"]
    surface = CostSurface.from_dict(sections["cost_surface"]["surface"])
    rows = sections["prediction"]["rows"]
    assert {r["method"] for r in rows} >= {"prompt-lookup"} and any("random-eagle3" in r["method"] for r in rows), rows
    for r in rows:
        assert r["plain_ms"] == round(1e3 * surface(1, 1), 3)
        want = r["tau"] * r["plain_ms"] / (r["verify_ms"] + r["draft_ms"])
        assert abs(r["predicted_speedup"] - want) < 0.01 * want + 0.01, r
        assert (r["draft_ms"] > 0) == ("eagle" in r["method"]), r
