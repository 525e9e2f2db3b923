"""The run loop: :func:`run_bench` times every method on every prompt and tallies the rows of the results."""

from __future__ import annotations

import logging
import os
import pathlib
import platform
import shlex
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import NamedTuple, Sequence

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError
from selfdraft.machine import cpu_flags, cpu_name, isa_caps
from selfdraft.inference.bench.common import BASELINE
from selfdraft.inference.bench.journal import JOURNAL, Journal, _ids_digest, _settings
from selfdraft.inference.bench.methods import MethodChoice, parse_method, split_methods
from selfdraft.inference.bench.plots import _short, method_labels
from selfdraft.inference.bench.report import write_outputs
from selfdraft.inference.bench.runners import Generation
from selfdraft.inference.bench.tasks import TASKS, _split, parse_temperatures, task_prompts
from selfdraft.inference.prompts import Prompt

logger = logging.getLogger(__name__)


@dataclass
class _Tally:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    forwards: int | None = 0
    histogram: Counter | None = field(default_factory=Counter)
    drafted: Counter | None = field(default_factory=Counter)
    accepted: Counter | None = field(default_factory=Counter)
    draft_seconds: float | None = 0.0
    engine_steps: int | None = 0
    engine_accepted: int | None = 0
    draft_nodes: int | None = 0
    drafted_steps: int | None = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def add(self, prompt_id: str, g: Generation, seconds: float) -> None:
        self.prompts += 1
        self.tokens += len(g.token_ids)
        self.seconds += seconds
        self.outputs[prompt_id] = g.token_ids
        self.forwards = None if self.forwards is None or g.target_forwards is None else self.forwards + g.target_forwards
        self.histogram = None if self.histogram is None or g.accept_histogram is None else self.histogram + Counter(g.accept_histogram)
        if self.drafted is None or g.depth_drafted is None or g.depth_accepted is None:
            self.drafted = self.accepted = None
        else:
            self.drafted.update(g.depth_drafted)
            self.accepted.update(g.depth_accepted)
        self.draft_seconds = None if self.draft_seconds is None or g.draft_seconds is None else self.draft_seconds + g.draft_seconds
        self.draft_nodes = None if self.draft_nodes is None or g.draft_nodes is None else self.draft_nodes + g.draft_nodes
        self.drafted_steps = None if self.drafted_steps is None or g.drafted_steps is None else self.drafted_steps + g.drafted_steps
        # The engines' count: verification steps after the prefill, and the draft tokens they accepted
        # (each step emits its accepted tokens + 1; the prefill emits one token).
        steps = g.engine_steps or ((g.target_forwards - 1, len(g.token_ids) - g.target_forwards)
                                   if g.target_forwards is not None else None)
        if self.engine_steps is None or steps is None:
            self.engine_steps = self.engine_accepted = None
        else:
            self.engine_steps += steps[0]
            self.engine_accepted += steps[1]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix of the other, else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed every method uses for one prompt (stable whatever --limit selects)."""
    return (seed + zlib.crc32(prompt_id.encode("utf-8"))) % 2**31


def _gpu(device: torch.device) -> dict | None:
    """Name, memory, compute capability, driver and CUDA runtime of the GPU that ran, or None."""
    if device.type != "cuda":
        return None
    import subprocess

    props = torch.cuda.get_device_properties(device)
    driver = None
    try:  # torch has no public call for the driver version; nvidia-smi has it
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={index}"],
                                capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"name": props.name, "memory_gb": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "driver": driver, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> float:
    import time

    _sync(device)
    return time.perf_counter()


def run_bench(
    target,
    methods: str | Sequence[str],
    tasks: str | Sequence[str],
    temperatures: str | Sequence[float] = (0.0,),
    max_new_tokens: int = DecodeConfig.max_new_tokens,
    limit: int | None = 10,
    out: str | os.PathLike = "bench",
    *,
    dtype: str = "auto",
    device: str = "cpu",
    threads: int | None = None,
    seed: int = 0,
    plots: bool = True,
    progress: bool = True,
    command: str | None = None,
    fresh: bool = False,
) -> dict:
    """Run every method on every prompt of every task at every temperature; write ``out``/results.json,
    report.md and plots; return the results (what results.json holds).

    Finished prompts are journaled in ``out``/progress.jsonl (see :class:`Journal`): a rerun with the
    same settings reuses them and decodes only the rest, so an interrupted bench continues where it
    stopped and a larger ``limit`` adds prompts to a finished one. ``fresh`` discards the journal.

    ``target`` is a spec for :func:`~selfdraft.heads.target.load_target` (loaded with ``dtype`` and
    ``device``) or a loaded Target. ``methods``, ``tasks`` and ``temperatures`` are lists or
    comma-separated strings. ``limit`` caps the prompts per task (None: all). ``threads`` sets torch's
    thread count for the run (restored afterwards). Bad names and options are SelfdraftErrors raised
    before anything is decoded.
    """
    choices, task_names, temps, prompts, out = _checked(methods, tasks, temperatures, max_new_tokens, limit, threads,
                                                        plots, out)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if isinstance(target, str):
            from selfdraft.heads.target import load_target

            target = load_target(target, dtype=dtype, device=device)
        encoded = _encoded(target, prompts, max_new_tokens)
        runners = {c.label: c.method.build(target, c.argument, c.options) for c in choices}
        skipped = [{"method": c.label, "temperature": t,
                    "reason": f"{c.method.name} runs at temperature 0 only" if c.method.temperatures == "greedy"
                    else f"{c.method.name} runs at temperature > 0 only"}
                   for t in temps for c in choices if not c.method.applies(t)]
        journal = Journal(out, _settings(target, choices, max_new_tokens, seed), fresh=fresh)
        plan = [_Item(task, t, index, prompt, ids, digest, active,
                      journal.get(task, t, prompt.id, digest, [c.label for c in active]))
                for task, items in encoded.items() for t in temps
                for active in [[c for c in choices if c.method.applies(t)]]
                for index, (prompt, ids) in enumerate(items) for digest in [_ids_digest(ids)]]
        reused = sum(1 for item in plan if item.done is not None)
        if reused < len(plan):
            if reused:
                logger.info("bench: %d of %d prompts are in %s from an earlier run with the same settings; decoding "
                            "the rest", reused, len(plan), journal.path)
            _warm_up(runners, choices, plan, next(ids for items in encoded.values() for _, ids in items), temps, seed,
                     max_new_tokens)
        tallies, by_category = _decode(plan, runners, method_labels([c.label for c in choices]), journal, seed,
                                       max_new_tokens, target.device, progress)
        meta = _meta(target, choices, task_names, temps, max_new_tokens, limit, seed, command)
        for c in choices:  # an engine in another process says which version ran (None: all prompts reused)
            if hasattr(runners[c.label], "version"):
                meta["methods"][c.label]["engine_version"] = runners[c.label].version
        meta["journal"] = {"path": JOURNAL, "prompts": len(plan), "reused": reused,
                           "note": "every method of a prompt is timed back to back in one session; reused prompts "
                                   "come from an earlier session with the same settings"}
    finally:
        torch.set_num_threads(old_threads)

    rows, category_rows = _rows(task_names, temps, choices, encoded, tallies, by_category)
    results = {"meta": meta, "rows": rows, "category_rows": category_rows, "skipped": skipped,
               "prompts": {task: [p.id for p, _ in items] for task, items in encoded.items()}}
    _warn_if_inexact(rows, meta["dtype"])
    write_outputs(results, out, plots=plots)
    return results


def _checked(methods, tasks, temperatures, max_new_tokens, limit, threads, plots, out):
    """run_bench's arguments checked and parsed, before anything is loaded: (method choices with the
    baseline first, task names, temperatures, prompts by task, the output folder, created)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SelfdraftError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise SelfdraftError(f"limit must be an integer >= 1 (or None for every prompt), got {limit!r}")
    if threads is not None and threads < 1:
        raise SelfdraftError(f"threads must be >= 1, got {threads}")
    temps = parse_temperatures(temperatures)
    choices = [parse_method(m) for m in (split_methods(methods) if isinstance(methods, str) else methods)]
    if not any(c.label == BASELINE for c in choices):
        choices.insert(0, parse_method(BASELINE))
    labels = [c.label for c in choices]
    if len(set(labels)) != len(labels):
        raise SelfdraftError(f"a method is listed twice: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
    task_names = _split(tasks)
    if not task_names:
        raise SelfdraftError(f"no task given; valid tasks: {', '.join(TASKS)}, or the path of a JSONL prompts file")
    if len(set(task_names)) != len(task_names):
        raise SelfdraftError(f"a task is listed twice in {task_names}")
    prompts = {task: task_prompts(task, limit) for task in task_names}
    if plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise SelfdraftError("the plots need matplotlib: pip install 'selfdraft[bench]' (or matplotlib), or pass --no-plots")
    out = pathlib.Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)  # fail now, not after the run
    except OSError as err:
        raise SelfdraftError(f"cannot create the output folder {out}: {err}") from err
    return choices, task_names, temps, prompts, out


