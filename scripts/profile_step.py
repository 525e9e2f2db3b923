"""Where a training step's time goes, per drafter kind: a table of phases, padding and tokens/s.

    python scripts/profile_step.py                          # medusa, eagle, eagle3 on the embedded target
    python scripts/profile_step.py --kinds eagle3 --steps 10 --pack-tokens 0 2048

For each drafter kind (the shipped ``*_smollm2`` preset) and each packing setting, it renders the
embedded ShareGPT conversations with the target's chat template, builds the objective and optimizer
exactly as ``selfdraft train`` does, runs one warm-up step and then ``--steps`` optimizer steps, each
on the training stream's next micro batch, and prints the seconds per step spent in: data and
collation, the target's forward (online features), each drafter forward (EAGLE-3: the fusion and every
training-time-test step), the losses (the target's LM head for the teacher and the drafter's heads,
with their gradients: ``train/objectives.py`` ``head_losses``), each drafter backward, the rest of
the backward, gradient clipping and the optimizer. Also: the share of the drafter's positions that
are padding, the share of tokens that are supervised, and training tokens per second (all tokens of
the conversations, as ``selfdraft train`` counts them). ``--json`` writes the figures.

A benchmark, not a test: the figures depend on the machine. It prints the processor's vector flags
(``avx512_bf16`` or only ``avx2``), torch's thread count and the versions with the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PRESETS = {"medusa": "medusa_smollm2", "medusa2": "medusa2_smollm2", "eagle": "eagle_smollm2", "eagle3": "eagle3_smollm2"}


def profile_kind(kind: str, *, steps: int, micro_batch: int, max_length: int, conversations: int,
                 pack_tokens: int, mixed_precision: str, target, data, cached: bool = False) -> dict:
    import torch

    from selfdraft.configs.run import load_run_config
    from selfdraft.train.features import target_features
    from selfdraft.train.loop import make_batch, stream_index
    from selfdraft.train.objectives import build_objective
    from selfdraft.train.profile import StepProfile

    config = load_run_config(PRESETS[kind], [f"data.max_length={max_length}", f"train.micro_batch_size={micro_batch}",
                                             f"train.pack_tokens={pack_tokens}"])
    train_data = data
    torch.manual_seed(0)
    objective = build_objective(config, target.model, train_data)
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=config.train.lr)
    params = [p for p in objective.parameters() if p.requires_grad]
    objective.train()
    pad_id = target.tokenizer.pad_token_id or 0
    amp = mixed_precision == "bf16"
    profile = StepProfile("cpu")
    tokens = positions = supervised = 0
    wall = 0.0
    for step in range(steps + 1):
        current = StepProfile("cpu") if step == 0 else profile  # the warm-up step's figures are dropped
        began = time.perf_counter()
        with current.phase("data and collation"):
            indices = [stream_index(step * micro_batch + i, len(train_data), 0) for i in range(micro_batch)]
            batch = make_batch(train_data, indices, pad_id, "cpu", pack_tokens=pack_tokens)
        collated = time.perf_counter()
        if cached:  # as streamed from a feature cache: computed here, outside the step's time
            with torch.no_grad():
                batch["features"] = target_features(target.model, batch["input_ids"], batch["attention_mask"],
                                                    objective.feature_layers, batch.get("position_ids"))
        forward_began = time.perf_counter()
        inner = sum(current.seconds.values())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), current.recording():
            loss, _ = objective(**batch)
        current.seconds["forward, the rest"] += time.perf_counter() - forward_began - (sum(current.seconds.values()) - inner)
        with current.backward():
            loss.backward()
        with current.phase("gradient clipping"):
            torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm)
        with current.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step > 0:
            wall += (collated - began) + (time.perf_counter() - forward_began)
            tokens += int(batch["attention_mask"].sum())
            positions += batch["input_ids"].numel()
            supervised += int((batch["loss_mask"] * batch["attention_mask"]).sum())
    phases = {name: seconds / steps for name, seconds in profile.seconds.items()}
    return {"kind": kind, "pack_tokens": pack_tokens, "mixed_precision": mixed_precision, "steps": steps, "cached": cached,
            "micro_batch": micro_batch, "max_length": max_length, "seconds_per_step": wall / steps,
            "phases": phases, "tokens_per_step": tokens / steps, "tokens_per_second": tokens / wall,
            "padding_share": 1 - tokens / positions, "supervised_share": supervised / tokens}


def print_table(results: list[dict]) -> None:
    names: list[str] = []
    for r in results:
        names += [n for n in r["phases"] if n not in names]
    order = ["data and collation", "target forward", "target forward (LoRA, with gradients)"]
    names = [n for n in order if n in names] + sorted(n for n in names if n not in order and "forward" in n) + \
        ["losses"] * ("losses" in names) + sorted(n for n in names if "backward" in n) + \
        [n for n in ("gradient clipping", "optimizer") if n in names]
    head = [f"{r['kind']}{', cached' if r['cached'] else ''}, pack {r['pack_tokens'] or 'off'}"
            + (", bf16" if r["mixed_precision"] == "bf16" else "") for r in results]
    print("| ms per step (share) | " + " | ".join(head) + " |")
    print("|---" * (len(results) + 1) + "|")
    for name in dict.fromkeys(names):
        cells = []
        for r in results:
            s = r["phases"].get(name)
            cells.append("" if s is None else f"{1000 * s:.0f} ({100 * s / r['seconds_per_step']:.0f}%)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for label, key, fmt in (("step", "seconds_per_step", lambda v: f"{1000 * v:.0f} ms"),
                            ("tokens per step", "tokens_per_step", lambda v: f"{v:.0f}"),
                            ("padding share of drafter positions", "padding_share", lambda v: f"{100 * v:.0f}%"),
                            ("supervised share of tokens", "supervised_share", lambda v: f"{100 * v:.0f}%"),
                            ("training tokens/s", "tokens_per_second", lambda v: f"{v:.0f}")):
        print(f"| **{label}** | " + " | ".join(fmt(r[key]) for r in results) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["medusa", "eagle", "eagle3"], choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per kind (after one warm-up)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--pack-tokens", type=int, nargs="+", default=[0],
                        help="train.pack_tokens values to compare (0: one conversation per padded row)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--features", nargs="+", choices=("online", "cached"), default=["online"],
                        help="the target run in the step (online) or its features given, as a cache streams them")
    parser.add_argument("--target-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the dtype the target's weights are held in (target.dtype)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import transformers

    from selfdraft.configs.schema import DataConfig
    from selfdraft.heads.target import load_target
    from selfdraft.train.data import build_datasets

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", dtype=args.target_dtype)
    train_ds, _ = build_datasets(DataConfig(source="sharegpt-embedded", max_length=args.max_length,
                                            max_conversations=args.conversations, eval_fraction=0.0), target.tokenizer)
    data = [(np.asarray(r["input_ids"], dtype=np.int64), np.asarray(r["loss_mask"], dtype=np.int64))
            for r in train_ds.with_format("numpy")]
    from selfdraft.machine import cpu_flags

    machine = {"cpu_flags": " ".join(cpu_flags()) or "unknown", "threads": torch.get_num_threads(), "torch": torch.__version__,
               "target_dtype": args.target_dtype,
               "transformers": transformers.__version__}
    print(f"machine: {machine}", flush=True)
    results = []
    for kind in args.kinds:
        for features in args.features:
            for pack in args.pack_tokens:
                print(f"profiling {kind}, {features} features, pack_tokens {pack} ...", file=sys.stderr, flush=True)
                results.append(profile_kind(kind, steps=args.steps, micro_batch=args.micro_batch,
                                            max_length=args.max_length, conversations=args.conversations,
                                            pack_tokens=pack, mixed_precision=args.mixed_precision, target=target,
                                            data=data, cached=features == "cached"))
                print(f"  {results[-1]['seconds_per_step']:.2f} s per step, {results[-1]['tokens_per_second']:.0f} tokens/s",
                      file=sys.stderr, flush=True)
                if args.json:  # after every setting: an interrupted run keeps what it measured
                    args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
