"""``selfdraft bench --batch-sizes 1,4,16``: tokens/s per batch size, our loop with and without each drafter
beside transformers' batched ``generate()`` and vLLM with that many requests in flight.

A speculative decoder spends a step's spare compute on draft tokens; a batch spends it on other rows.
So a drafter's gain shrinks as the batch grows and can turn into a loss: the only honest figure is
tokens/s measured at the batch sizes a deployment runs. For every method and batch size B the prompts
are decoded in consecutive groups of B (the last one smaller when B does not divide them), one group
at a time, after a short warm-up on the first group; tokens/s = all new tokens / the summed wall time of the groups.

Methods: our loop (``none``, ``prompt-lookup``, ``copy``, ``draft-model:SPEC``, ``hybrid:SPEC``, a drafter
folder; each group through :func:`~selfdraft.inference.batch.batched_decode` under the drafting policy,
``--policy``: by default the folder's speculation profile where it has one, else the adaptive policy of
inference/policy.py, one per batch size, learning across its groups), ``hf-greedy`` (``generate()`` on the group, left
padded) and ``vllm:FOLDER`` / ``vllm:none`` (the group handed to the engine in one call, as a server sees
B concurrent requests). Greedy only: every row is compared with ``none``'s output at batch 1.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Sequence

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.files import write_atomic
from selfdraft.inference.bench.common import BASELINE
from selfdraft.inference.bench.methods import parse_method, split_methods
from selfdraft.inference.bench.runners import HFRunner, LoopRunner, VllmRunner
from selfdraft.inference.bench.tasks import task_prompts

RESULTS = "batches.json"
REPORT = "batches.md"
PLOT = "batches.png"


def _groups(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


def _trim(tokens: list[int], eos: set[int]) -> list[int]:
    """New tokens up to and including the first EOS (generate() pads finished rows after it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _loop_group(runner: LoopRunner, group, max_new_tokens: int, policy) -> tuple[list[list[int]], int, int]:
    """Our batched loop on one group: (tokens per row, row-steps, drafted row-steps)."""
    from selfdraft.inference.batch import BatchSession
    from selfdraft.inference.decode import batched_decode

    target, drafter = runner.target, runner.drafter
    outs = batched_decode(BatchSession(target.model, hidden_layers=drafter.hidden_layers), group, drafter,
                          DecodeConfig(max_new_tokens=max_new_tokens), eos_token_ids=target.eos_token_ids,
                          max_context=target.max_context, policy=policy)
    return ([o.token_ids for o in outs], sum(o.stats.target_forwards for o in outs),
            sum(o.stats.drafted_steps for o in outs))


def _hf_group(runner: HFRunner, group, max_new_tokens: int) -> tuple[list[list[int]], None, None]:
    """transformers' generate() on one left-padded group: (tokens per row, None, None)."""
    model = runner.target.model
    width = max(map(len, group))
    pad = runner.fixed["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(g)) + list(g) for g in group], device=model.device)
    mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **runner.fixed)
    eos = set(runner.target.eos_token_ids)
    return [_trim(row[width:].tolist(), eos) for row in out], None, None


def _timed_groups(decode, prompts, size: int, max_new_tokens: int):
    """A short warm-up on the first group, then every group of ``size`` timed: (tokens, row-steps, drafted,
    seconds)."""
    groups = _groups(prompts, size)
    decode(groups[0], min(max_new_tokens, 4))
    tokens, steps, drafted, seconds = [], 0, 0, 0.0
    for g in groups:
        start = time.perf_counter()
        t, n, d = decode(g, max_new_tokens)
        seconds += time.perf_counter() - start
        tokens += t
        steps, drafted = (None, None) if n is None else (steps + n, drafted + d)
    return tokens, steps, drafted, seconds


def _vllm_groups(runner: VllmRunner, prompts, size: int, max_new_tokens: int):
    """vLLM with ``size`` requests in flight, timed by vLLM: (tokens, engine tau or None, seconds)."""
    from selfdraft.inference.vllm_engine import run_vllm

    out = run_vllm(runner.target_path, prompts, max_new_tokens, speculative=runner.speculative, dtype=runner.dtype,
                   max_model_len=runner.max_model_len, warmup=[prompts[0]], in_process=runner.in_process,
                   concurrency=size)
    runner.version = f"vllm {out['vllm_version']}"
    parts = out["results"] if size == 1 else out["batches"]
    tokens = [r["token_ids"] for r in parts] if size == 1 else [t for b in parts for t in b["token_ids"]]
    drafts, accepted = sum(r["drafts"] for r in parts), sum(r["accepted_tokens"] for r in parts)
    return tokens, (1 + accepted / drafts if drafts else None), sum(r["seconds"] for r in parts)


def run_batch_bench(target, methods: str | Sequence[str], tasks: str | Sequence[str], batch_sizes: Sequence[int],
                    max_new_tokens: int = 64, limit: int | None = 16, out: str | os.PathLike = "bench", *,
                    dtype: str = "auto", device: str = "cpu", policy: str = "auto", plots: bool = True,
                    progress: bool = True, command: str | None = None) -> dict:
    """Tokens/s of every method at every batch size (module docstring); writes ``out``/batches.json,
    batches.md and batches.png (atomically) and returns what batches.json holds. ``policy``: how much our
    loop drafts where a method does not say (inference/policy.py): ``auto``, a drafter folder with a
    speculation profile drafts per batch size what the profile says pays, any other drafter while drafting
    pays by the measured costs; ``fixed``, the drafter's tree every step."""
    from selfdraft.configs.decode import POLICIES
    from selfdraft.inference.api import encode_prompt
    from selfdraft.inference.batch import check_batch_fits
    from selfdraft.machine import describe

    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise SelfdraftError(f"batch sizes must be integers >= 1, got {list(batch_sizes)}")
    if policy not in POLICIES:
        raise SelfdraftError(f"unknown drafting policy {policy!r}; choose one of {', '.join(POLICIES)}")
    choices = [parse_method(m) for m in (split_methods(methods) if isinstance(methods, str) else methods)]
    if not any(c.label == BASELINE for c in choices):
        choices.insert(0, parse_method(BASELINE))
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise SelfdraftError("no task given")
    if isinstance(target, str):
        from selfdraft.heads.target import load_target

        target = load_target(target, dtype=dtype, device=device)
    prompts = [encode_prompt(target.tokenizer, p.text, p.chat) for task in names for p in task_prompts(task, limit)]
    if not prompts:
        raise SelfdraftError(f"tasks {names} hold no prompts")
    check_batch_fits(target.model, sizes[-1], max(map(len, prompts)) + max_new_tokens)
    runners = _batched_runners(target, choices, sizes, policy)
    rows = _timed_rows(runners, prompts, sizes, max_new_tokens, policy, progress)
    for row in rows:
        base = next(r for r in rows if r["method"] == BASELINE and r["batch"] == row["batch"])
        row["speedup"] = row["tokens_per_second"] / base["tokens_per_second"]
    results = {"meta": {"target": target.identity.name, "dtype": str(target.dtype), "device": str(target.device),
                        "batch_sizes": sizes, "tasks": names, "max_new_tokens": max_new_tokens, "prompts": len(prompts),
                        "policy": policy, "machine": describe(str(target.device)), "command": command,
                        "engines": {label: r.version for label, r in runners.items() if isinstance(r, VllmRunner)}},
               "rows": rows}
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / RESULTS, json.dumps(results, indent=1))
    write_atomic(out / REPORT, batch_table(results) + "\n")
    if plots:
        _plot(results, out / PLOT)
    return results