def _encoded(target, prompts: dict[str, list[Prompt]], max_new_tokens: int) -> dict[str, list[tuple[Prompt, list[int]]]]:
    """Every task's prompts with their token ids; a prompt that leaves no room for the answer is an error."""
    from selfdraft.inference.api import encode_prompt

    encoded: dict[str, list[tuple[Prompt, list[int]]]] = {}
    for task, items in prompts.items():
        encoded[task] = []
        for prompt in items:
            ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
            if len(ids) + max_new_tokens > target.max_context:
                raise SelfdraftError(
                    f"prompt {prompt.id} of task {task} has {len(ids)} tokens; with max_new_tokens {max_new_tokens} "
                    f"it needs {len(ids) + max_new_tokens} positions but the target holds {target.max_context}")
            encoded[task].append((prompt, ids))
    return encoded


class _Item(NamedTuple):
    """One prompt of one task at one temperature: what the bench decodes (or reuses) with every method."""

    task: str
    t: float
    index: int
    prompt: Prompt
    ids: list[int]
    digest: str
    active: list[MethodChoice]
    """The methods that run at this temperature."""
    done: dict | None
    """The journaled (generation, seconds) per method, from an earlier run; None: to decode."""


def _warm_up(runners, choices, plan: list[_Item], warm_ids: list[int], temps, seed: int, max_new_tokens: int) -> None:
    """Give runners in another process (an engine) every call at once, then run each method once untimed."""
    for c in choices:
        if hasattr(runners[c.label], "prepare"):
            calls = [(item.ids, item.t, prompt_seed(seed, item.prompt.id) if item.t > 0 else None, max_new_tokens)
                     for item in plan if item.done is None and c in item.active]
            warm = [(warm_ids, t, prompt_seed(seed, "warm-up"), max_new_tokens) for t in temps if c.method.applies(t)][:1]
            runners[c.label].prepare(warm + calls)
    for c in choices:
        t = next((t for t in temps if c.method.applies(t)), None)
        if t is not None:
            runners[c.label](warm_ids, t, prompt_seed(seed, "warm-up"), max_new_tokens)


