"""The report: markdown tables (what ``selfdraft bench`` prints), report.md, and :func:`write_outputs`, which
writes them with results.json and the plots."""

from __future__ import annotations

import json
import os
import pathlib

from selfdraft.inference.bench.common import BASELINE, _groups, _write_atomic
from selfdraft.inference.bench.plots import PLOTS, write_plots


def write_outputs(results: dict, out: str | os.PathLike, plots: bool = True) -> list[pathlib.Path]:
    """Write results.json, report.md and (with ``plots``) the PNG plots into ``out``, each atomically."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "report.md"]
    _write_atomic(written[0], (json.dumps(results, indent=2) + "\n").encode("utf-8"))
    _write_atomic(written[1], render_report(results, plots=plots).encode("utf-8"))
    if plots:
        written += write_plots(results, out)
    return written


def _fmt(value, pattern: str, none: str = "-") -> str:
    return none if value is None else format(value, pattern)


def _table(task: str, t: float, rows: list[dict]) -> tuple[str, str]:
    """(title, markdown table) of one task x temperature."""
    lines = ["| method | tok/s | speedup | tau | engine tau | forwards/token | steps drafted | drafting share | exact |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = f"`{r['method']}` (baseline)" if r["baseline"] else f"`{r['method']}`"
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else f"**NO** ({len(r['mismatches'])}/{r['prompts']})")
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {_fmt(r['acceptance_length'], '.2f')} "
                     f"| {_fmt(r.get('engine_acceptance_length'), '.2f')} | {_fmt(r['target_forwards_per_token'], '.2f')} "
                     f"| {_fmt(r.get('drafted_share'), '.0%')} | {_fmt(r['drafting_time_share'], '.0%')} | {exact} |")
    return f"{task}, temperature {t:g} ({rows[0]['prompts']} prompts)", "\n".join(lines)


def _skipped_line(results: dict, t: float) -> str | None:
    skipped = [s for s in results["skipped"] if s["temperature"] == t]
    if not skipped:
        return None
    return "Not run at this temperature: " + "; ".join(f"`{s['method']}` ({s['reason']})" for s in skipped) + "."


def render_tables(results: dict) -> str:
    """One markdown table per task x temperature (what ``selfdraft bench`` prints to stdout)."""
    parts = []
    for task, t, rows in _groups(results):
        parts += [*_table(task, t, rows), *filter(None, [_skipped_line(results, t)])]
    return "\n\n".join(parts)


def _category_table(results: dict, task: str, t: float) -> str:
    """Markdown table of speedup (tau) per method x category of ``task`` at ``t``; '' if none."""
    rows = [r for r in results.get("category_rows", []) if r["task"] == task and r["temperature"] == t]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != BASELINE]
    if not categories or not methods:
        return ""
    cell = {(r["method"], r["category"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"{c} ({cell[BASELINE, c]['prompts']})" for c in categories) + " |",
             "|---|" + "---:|" * len(categories)]
    for m in methods:
        parts = []
        for c in categories:
            r = cell.get((m, c))
            tau = f" ({r['acceptance_length']:.2f})" if r and r["acceptance_length"] is not None else ""
            parts.append(f"{r['speedup']:.2f}x{tau}" if r else "-")
        lines.append(f"| `{m}` | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def render_report(results: dict, plots: bool = True) -> str:
    m = results["meta"]
    machine = m["machine"]
    lines = [
        "# selfdraft bench", "",
        f"Target `{m['target']}`, {m['dtype']}, {m['device']}, {m['threads']} threads; torch {m['torch']}, "
        f"transformers {m['transformers']}; {machine['cpu'] or machine['machine']}"
        + (f" ({', '.join(machine['cpu_flags'])})" if machine.get("cpu_flags") else "")
        + (" capped by " + " ".join(f"{k}={v}" for k, v in machine["isa_caps"].items()) if machine.get("isa_caps") else "")
        + (f", {machine['gpu']}" if machine["gpu"] else "")
        + (f" (driver {machine['gpu_details']['driver']}, CUDA {machine['gpu_details']['cuda']})"
           if machine.get("gpu_details") else "") + f" ({machine['platform']}); {m['date']}.", "",
        f"{m['max_new_tokens']} new tokens per prompt, up to {m['limit'] or 'all'} prompts per task, seed {m['seed']}. "
        f"Baseline: `{BASELINE}` (our loop without a drafter); speedup = {m['speedup']}. tau = tokens per target "
        "forward, the prefill included (selfdraft's definition); engine tau = 1 + accepted draft tokens per "
        "verification step, prefill excluded (vLLM's, SGLang's and the papers' definition); tok/s = new tokens / seconds, summed over the prompts; steps drafted = verification "
        "steps that ran the drafter (the adaptive drafting policy, on by default, runs plain steps where drafting does not pay); "
        "drafting share = time in the drafter / generation time (- where a method cannot measure it). "
        "exact: token-identical to the baseline on every prompt (temperature 0 only).", "",
        f"Command: `{m['command']}`", "",
    ]
    for task, t, rows in _groups(results):
        title, table = _table(task, t, rows)
        lines += [f"## {title}", "", table, ""]
        for r in rows:
            if r["exact"] is False:
                shown = ", ".join(f"{x['prompt_id']} at token {x['first_divergence']}" for x in r["mismatches"])
                lines += [f"**WARNING: `{r['method']}` is not token-identical to `{BASELINE}` on {len(r['mismatches'])} "
                          f"of {r['prompts']} prompts (first divergence: {shown}).**", ""]
        depth_lines = [f"- `{r['method']}`: " + ", ".join(f"d{d} {a:.2f}" for d, a in r["per_depth_acceptance"].items())
                       for r in rows if r["per_depth_acceptance"]]
        if depth_lines:
            lines += ["Per-depth acceptance (share of steps that drafted depth d and accepted a token there):", "",
                      *depth_lines, ""]
        by_category = _category_table(results, task, t)
        if by_category:
            lines += ["Speedup over the baseline by category (tau; prompts per category in brackets):", "",
                      by_category, ""]
        skipped = _skipped_line(results, t)
        if skipped:
            lines += [skipped, ""]
    if plots:
        lines += ["## Plots", "", *(f"![{name[:-4]}]({name})" for name in PLOTS), ""]
    return "\n".join(lines)