def _batched_runners(target, choices, sizes: list[int], policy: str) -> dict:
    """The methods' runners, each a method the batched bench runs; our loop's policies (their costs) are
    made for every size before anything is timed."""
    runners = {}
    for c in choices:
        runner = c.method.build(target, c.argument, c.options)
        if not (isinstance(runner, (LoopRunner, VllmRunner))
                or (isinstance(runner, HFRunner) and not runner.extra and runner.assistant is None)):
            raise SelfdraftError(f"{c.label}: batched, the bench runs our loop's methods, hf-greedy and vllm:FOLDER; "
                                 "transformers' prompt lookup and assisted generation decode one prompt at a time")
        runners[c.label] = runner
        if isinstance(runner, LoopRunner):
            for size in sizes:
                runner.policy_at(size, policy)
    return runners


def _timed_rows(runners: dict, prompts: list[list[int]], sizes: list[int], max_new_tokens: int, policy: str,
                progress: bool) -> list[dict]:
    """One row per (batch size, method): tokens, seconds, acceptance, and how many rows equal the baseline's
    at batch 1."""
    from tqdm import tqdm

    rows, reference = [], None
    bar = tqdm(total=len(runners) * len(sizes), desc="batched bench", disable=not progress)
    for size in sizes:
        for label, runner in runners.items():
            tau = drafted = None
            if isinstance(runner, VllmRunner):
                tokens, tau, seconds = _vllm_groups(runner, prompts, size, max_new_tokens)
            else:
                decode = (lambda g, n: _hf_group(runner, g, n)) if isinstance(runner, HFRunner) else \
                    (lambda g, n: _loop_group(runner, g, n, runner.policy_at(size, policy)))
                tokens, steps, drafted, seconds = _timed_groups(decode, prompts, size, max_new_tokens)
                tau = sum(map(len, tokens)) / steps if steps else None
            if label == BASELINE and size == 1:
                reference = tokens
            new = sum(map(len, tokens))
            rows.append({"method": label, "batch": size, "prompts": len(prompts), "new_tokens": new, "seconds": seconds,
                         "tokens_per_second": new / seconds if seconds > 0 else None, "acceptance_length": tau,
                         "drafted_row_steps": drafted,
                         "exact_rows": None if reference is None else sum(a == b for a, b in zip(tokens, reference))})
            bar.update(1)
    bar.close()
    return rows


