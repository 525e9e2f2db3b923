"""The EAGLE-3 recipe from evidence: a sweep at a fixed CPU budget, one factor at a time.

    python scripts/recipe_sweep.py --out sweep/                      # every arm, then the table
    python scripts/recipe_sweep.py --out sweep/ --arms online,cache-e2 --budget-minutes 30
    python scripts/recipe_sweep.py --out sweep/ --table               # print the table of what finished

Each arm is the ``eagle3_smollm2`` preset with some overrides, trained for ``--budget-minutes`` of
compute: the optimizer steps, plus writing the feature cache for the arms that train from one (its
measured seconds are charged to every arm that reads it). As ``selfdraft quickstart`` does, an arm
times its first steps and then fixes ``train.max_steps`` so that the steps fill what is left of the
budget; loading, evaluation and benching come on top. An arm compared with a cache arm that ran in
another session (the factors below) times that arm's step again and rescales the budget to the
machine's speed today: the same kind of machine ran the same cached step at different speeds in
different sessions (docs/results/recipe-sweep.md), which a budget in seconds would have turned into
more steps for the later arm. The factors:

* **data reuse**: online features, one pass over as many conversations as the budget reaches, against
  a feature cache of fewer conversations read for E epochs (``cache-e2``, ``cache-e4``): the cache
  costs the target's forward once per conversation, an epoch over it a fraction of an online pass
  (docs/results/training-profiles.md);
* learning rate, training-time-test steps and draft vocabulary size, on the best data-reuse setting's
  cache (the features do not depend on them);
* **data**: ShareGPT answers as they are, or the target's own answers (``selfdraft distill`` of the
  best cache arm's conversations, made by the arm before it trains, here or with ``--distill-server``
  through a serving engine; its cost is reported apart, as a data set is made once).

Every arm is scored on the same held-out conversations (``data.eval_source``: the last
``--eval-conversations`` conversations of the embedded ShareGPT file, which no arm trains on), by
held-out top-1 against the target's own next token at each draft depth and the acceptance length it
predicts, and by a bench on MT-bench and HumanEval prompts (greedy, fp32, token identity checked):
tau and speedup over our loop without a drafter, with the preset's 4-node tree and a 7-node one. An
arm benches after its training has finished, so no bench shares the CPU with a training run. Results go to
``OUT/results.json`` after every arm (a rerun skips finished arms and resumes an interrupted one)
and the table is printed in Markdown, with the processor's flags.

A benchmark, not a test: minutes per arm, figures that depend on the machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PRESET = "eagle3_smollm2"
TREES = {"tree 3/2/4": "depth=3,top_k=2,max_nodes=4", "tree 4/3/7": "depth=4,top_k=3,max_nodes=7"}


def arms(best_cache: str) -> dict[str, dict]:
    """name -> {overrides, cache: None (online) | epochs | name of the arm whose cache it reads, data}."""
    return {
        "online": {"overrides": [], "cache": None},
        "cache-e2": {"overrides": [], "cache": 2},
        "cache-e4": {"overrides": [], "cache": 4},
        "lr-1e-3": {"overrides": ["train.lr=1e-3"], "cache": best_cache},
        "lr-4e-3": {"overrides": ["train.lr=4e-3"], "cache": best_cache},
        "ttt-1": {"overrides": ["drafter.eagle.ttt_steps=1"], "cache": best_cache},
        "ttt-5": {"overrides": ["drafter.eagle.ttt_steps=5"], "cache": best_cache},
        "vocab-4k": {"overrides": ["drafter.eagle.draft_vocab_size=4096"], "cache": best_cache},
        "vocab-16k": {"overrides": ["drafter.eagle.draft_vocab_size=16384"], "cache": best_cache},
        "distilled": {"overrides": [], "cache": "epochs-of-best", "data": "distilled"},
    }


class Sweep:
    def __init__(self, args):
        self.args = args
        self.out = pathlib.Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "results.json"
        self.results = json.loads(self.path.read_text()) if self.path.is_file() else {"arms": {}, "meta": {}}
        self.budget = args.budget_minutes * 60

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1))
        os.replace(tmp, self.path)

    def phase(self, text: str) -> None:
        """OUT/phase.txt says what runs now (train, bench, ...): a session that wants the CPU for
        something else reads it, so nothing it runs overlaps a timed calibration or a bench."""
        (self.out / "phase.txt").write_text(f"{text} {time.strftime('%H:%M:%S')}\n")
        print(f"[sweep] {text}", flush=True)

    # --- data ---------------------------------------------------------------------------------------

    def eval_source(self) -> str:
        """The common held-out set: the last conversations of the embedded ShareGPT file (no arm reads
        that far: the arms take the first few thousand)."""
        path = self.out / "eval.jsonl"
        if not path.is_file():
            from selfdraft.configs.schema import DataConfig
            from selfdraft.train.data import iter_conversations

            last = collections.deque(iter_conversations(DataConfig(source="sharegpt-embedded")),
                                     maxlen=self.args.eval_conversations)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"messages": m}) + "\n" for m in last))
            os.replace(tmp, path)
        return str(path)

    def distilled(self, conversations: int) -> str:
        """The target's own answers to the first ``conversations`` ShareGPT prompts (selfdraft distill)."""
        from selfdraft.configs.schema import DataConfig
        from selfdraft.heads.target import load_target
        from selfdraft.train.distill import DistillConfig, distill

        folder = self.out / "distilled-data"  # not the arm's own run folder, OUT/distilled
        meta = self.results["meta"].setdefault("distill", {})
        if meta.get("conversations") != conversations:
            self.phase(f"distill {conversations} conversations")
            began = time.perf_counter()
            data = DataConfig(source="sharegpt-embedded", max_conversations=conversations)
            settings = DistillConfig(max_new_tokens=self.args.distill_tokens, batch_size=self.args.distill_batch)
            if self.args.distill_server:  # a serving engine generates; only the tokenizer is loaded here
                from selfdraft.heads.target import load_target_tokenizer
                from selfdraft.train.chat_server import ServerConfig
                from selfdraft.train.distill import TargetText

                server = ServerConfig(self.args.distill_server, concurrency=self.args.distill_batch)
                distill(TargetText(*load_target_tokenizer("smollm2-135m")), data, folder, settings, server=server)
                how = f"server {self.args.distill_server}"
            else:
                dtype = "bfloat16" if self.args.distill_bf16 else "float32"
                distill(load_target("smollm2-135m", dtype=dtype), data, folder, settings)
                how = dtype
            meta.update(conversations=conversations, seconds=round(time.perf_counter() - began, 1),
                        generated_by=how, max_new_tokens=self.args.distill_tokens)
            self.save()
        return str(folder)

    # --- one arm ------------------------------------------------------------------------------------

    def config(self, name: str, arm: dict, extra: list[str]):
        from selfdraft.configs.run import load_run_config

        overrides = [f"train.output_dir={self.out / name}", f"data.eval_source={self.eval_source()}",
                     f"train.eval_batches={self.args.eval_conversations}", "train.save_every=100",
                     f"train.num_threads={self.args.threads}", *arm["overrides"], *extra]
        return load_run_config(PRESET, overrides)

    def asked_for(self, usable: int) -> int:
        """data.max_conversations that renders ``usable`` training conversations (about 30% of ShareGPT's
        have no assistant token within 512 tokens and are dropped)."""
        from selfdraft.configs.schema import DataConfig
        from selfdraft.heads.target import load_target_tokenizer
        from selfdraft.train.data import conversations_for

        tokenizer, _ = load_target_tokenizer("smollm2-135m")
        return conversations_for(DataConfig(source="sharegpt-embedded"), tokenizer, usable) or usable

    def costs(self):
        """Seconds per conversation of the target's forward and of a cached step, from the online arm's
        calibration (the cache arms are sized from them before their cache exists)."""
        cal = self.results["arms"].get("online", {}).get("calibration")
        if cal is None:
            raise SystemExit("run the online arm first: the cache arms are sized from its calibration")
        per_conv_target = cal["target_seconds_per_step"] / cal["conversations_per_step"]
        per_conv_cached = (cal["seconds_per_step"] - cal["target_seconds_per_step"]) / cal["conversations_per_step"]
        return per_conv_target, per_conv_cached

    def reference_speed(self, name: str, run_dir: pathlib.Path, reference: str) -> tuple[float, float]:
        """Seconds per step of the cache arm ``reference`` when it ran and now (timed again in a scratch
        folder of this arm: its own overrides, its own cache)."""
        from selfdraft.train.budget import StepCosts
        from selfdraft.train.loop import train

        source = self.results["arms"][reference]
        then = (source["calibration"]["seconds_per_step"] if "calibration" in source
                else (self.budget - source["feature_seconds"]) / source["planned_steps"])
        scratch = run_dir / f"calibration-{reference}"
        if not (scratch / "costs.json").is_file():
            config = self.config(name, {"overrides": source["overrides"]},
                                 [f"train.features={source['features']}", f"data.max_conversations={source['conversations']}",
                                  f"train.output_dir={scratch}"])
            result = train(config, stop_after=self.args.calibration_steps)
            costs = StepCosts.measured(result, config.train.micro_batch_size * config.train.grad_accum)
            (scratch / "costs.json").write_text(json.dumps({"seconds_per_step": costs.seconds_per_step}))
        return then, json.loads((scratch / "costs.json").read_text())["seconds_per_step"]

    def train_arm(self, name: str, arm: dict, best: str | None) -> None:
        from selfdraft.train import checkpoint as ckpt
        from selfdraft.train.features import write_features
        from selfdraft.train.loop import train

        record = self.results["arms"].setdefault(name, {"overrides": arm["overrides"]})
        if record.get("trained"):
            return
        extra: list[str] = []
        cache = arm["cache"]
        conversations = None  # fixed by the cache's arm or by the budget
        if arm.get("data") == "distilled":
            # the best data-reuse arm's conversation count and epochs, on the target's own answers
            source = self.results["arms"][best]
            conversations, cache = source["conversations"], source.get("epochs_planned")
            extra.append(f"data.source={self.distilled(conversations)}")
        feature_seconds = 0.0
        if cache is None:
            conversations = self.args.online_conversations
        elif isinstance(cache, str):  # another arm's cache, with its cost
            source = self.results["arms"][cache]
            conversations, feature_seconds = source["conversations"], source["feature_seconds"]
            extra.append(f"train.features={source['features']}")
            record["features_from"] = cache
        else:  # a cache of its own, for `cache` epochs: N (f + E c) = budget
            if conversations is None:
                f, c = self.costs()
                conversations = record.get("conversations") or self.asked_for(int(self.budget / (f + cache * c)))
            record["epochs_planned"] = cache
            features = self.out / name / "features"
            if "feature_seconds" not in record:
                self.phase(f"{name}: features for {conversations} conversations")
                began = time.perf_counter()
                write_features(self.config(name, arm, [*extra, f"data.max_conversations={conversations}"]), features,
                               max_gb=self.args.max_gb)
                record["feature_seconds"] = round(time.perf_counter() - began, 1)
                record["conversations"] = conversations
                self.save()
            feature_seconds = record["feature_seconds"]
            extra.append(f"train.features={features}")
            record["features"] = str(features)
        record["conversations"] = conversations
        extra.append(f"data.max_conversations={conversations}")
        config = self.config(name, arm, extra)
        run_dir = pathlib.Path(config.train.output_dir)
        if "planned_steps" not in record:
            self.calibrate(name, arm, record, config, best, cache, feature_seconds)
        planned = record["planned_steps"]
        self.phase(f"{name}: train {planned} steps")
        config = self.config(name, arm, [*extra, f"train.max_steps={planned}",
                                         f"train.eval_every={max(1, planned // self.args.evaluations)}"])
        result = train(config, resume=ckpt.latest_checkpoint(run_dir / "checkpoints") is not None)
        record.update(trained=True, drafter=str(result.drafter_dir), feature_seconds=feature_seconds,
                      last_eval={k: v for k, v in result.last_eval.items()},
                      curve=_curve(run_dir / "metrics.jsonl"))
        per_step = record["calibration"]["seconds_per_step"]
        import datasets  # the conversations the run trained on: those with an assistant token within max_length

        record["usable"] = datasets.load_from_disk(str(run_dir / "data" / "train")).num_rows
        record["epochs"] = round(planned * record["calibration"]["conversations_per_step"] / record["usable"], 2)
        record["budget_seconds"] = round(feature_seconds + planned * per_step, 1)
        # what the steps took (calibration included): the budget's check, on a machine that stayed quiet
        record["spent_seconds"] = round(feature_seconds + record["calibration"].get("train_seconds", 0) + result.train_seconds, 1)
        self.save()

    def calibrate(self, name: str, arm: dict, record: dict, config, best: str | None, cache, feature_seconds: float) -> None:
        """Time the arm's first steps and plan its steps: the budget, less the feature cache's seconds, in
        steps of the measured time."""
        from selfdraft.train import checkpoint as ckpt
        from selfdraft.train.budget import StepCosts
        from selfdraft.train.loop import train

        run_dir = pathlib.Path(config.train.output_dir)
        self.phase(f"{name}: calibration")
        latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
        start = ckpt.read_state(latest)["step"] if latest else 0
        first = train(config, resume=latest is not None, stop_after=start + self.args.calibration_steps)
        costs = StepCosts.measured(first, config.train.micro_batch_size * config.train.grad_accum)
        per_step = costs.seconds_per_step
        record["calibration"] = {"seconds_per_step": per_step, "target_seconds_per_step": costs.target_seconds_per_step,
                                 "conversations_per_step": costs.conversations_per_step,
                                 "step_seconds": [round(x, 3) for x in first.step_seconds]}
        # Equal compute across sessions: the arm this one is compared with, timed again now, gives the
        # machine's speed today against the session it ran in (the same cached step's time varies
        # between sessions on the same kind of machine); the budget and a cache written then are
        # rescaled to today's seconds before they buy steps.
        reference = cache if record.get("features_from") else best if arm.get("data") == "distilled" else None
        budget, charged = self.budget, feature_seconds
        if reference:
            then, now = self.reference_speed(name, run_dir, reference)
            record["calibration"].update(reference=reference, reference_seconds_then=then, reference_seconds_now=now)
            budget = self.budget * now / then
            if record.get("features_from"):
                charged = feature_seconds * now / then
        record["planned_steps"] = max(first.step + 1, int((budget - charged) / per_step))
        record["calibration"]["train_seconds"] = first.train_seconds
        self.save()

    def bench_arm(self, name: str) -> None:
        from selfdraft.inference.bench import run_bench

        record = self.results["arms"][name]
        if record.get("bench") or not record.get("trained"):
            return
        self.phase(f"{name}: bench")
        drafter = record["drafter"]
        methods = ["none", *(f"{drafter}@{tree}" for tree in TREES.values())]
        results = run_bench("smollm2-135m", methods, self.args.tasks, [0.0], self.args.max_new_tokens,
                            self.args.bench_limit, self.out / name / "bench", dtype="float32",
                            threads=self.args.threads or None, command="scripts/recipe_sweep.py", progress=False)
        bench = {}
        for row in results["rows"]:
            for label, tree in TREES.items():
                if row["method"] == f"{drafter}@{tree}":
                    bench.setdefault(row["task"], {})[label] = {
                        "tau": round(row["acceptance_length"], 3), "speedup": round(row["speedup"], 3),
                        "exact": row["exact"]}
        record["bench"] = bench
        self.save()