def _decode(plan: list[_Item], runners, short: dict[str, str], journal: Journal, seed: int, max_new_tokens: int,
            dev: torch.device, progress: bool):
    """Decode every prompt of ``plan`` not journaled yet with each of its methods (their order rotated from
    prompt to prompt), journal it, and tally everything: (per (task, t, method), per (task, category, t, method))."""
    from tqdm import tqdm

    tallies: dict[tuple[str, float, str], _Tally] = {}
    by_category: dict[tuple[str, str, float, str], _Tally] = {}
    bar = tqdm(total=sum(len(item.active) for item in plan), file=sys.stderr, disable=not progress,
               unit="gen", dynamic_ncols=True)
    try:
        for item in plan:
            done = item.done
            if done is None:
                bar.set_description(f"{item.task} T={item.t:g}")
                s = prompt_seed(seed, item.prompt.id) if item.t > 0 else None
                shift = item.index % len(item.active)
                done = {}
                for c in item.active[shift:] + item.active[:shift]:
                    bar.set_postfix_str(_short(short[c.label], 48), refresh=False)
                    start = _clock(dev)
                    generation = runners[c.label](item.ids, item.t, s, max_new_tokens)
                    elapsed = _clock(dev) - start
                    done[c.label] = (generation, generation.seconds if generation.seconds is not None else elapsed)
                    bar.update(1)
                journal.add(item.task, item.t, item.prompt.id, item.digest, done)
            else:
                bar.update(len(item.active))
            for c in item.active:
                tallies.setdefault((item.task, item.t, c.label), _Tally()).add(item.prompt.id, *done[c.label])
                if item.prompt.category:
                    by_category.setdefault((item.task, item.prompt.category, item.t, c.label),
                                           _Tally()).add(item.prompt.id, *done[c.label])
    finally:
        bar.close()
    return tallies, by_category


def _rows(task_names, temps, choices, encoded, tallies, by_category) -> tuple[list[dict], list[dict]]:
    """The results' rows per (task, temperature, method), and the same per category where a task's prompts
    span more than one."""
    rows = []
    for task in task_names:
        for t in temps:
            base = tallies[(task, t, BASELINE)]
            rows += [_row(task, t, c, tallies[(task, t, c.label)], base) for c in choices if (task, t, c.label) in tallies]
    category_rows = []
    for task in task_names:
        categories = list(dict.fromkeys(p.category for p, _ in encoded[task] if p.category))
        for category in categories if len(categories) > 1 else []:
            for t in temps:
                base = by_category[(task, category, t, BASELINE)]
                category_rows += [{"category": category, **_row(task, t, c, by_category[(task, category, t, c.label)], base)}
                                  for c in choices if (task, category, t, c.label) in by_category]
    return rows, category_rows