def batch_table(results: dict) -> str:
    """Markdown: per method, tokens/s and speedup over ``none`` at each batch size, then exact rows."""
    sizes = results["meta"]["batch_sizes"]
    methods = list(dict.fromkeys(r["method"] for r in results["rows"]))
    cell = {(r["method"], r["batch"]): r for r in results["rows"]}
    lines = ["| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for m in methods:
        parts = []
        for b in sizes:
            r = cell[(m, b)]
            tau = f", tau {r['acceptance_length']:.2f}" if r["acceptance_length"] else ""
            exact = "" if r["exact_rows"] is None or r["exact_rows"] == r["prompts"] else \
                f", **{r['exact_rows']}/{r['prompts']} exact**"
            parts.append(f"{r['tokens_per_second']:.1f} tok/s ({r['speedup']:.2f}x{tau}{exact})")
        lines.append(f"| {m} | " + " | ".join(parts) + " |")
    meta = results["meta"]
    lines.append("")
    lines.append(f"{meta['prompts']} prompts ({', '.join(meta['tasks'])}), {meta['max_new_tokens']} new tokens, greedy; "
                 f"{meta['target']} {meta['dtype']} on {meta['machine']['cpu'] if meta['device'] == 'cpu' else meta['device']}; "
                 "speedup over our loop without a drafter at the same batch size; rows compared with it at batch 1.")
    return "\n".join(lines)


def _plot(results: dict, path: pathlib.Path) -> None:
    from selfdraft.inference.bench.plots import _figure, _png

    figure, (ax,) = _figure(1)
    for m in dict.fromkeys(r["method"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["method"] == m]
        ax.plot([r["batch"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests decoded together)")
    ax.set_ylabel("tokens/s (all rows)")
    ax.set_title(f"{results['meta']['target']}: throughput by batch size")
    ax.legend(fontsize=7)
    write_atomic(path, _png(figure))
