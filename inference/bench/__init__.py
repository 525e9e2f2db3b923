"""``selfdraft bench``: decoding methods side by side on one target, in one process, timed fairly.

    selfdraft bench --target smollm2-135m --methods hf-greedy,prompt-lookup,runs/e3/drafter@depth=5,top_k=4 \
        --tasks mt_bench,humaneval --temperatures 0,1 --limit 10 --out bench/

Fairness: the target is loaded once; each method first decodes one warm-up prompt; then, prompt by
prompt, every method decodes the same prompt (the method order rotates from prompt to prompt), with
the same dtype, threads, and at temperature > 0 the same seed. The baseline is our loop without a
drafter (``none``): it always runs, and speedup = tokens/s of a method / tokens/s of ``none`` on the
same task and temperature. At temperature 0 every method's tokens are compared with ``none``'s; a
difference is printed as a WARNING and set in bold in the report.

Methods live in a registry (:data:`METHODS`, extend it with :func:`register`); any drafter folder that
:func:`~selfdraft.inference.specs.make_drafter` reads (native Medusa / EAGLE-1 / EAGLE-3 /
DFlash / DSpark, an engine layout it reads) is a method too. ``METHOD@key=value,key=value`` sets a method's options.
:func:`run_bench` writes ``results.json``, ``report.md`` and PNG plots, each atomically.

The package, by job: :mod:`.runners` (what runs one method on one prompt), :mod:`.methods` (the
registry and ``METHOD@key=value`` parsing: a new method goes here), :mod:`.tasks` (prompt sets and
temperatures), :mod:`.journal` (``progress.jsonl``, resuming), :mod:`.run` (:func:`run_bench`),
:mod:`.report` (tables, report.md, results.json) and :mod:`.plots` (the PNGs: a new plot goes
there); :mod:`.common` holds the few names they share.
"""

from selfdraft.inference.bench.common import BASELINE
from selfdraft.inference.bench.journal import JOURNAL, Journal
from selfdraft.inference.bench.methods import (
    METHODS, Method, MethodChoice, method_names, parse_method, register, split_methods,
)
from selfdraft.inference.bench.plots import PLOTS, method_labels
from selfdraft.inference.bench.report import render_report, render_tables, write_outputs
from selfdraft.inference.bench.run import first_divergence, prompt_seed, run_bench
from selfdraft.inference.bench.runners import Generation, HFRunner, LoopRunner, Runner
from selfdraft.inference.bench.tasks import TASKS, parse_temperatures, task_prompts

# Private helpers the tests reach through the package (tests/test_bench.py, tests/test_files.py).
from selfdraft.inference.bench.common import _write_atomic as _write_atomic
from selfdraft.inference.bench.methods import _no_drafter as _no_drafter

__all__ = [
    "BASELINE", "JOURNAL", "METHODS", "PLOTS", "TASKS", "Generation", "HFRunner", "Journal", "LoopRunner", "Method",
    "MethodChoice", "Runner", "first_divergence", "method_labels", "method_names", "parse_method", "parse_temperatures",
    "prompt_seed", "register", "render_report", "render_tables", "run_bench", "split_methods", "task_prompts",
    "write_outputs",
]
