"""The GPU check: what a GPU changes, measured on the device with the product's own code.

    SELFDRAFT_TEST_DEVICE=cuda python -m pytest -m gpu

runs, on that device, these tests and the exactness suites (every test that builds its models on the
``test_device`` fixture is marked ``gpu`` too): every drafter greedy-exact against transformers' own
``generate()`` and seeded sampling reproducible; a few bf16 training steps of every kind, at SmolLM2's
vocabulary and at Llama-3's 128k; the cost model of inference/costs.py measured there (T(B, m) of the
Llama-3.1-8B shape in bf16 by :func:`~selfdraft.inference.costs.measure_cost_surface`, the drafters'
proposals by :func:`~selfdraft.inference.costs.measure_draft_cost`); ``selfdraft bench`` on the device; and
the speed-ups those costs predict for measured acceptance lengths (``SELFDRAFT_CPU_BENCH``: a bench's
results.json from a CPU with trained drafters; else the device bench's own rows).

Targets have random weights, built from configs (a lent device machine has no network and no embedded
package): acceptance lengths do not depend on the hardware and are measured on a CPU with real weights.
Off CUDA these tests are skipped unless ``SELFDRAFT_GPU_SMOKE=1``, which runs them on the CPU with toy
bodies (tests/test_gpu_check.py, in CI, with the packages the device machine lacks hidden). Every figure
goes to the report ``SELFDRAFT_GPU_REPORT`` (tests/gpu/conftest.py), docs/gpu.md says how to run it on a
lent machine and docs/results/gpu.md holds what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import warnings

import pytest

pytestmark = pytest.mark.gpu

DRAFTERS = ("none", "prompt-lookup", "eagle3-60-nodes", "eagle-cpu-tree", "medusa", "self-draft-tree",
            "dflash-block-8", "dspark-block-8")
KINDS = ("eagle3", "medusa", "eagle", "dflash", "dspark")


def random_drafter(name: str, target):
    """A drafter around random weights (and the target itself as a draft model: it accepts almost
    everything, which exercises long accepted paths)."""
    import torch

    from selfdraft.configs.decode import DRAFT_MODEL_TREE, GPU_TREE, TreeConfig
    from selfdraft.inference.drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter

    text = target.model.config.get_text_config()
    if name in ("none", "prompt-lookup"):
        return NoDrafter() if name == "none" else PromptLookupDrafter()
    if name == "self-draft-tree":
        return DraftModelDrafter.for_target(target, target, dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=2, max_nodes=30))
    if name.startswith("eagle"):
        from selfdraft.heads.kinds.eagle import new_drafter
        from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter

        kind = name.split("-")[0]
        torch.manual_seed(1)
        module = new_drafter(target.model, kind, draft_vocab_size=4096 if kind == "eagle3" else None)
        if kind == "eagle3":
            module.set_vocab_map(torch.randperm(text.vocab_size)[:4096].sort().values)
        return EagleTreeDrafter(module, target.model, GPU_TREE if kind == "eagle3" else TreeConfig())
    if name == "medusa":
        from selfdraft.heads.kinds.medusa.decode import MedusaDrafter
        from selfdraft.heads.kinds.medusa.module import MedusaHeads

        torch.manual_seed(2)
        heads = MedusaHeads(text.hidden_size, text.vocab_size, num_heads=4, num_layers=1)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(0.02 * torch.randn_like(p))
        return MedusaDrafter(heads, target.model)
    return block_drafter(name.split("-")[0], target.model, block=8, layers=1, draft_vocab=4096)  # dflash-block-8, dspark-block-8


def block_drafter(kind: str, model, block: int, layers: int, draft_vocab: int, markov_rank: int = 64):
    """A random DFlash or DSpark drafter of ``block`` tokens and ``layers`` draft layers for ``model``."""
    import torch

    from selfdraft.configs.decode import TreeConfig
    from selfdraft.heads.kinds.block.decode import BlockDrafter
    from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims

    text = model.config.get_text_config()
    n = text.num_hidden_layers
    torch.manual_seed(3)
    dims = (DSparkDims if kind == "dspark" else DFlashDims).shaped_like(
        text, block_size=block, num_layers=layers, draft_vocab_size=draft_vocab, mask_token_id=text.vocab_size - 1,
        target_layers=tuple(sorted({2, n // 2, n - 2})), **({"markov_rank": markov_rank} if kind == "dspark" else {}))
    module = BlockHead(dims).to(device=model.device, dtype=model.dtype)
    module.set_vocab_map(torch.randperm(text.vocab_size)[:draft_vocab].sort().values)
    return BlockDrafter(module, model, TreeConfig(depth=dims.drafts_per_block, top_k=1, max_nodes=block))


def syncs_per_forward(gpu, target, drafter, prompt: list[int], n_new: int) -> list[float] | None:
    """Synchronising CUDA operations per target forward, as torch's sync debug mode reports them (nonzero,
    boolean indexing, blocking copies: what a Python-level count misses), greedy and sampled; None off CUDA."""
    from selfdraft.configs.decode import DecodeConfig
    from selfdraft.inference.batch import BatchSession
    from selfdraft.inference.decode import speculative_decode

    if gpu.device.type != "cuda":
        return None
    counts = []
    for config in (DecodeConfig(max_new_tokens=n_new, stop_on_eos=False),
                   DecodeConfig(max_new_tokens=n_new, temperature=0.8, top_p=0.95, seed=7, stop_on_eos=False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gpu.torch.cuda.set_sync_debug_mode("warn")
            try:
                out = speculative_decode(BatchSession(target.model, hidden_layers=drafter.hidden_layers), prompt, drafter, config)
            finally:
                gpu.torch.cuda.set_sync_debug_mode("default")
        counts.append(round(sum("synchroniz" in str(w.message) for w in caught) / out.stats.target_forwards, 1))
    return counts


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_is_greedy_exact_and_seeded_sampling_reproducible(gpu, smollm2_fp32, name):
    """fp32 on the device: the drafter's greedy output equals transformers' generate(), token for token;
    sampling with one seed twice gives the same tokens."""
    from selfdraft.configs.decode import DecodeConfig
    from selfdraft.inference.batch import BatchSession
    from selfdraft.inference.decode import speculative_decode

    target, prompts, references, n_new = smollm2_fp32
    drafter = random_drafter(name, target)
    same, forwards, tokens, start = 0, 0, 0, gpu.clock()
    for ids, ref in zip(prompts, references):
        session = BatchSession(target.model, hidden_layers=drafter.hidden_layers)
        out = speculative_decode(session, ids, drafter, DecodeConfig(max_new_tokens=n_new, stop_on_eos=False))
        same += out.token_ids == ref
        forwards += out.stats.target_forwards
        tokens += len(out.token_ids)
    seconds = gpu.clock() - start
    sampled = [speculative_decode(BatchSession(target.model, hidden_layers=drafter.hidden_layers), prompts[0], drafter,
                                  DecodeConfig(max_new_tokens=n_new, temperature=0.8, top_p=0.95, seed=7,
                                               stop_on_eos=False)).token_ids for _ in range(2)]
    row = {"exact_prompts": f"{same}/{len(prompts)}", "tau": round(tokens / forwards, 3),
           "tokens_per_second": round(tokens / seconds, 1), "sampling_reproducible": sampled[0] == sampled[1],
           "syncs_per_forward": syncs_per_forward(gpu, target, drafter, prompts[0], n_new)}
    drafters = gpu.section("exactness_fp32").get("drafters", {})
    gpu.record("exactness_fp32", new_tokens=n_new, drafters={**drafters, name: row})
    assert same == len(prompts), row
    assert sampled[0] == sampled[1], row


def train_steps(gpu, target, kind: str, batch: int, length: int, steps: int) -> dict:
    """A few optimizer steps of ``kind`` on a bf16 target under bf16 autocast: time, peak memory, losses."""
    from selfdraft.configs.run import load_run_config
    from selfdraft.train.objectives import build_objective

    torch = gpu.torch
    vocab = target.model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(batch, length, dtype=torch.long)
    loss_mask[:, : length // 8] = 0  # a prompt
    data = [(ids[b].numpy(), loss_mask[b].numpy()) for b in range(batch)]
    tensors = [t.to(gpu.device) for t in (ids, torch.ones(batch, length, dtype=torch.long), loss_mask)]
    vocab_option = {"eagle3": ["drafter.eagle.draft_vocab_size=32000"], "dflash": ["drafter.block.draft_vocab_size=32000"],
                    "dspark": ["drafter.block.draft_vocab_size=32000"]}.get(kind, [])
    config = load_run_config("smoke_cpu", [f"drafter.kind={kind}", *vocab_option])
    objective = build_objective(config, target.model, data).to(gpu.device)
    objective.train()
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    losses, times = [], []
    gpu.reset_peak()
    for step in range(steps + 1):  # the first step warms up (kernels, allocator), untimed
        start = gpu.clock()
        with torch.autocast(gpu.device.type, dtype=torch.bfloat16):
            loss, _ = objective(*tensors)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step:
            times.append(gpu.clock() - start)
    per_step = statistics.median(times)
    return {"batch": f"{batch}x{length}", "vocab": vocab, "trainable_params_m": round(sum(p.numel() for p in params) / 1e6, 1),
            "seconds_per_step": round(per_step, 4), "tokens_per_second": round(batch * length / per_step),
            "peak_memory_gib": gpu.peak_gib(), "losses": [round(x, 4) for x in losses],
            "finite": all(x == x and abs(x) != float("inf") for x in losses)}


@pytest.fixture(scope="module")
def smollm2_bf16(gpu):
    return gpu.target("smollm2", gpu.torch.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_in_bf16_are_finite(gpu, smollm2_bf16, kind):
    row = train_steps(gpu, smollm2_bf16, kind, *((2, 128, 2) if gpu.tiny else (4, 2048, 5)))
    gpu.record("training_bf16", **{kind: row})
    assert row["finite"] and row["tokens_per_second"] > 0, row


@pytest.mark.parametrize("kind", ("eagle3", "dspark"))
def test_training_steps_at_a_128k_vocabulary(gpu, llama8b, kind):
    target = llama8b if not gpu.tiny else gpu.target("llama8b", gpu.torch.bfloat16)
    row = train_steps(gpu, target, kind, *((1, 128, 1) if gpu.tiny else (2, 2048, 3)))
    gpu.record("training_bf16_128k_vocab", **{kind: row})
    assert row["finite"] and row["vocab"] == 128256, row


def test_the_cost_surface_on_the_device(gpu, llama8b):
    """T(B, m) of the 8B shape, measured by the product's own cost model (what every drafting decision on
    this device would read): positive, and no cheaper for more tokens per row."""
    from selfdraft.inference.costs import measure_cost_surface

    batches, tokens = ((1, 4), (1, 2, 4)) if gpu.tiny else ((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 32, 64, 128))
    surface = measure_cost_surface(llama8b, batches, tokens, reps=2 if gpu.tiny else 5)
    gpu.record("cost_surface", surface=surface.to_dict(), table=surface.table())
    print(surface.table())
    assert all(t > 0 for row in surface.seconds for t in row)
    assert all(list(row) == sorted(row) for row in surface.seconds)


def test_drafter_proposal_costs_on_the_device(gpu, llama8b):
    """D(1) by the product's own measurement: EAGLE-3 (draft vocabulary 32k, top_k 10, 60 nodes) by tree
    depth, and DFlash / DSpark by block size and draft layers."""
    from selfdraft.configs.decode import TreeConfig
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
    from selfdraft.inference.costs import measure_draft_cost

    torch, model = gpu.torch, llama8b.model
    vocab = model.config.get_text_config().vocab_size
    reps = 3 if gpu.tiny else 10
    torch.manual_seed(3)
    module = new_drafter(model, "eagle3", draft_vocab_size=32000)
    module.set_vocab_map(torch.randperm(vocab)[:32000].sort().values)
    eagle = {str(depth): round(1e3 * measure_draft_cost(llama8b, EagleTreeDrafter(module, model, TreeConfig(depth=depth, top_k=10, max_nodes=60)), reps=reps), 3)
             for depth in range(1, 4 if gpu.tiny else 9)}
    blocks = {f"{kind} block {block} layers {layers}": round(1e3 * measure_draft_cost(llama8b, block_drafter(kind, model, block, layers, 32000, 64 if gpu.tiny else 256), reps=reps), 3)
              for kind in ("dflash", "dspark") for block, layers in (((4, 1),) if gpu.tiny else ((8, 1), (16, 1), (8, 5), (16, 5)))}
    gpu.record("draft_cost", eagle3_propose_ms=eagle, block_propose_ms=blocks)
    assert all(ms > 0 for ms in [*eagle.values(), *blocks.values()])


def test_selfdraft_bench_on_the_device(gpu, smollm2_fp32):
    """``selfdraft bench`` on the device, fp32, prompt lookup and a random EAGLE-3 folder drafting every step
    (policy=fixed: its acceptance and depth are what the prediction reads): exact, and its machine record."""
    from selfdraft.heads.io import DrafterRecord, save_drafter
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.inference.bench.run import run_bench

    target = smollm2_fp32[0]
    gpu.torch.manual_seed(4)
    module = new_drafter(target.model, "eagle3", draft_vocab_size=4096)
    module.set_vocab_map(gpu.torch.arange(4096))
    folder = save_drafter(gpu.path.parent / "random-eagle3", module, DrafterRecord(kind="eagle3", dims=module.dims, target=target.identity))
    tasks = [str(gpu.assets / "mt_bench.jsonl"), str(gpu.assets / "humaneval.jsonl")]
    results = run_bench(target, ["prompt-lookup", f"{folder}@policy=fixed"], tasks, max_new_tokens=32 if gpu.tiny else 96,
                        limit=2 if gpu.tiny else 4, out=gpu.path.parent / "bench", plots=False, progress=False,
                        command="pytest -m gpu tests/gpu", fresh=True)
    rows = [{k: r[k] for k in ("task", "method", "tokens_per_second", "speedup", "acceptance_length", "exact")} for r in results["rows"]]
    gpu.record("bench", rows=rows, machine=results["meta"].get("machine"), results=str(gpu.path.parent / "bench"))
    assert all(r["exact"] for r in rows), rows
    assert results["meta"]["machine"]["gpu" if gpu.device.type == "cuda" else "cpu_flags"] is not None


def predict(bench: dict, surface, eagle_ms: dict) -> list[dict]:
    """For each drafter row of a bench at temperature 0: the speed-up its acceptance length gives with this
    device's costs (and, for EAGLE rows, the EAGLE-3 proposal at its depth), by the product's cost model."""
    from selfdraft.inference.costs import speedup

    rows = []
    for r in bench["rows"]:
        if r["temperature"] != 0 or r["baseline"] or r.get("acceptance_length") is None or r.get("draft_nodes_per_step") is None:
            continue
        depth = max((int(d) for d in (r.get("per_depth_acceptance") or {})), default=0)
        draft = eagle_ms.get(str(depth), 0.0) / 1e3 if "eagle" in r["method"] and not r["method"].startswith("vllm") else 0.0
        verify, plain = surface(1, 1 + r["draft_nodes_per_step"]), surface(1, 1)
        rows.append({"task": pathlib.Path(r["task"]).stem, "method": r["method"], "tau": round(r["acceptance_length"], 3),
                     "nodes": round(r["draft_nodes_per_step"], 1), "depth": depth, "verify_ms": round(1e3 * verify, 3),
                     "draft_ms": round(1e3 * draft, 3), "plain_ms": round(1e3 * plain, 3),
                     "predicted_speedup": round(speedup(r["acceptance_length"], verify + draft, plain), 2),
                     "measured_speedup": round(r["speedup"], 2)})
    return rows


def test_the_cost_model_predicts_speedups_from_measured_acceptance(gpu):
    """Acceptance lengths from a bench (``SELFDRAFT_CPU_BENCH``: trained drafters on a CPU; else this
    device's bench) with this device's measured costs: the speed-ups the product's cost model predicts."""
    from selfdraft.inference.costs import CostSurface

    costs, draft, bench_run = gpu.section("cost_surface"), gpu.section("draft_cost"), gpu.section("bench")
    if not costs or not bench_run:
        pytest.skip("needs the cost surface and the bench of this run (run the whole module)")
    source = os.environ.get("SELFDRAFT_CPU_BENCH") or str(pathlib.Path(bench_run["results"]) / "results.json")
    rows = predict(json.loads(pathlib.Path(source).read_text()), CostSurface.from_dict(costs["surface"]),
                   draft.get("eagle3_propose_ms", {}))
    gpu.record("prediction", source=source, rows=rows)
    print("| task | method | tau | nodes | verify ms | draft ms | plain ms | predicted speed-up | measured there |")
    for r in rows:
        print(f"| {r['task']} | {r['method']} | {r['tau']:.2f} | {r['nodes']} | {r['verify_ms']:.2f} | {r['draft_ms']:.2f} | "
              f"{r['plain_ms']:.2f} | {r['predicted_speedup']:.2f}x | {r['measured_speedup']:.2f}x |")
    assert rows and all(r["predicted_speedup"] > 0 for r in rows)
    for r in rows:
        assert r["plain_ms"] > 0 and (r["draft_ms"] > 0) == ("eagle" in r["method"]), r
