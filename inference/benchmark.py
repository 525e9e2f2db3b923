"""Decoding baselines side by side: transformers' generate() against our loop, in one process.

    python -m selfdraft.inference.benchmark --target smollm2-135m --dtype bfloat16 --limit 10
    python -m selfdraft.inference.benchmark --dtype float32 --methods hf-greedy none --drafter runs/medusa-smollm2/drafter

Methods (interleaved prompt by prompt after a warm-up, same dtype and threads):
``hf-greedy`` (generate, greedy), ``hf-prompt-lookup`` (generate with prompt_lookup_num_tokens),
``none`` (our loop, no drafter) and ``prompt-lookup`` (our loop). Prints tokens/s, the ratio to
hf-greedy measured in the same run, acceptance length, and agreement with hf-greedy's tokens.
``--drafter SPEC`` (repeatable) adds any drafter our loop takes, e.g. a trained drafter folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import torch

from selfdraft.configs.decode import PromptLookupConfig

METHODS = ("hf-greedy", "hf-prompt-lookup", "none", "prompt-lookup")
TASKS = ("mt_bench", "humaneval")


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    exact: int = 0
    prompts: int = 0
    first_divergence: list = field(default_factory=list)
    depth_rates: dict = field(default_factory=dict)  # depth -> per-prompt acceptance rates


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args) -> dict:
    from selfdraft.heads.target import load_target
    from selfdraft.inference.api import encode_prompt, generate
    from selfdraft.inference.drafters import NoDrafter, PromptLookupDrafter
    from selfdraft.inference.prompts import humaneval_prompts, mt_bench_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    model, tok = target.model, target.tokenizer
    lookup = PromptLookupDrafter(
        PromptLookupConfig(num_tokens=args.lookup_tokens, max_branches=args.lookup_branches, max_nodes=args.lookup_nodes)
    )
    ours = {"none": NoDrafter(), "prompt-lookup": lookup}
    methods = list(args.methods)
    for spec in args.drafter:
        from selfdraft.inference.drafters import make_drafter

        drafter = make_drafter(spec, target, medusa_nodes=args.medusa_nodes)
        label = f"{drafter.name}:{spec.rstrip('/').split('/')[-1]}"
        ours[label] = drafter
        methods.append(label)
    args.methods = methods
    tasks = {"mt_bench": mt_bench_prompts(args.limit), "humaneval": humaneval_prompts(args.limit)}

    def hf(ids: list[int], extra: dict) -> tuple[list[int], float]:
        x = torch.tensor([ids], device=target.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.max_new_tokens,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0], **extra,
            )
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    def one(method: str, ids: list[int]):
        if method == "hf-greedy":
            toks, secs = hf(ids, {})
            return toks, secs, len(toks)
        if method == "hf-prompt-lookup":
            toks, secs = hf(ids, {"prompt_lookup_num_tokens": args.hf_lookup_tokens})
            return toks, secs, None
        r = generate(target, input_ids=ids, drafter=ours[method], max_new_tokens=args.max_new_tokens)
        for depth, rate in r.depth_acceptance.items():
            depth_rates.setdefault(method, {}).setdefault(depth, []).append(rate)
        return r.token_ids, r.seconds, r.target_forwards

    depth_rates: dict = {}
    warm = encode_prompt(tok, tasks["mt_bench"][0].text, True)
    for method in args.methods:
        one(method, warm)

    results = {}
    from tqdm import tqdm

    for task in args.tasks:
        tallies = {m: Tally() for m in args.methods}
        depth_rates.clear()
        for prompt in tqdm(tasks[task], desc=task, file=sys.stderr):
            ids = encode_prompt(tok, prompt.text, prompt.chat)
            reference = None
            for method in args.methods:
                toks, secs, forwards = one(method, ids)
                t = tallies[method]
                t.tokens += len(toks)
                t.seconds += secs
                t.prompts += 1
                if forwards is not None:
                    t.forwards += forwards
                if method == "hf-greedy":
                    reference = toks
                if reference is not None:
                    div = _first_divergence(toks, reference)
                    t.exact += div is None
                    if div is not None:
                        t.first_divergence.append(div)
        base = tallies.get("hf-greedy") or tallies[args.methods[0]]
        base_tps = base.tokens / base.seconds
        rows = {}
        for method, t in tallies.items():
            tps = t.tokens / t.seconds
            rows[method] = {
                "tokens_per_second": tps,
                "ratio_to_hf_greedy": tps / base_tps,
                "acceptance_length": t.tokens / t.forwards if t.forwards else None,
                "identical_to_hf_greedy": f"{t.exact}/{t.prompts}",
                "first_divergences": t.first_divergence,
                "new_tokens": t.tokens,
                "depth_acceptance": {d: sum(v) / len(v) for d, v in sorted(depth_rates.get(method, {}).items())},
            }
        results[task] = rows
    return results


def print_table(results: dict, header: str) -> None:
    print(header)
    for task, rows in results.items():
        print(f"\n{task}")
        print(f"  {'method':<18}{'tokens/s':>10}{'vs hf-greedy':>14}{'tau':>7}  identical to hf-greedy")
        for method, r in rows.items():
            tau = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
            div = f" (first divergences at {r['first_divergences']})" if r["first_divergences"] else ""
            print(f"  {method:<18}{r['tokens_per_second']:>10.1f}{r['ratio_to_hf_greedy']:>13.2f}x{tau:>7}  {r['identical_to_hf_greedy']}{div}")
            if r["depth_acceptance"]:
                print(f"  {'':<18}per-depth acceptance (mean over prompts): "
                      + ", ".join(f"d{d} {a:.2f}" for d, a in r["depth_acceptance"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--limit", type=int, default=10, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--hf-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--lookup-tokens", type=int, default=PromptLookupConfig.num_tokens)
    p.add_argument("--lookup-branches", type=int, default=PromptLookupConfig.max_branches)
    p.add_argument("--lookup-nodes", type=int, default=PromptLookupConfig.max_nodes)
    p.add_argument("--drafter", action="append", default=[], help="extra drafter spec for our loop (repeatable), e.g. a drafter folder")
    p.add_argument("--medusa-nodes", type=int, default=None, help="rebuild Medusa drafters' sparse trees for this budget")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    results = run(args)
    print_table(
        results,
        f"{args.target} {args.dtype}, {torch.get_num_threads()} threads, {args.limit} prompts per task, "
        f"{args.max_new_tokens} new tokens, torch {torch.__version__}",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