def _curve(metrics: pathlib.Path) -> list[dict]:
    rows = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "eval/top1/head0" in r:
            rows.append({"step": r["step"], "top1": [round(r[k], 4) for k in sorted(r) if k.startswith("eval/top1/head")],
                         "predicted_tau": round(r.get("eval/predicted_tau", 0.0), 3)})
    return rows


def table(results: dict) -> str:
    meta = results["meta"]
    lines = [f"Budget {meta.get('budget_minutes')} min per arm; {meta.get('machine')}", "",
             "| arm | conversations trained on x epochs | steps | features (s) | held-out top-1 by depth | predicted tau | "
             + " | ".join(f"{task} {label}: tau (speedup)" for task in ("mt_bench", "humaneval") for label in TREES) + " |",
             "|---" * (6 + 2 * len(TREES)) + "|"]
    for name, r in results["arms"].items():
        if not r.get("trained"):
            continue
        top1 = " / ".join(f"{results_top1:.2f}" for results_top1 in _top1(r["last_eval"]))
        cells = []
        for task in ("mt_bench", "humaneval"):
            for label in TREES:
                b = r.get("bench", {}).get(task, {}).get(label)
                cells.append(f"{b['tau']:.2f} ({b['speedup']:.2f}x){'' if b['exact'] else ' NOT EXACT'}" if b else "")
        lines.append(f"| {name} | {r.get('usable', r['conversations'])} x {r['epochs']:.2f} | {r['planned_steps']} | "
                     f"{r.get('feature_seconds', 0):.0f}{' (' + r['features_from'] + ')' if r.get('features_from') else ''} | "
                     f"{top1} | {r['last_eval'].get('eval/predicted_tau', 0):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _top1(last_eval: dict) -> list[float]:
    return [last_eval[k] for k in sorted(last_eval) if k.startswith("eval/top1/head")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="sweep")
    parser.add_argument("--arms", default="", help="comma-separated arm names (default: all, in order)")
    parser.add_argument("--budget-minutes", type=float, default=30.0)
    parser.add_argument("--best-cache", default="", help="the data-reuse arm whose cache the other arms read "
                        "(default: the best of online, cache-e2, cache-e4 by held-out depth-1 top-1)")
    parser.add_argument("--online-conversations", type=int, default=4000)
    parser.add_argument("--eval-conversations", type=int, default=48)
    parser.add_argument("--evaluations", type=int, default=4, help="held-out evaluations per run (the learning curve)")
    parser.add_argument("--calibration-steps", type=int, default=20,
                        help="steps timed (their median after the first) before the step count is fixed")
    parser.add_argument("--max-gb", type=float, default=30.0)
    parser.add_argument("--tasks", default="mt_bench,humaneval")
    parser.add_argument("--bench-limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distill-tokens", type=int, default=256)
    parser.add_argument("--distill-batch", type=int, default=16)
    parser.add_argument("--distill-bf16", action="store_true", help="distill with a bf16 target (faster where the "
                        "CPU has bf16 matmuls; answers then follow the bf16 target's greedy choices)")
    parser.add_argument("--distill-server", default="", metavar="URL", help="distill through an OpenAI-compatible "
                        "server serving the target (vLLM's CPU build: python -m vllm.entrypoints.openai.api_server "
                        "--model TARGET_FOLDER), --distill-batch requests in flight")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--table", action="store_true", help="only print the table of what has finished")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # ARM:train or ARM:bench, run by the driver
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sweep = Sweep(args)
    if args.table:
        print(table(sweep.results))
        return 0
    import torch

    from selfdraft.machine import cpu_flags

    meta = sweep.results["meta"]
    meta.setdefault("budget_minutes", args.budget_minutes)
    if meta["budget_minutes"] != args.budget_minutes:
        raise SystemExit(f"{sweep.out} holds a sweep at {meta['budget_minutes']} minutes: choose another --out")
    meta["machine"] = f"CPU flags {' '.join(cpu_flags()) or 'unknown'}, {args.threads} threads, torch {torch.__version__}"
    sweep.save()

    def best() -> str:
        if args.best_cache:
            return args.best_cache
        done = {n: r for n, r in sweep.results["arms"].items() if n in ("cache-e2", "cache-e4") and r.get("trained")}
        return max(done, key=lambda n: _top1(done[n]["last_eval"])[0]) if done else "cache-e2"

    chosen = [a for a in args.arms.split(",") if a] or list(arms("").keys())
    unknown = [a for a in chosen if a not in arms("")]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; arms: {', '.join(arms(''))}")
    if args.child:  # one stage of one arm, in a process of its own
        name, stage = args.child.split(":")
        if stage == "train":
            sweep.train_arm(name, arms(best())[name], best())
        else:
            sweep.bench_arm(name)
        return 0
    # Every arm trains, then benches, each stage in a fresh process: runs in one long process slowed down
    # from one arm to the next (memory kept from earlier runs pushed the feature caches out of the page
    # cache), so later arms' calibrated steps came out slower and their budgets bought fewer of them.
    # An arm's bench follows its training (nothing else runs then), so every finished arm has its row.
    import subprocess

    stages = [f"{n}:{stage}" for n in chosen for stage in (("train",) if args.no_bench else ("train", "bench"))]
    for stage in stages:
        child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", stage]
        if subprocess.run(child).returncode:
            raise SystemExit(f"{stage} failed (see above); rerun to resume")
        sweep.results = json.loads(sweep.path.read_text())
    sweep.phase("done")
    print(table(sweep.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