def _warn_if_inexact(rows: list[dict], dtype: str) -> None:
    for row in rows:
        if row["exact"] is False:
            shown = ", ".join(f"{m['prompt_id']} at token {m['first_divergence']}" for m in row["mismatches"][:5])
            hint = ("; in bf16/fp16 a forward over several tokens rounds differently from one over a single token, "
                    "compare in float32") if dtype != "float32" else "; in float32 this is a bug"
            logger.warning("%s is not token-identical to %s on task %s at temperature 0: %d of %d prompts differ "
                           "(first divergence: %s)%s", row["method"], BASELINE, row["task"], len(row["mismatches"]),
                           row["prompts"], shown, hint)


def _meta(target, choices, tasks, temps, max_new_tokens, limit, seed, command) -> dict:
    import transformers

    from selfdraft import __version__

    dev = target.device
    return {
        "target": target.identity.name,
        "target_identity": target.identity.to_dict(),
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "selfdraft": __version__,
        "python": platform.python_version(),
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_name(),
                    "cpu_flags": cpu_flags(), "isa_caps": isa_caps(), "cpus": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "gpu_details": _gpu(dev)},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else shlex.join(sys.argv),
        "methods": {c.label: {"method": c.method.name, "argument": c.argument, "options": c.options,
                              "description": c.method.help} for c in choices},
        "baseline": BASELINE,
        "tasks": list(tasks),
        "temperatures": temps,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "seed": seed,
        "speedup": f"tokens/s of the method / tokens/s of {BASELINE} on the same task and temperature",
        "timing": "wall clock around each generation (prompt ids in, new token ids out), warm-up excluded; "
                  "vllm methods: vLLM's own wall clock around each prompt's generate() in its process",
        "acceptance_length": "new tokens / target forwards, the prefill included (selfdraft's tau)",
        "engine_acceptance_length": "1 + accepted draft tokens / verification steps, prefill excluded (vLLM's, "
                                    "SGLang's and the papers' definition)",
    }


def _row(task: str, t: float, c: MethodChoice, tally: _Tally, base: _Tally) -> dict:
    tps = tally.tokens / tally.seconds if tally.seconds > 0 else float("inf")
    base_tps = base.tokens / base.seconds if base.seconds > 0 else float("inf")
    mismatches = []
    if t == 0:
        for prompt_id, tokens in tally.outputs.items():
            div = first_divergence(tokens, base.outputs[prompt_id])
            if div is not None:
                mismatches.append({"prompt_id": prompt_id, "first_divergence": div})
    depth = None
    if tally.drafted is not None:
        depth = {str(d): tally.accepted[d] / n for d, n in sorted(tally.drafted.items())}
    return {
        "task": task,
        "method": c.label,
        "temperature": t,
        "baseline": c.label == BASELINE,
        "prompts": tally.prompts,
        "new_tokens": tally.tokens,
        "seconds": tally.seconds,
        "tokens_per_second": tps,
        "speedup": tps / base_tps,
        "acceptance_length": tally.tokens / tally.forwards if tally.forwards else None,
        "engine_acceptance_length": 1 + tally.engine_accepted / tally.engine_steps if tally.engine_steps else None,
        "acceptance_histogram": {str(k): v for k, v in sorted(tally.histogram.items())} if tally.histogram is not None else None,
        "per_depth_acceptance": depth,
        "target_forwards": tally.forwards,
        "target_forwards_per_token": tally.forwards / tally.tokens if tally.forwards is not None and tally.tokens else None,
        # The mean tree the target verified per step (its batch is this + 1): with a GPU's verify-cost
        # curve and the acceptance length it predicts the speed-up there (tests/gpu, docs/gpu.md).
        "draft_nodes_per_step": tally.draft_nodes / (tally.forwards - tally.prompts)
        if tally.draft_nodes is not None and tally.forwards is not None and tally.forwards > tally.prompts else None,
        # The share of verification steps that ran the drafter (the drafting policy skips the rest).
        "drafted_share": tally.drafted_steps / (tally.forwards - tally.prompts)
        if tally.drafted_steps is not None and tally.forwards is not None and tally.forwards > tally.prompts else None,
        "drafting_time_share": tally.draft_seconds / tally.seconds if tally.draft_seconds is not None and tally.seconds > 0 else None,
        "exact": (not mismatches) if t == 0 else None,
        "mismatches": mismatches,
    }
