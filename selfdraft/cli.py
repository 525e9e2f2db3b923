"""The ``selfdraft`` command: thin argument parsing over the Python API.

Errors that a user can fix (a bad option, an unknown target, a prompt that does not fit) are logged
as one line, without a traceback, and exit with status 2. Results go to stdout (the generated text,
tables, where the files are); progress and warnings are log lines on stderr (:mod:`selfdraft.log`).
Building the parser imports neither torch nor transformers, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from selfdraft.errors import SelfdraftError

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_generate(sub) -> None:
    from selfdraft.configs.decode import POLICIES, DecodeConfig, PromptLookupConfig

    p = sub.add_parser(
        "generate",
        help="decode a prompt (or a batch of them) with a drafter and report the acceptance length",
        description="Decode one prompt, or several as one batch. Greedy output (the default, temperature 0) is token-identical to the "
        "target's own greedy output in fp32; sampling keeps the target's distribution exactly.",
        epilog=_trained_kinds,
    )
    p.add_argument("--target", default="smollm2-135m", help="built-in name, local HF folder or hub name (default: %(default)s)")
    from selfdraft.inference.drafter_specs import drafter_specs

    untrained = "; ".join(f"{entry.usage} ({entry.help})" for entry in drafter_specs())
    p.add_argument("--drafter", default="none", help=f"{untrained}; or a drafter folder: native (any trained kind: the "
                   "list below) or an engine export selfdraft reads (default: %(default)s)")
    p.add_argument("--prompt", required=True, action="append",
                   help="the prompt text; give it several times to decode the prompts as one batch (one target forward "
                   "per step for all of them, each row exact as alone)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=_positive_int, default=DecodeConfig.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DecodeConfig.temperature, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=DecodeConfig.top_k, help="0: no top-k limit")
    p.add_argument("--top-p", type=float, default=DecodeConfig.top_p)
    p.add_argument("--seed", type=int, default=DecodeConfig.seed)
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on a CPU), float32 (token identity "
                   "holds) or bfloat16 (default: %(default)s)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.add_argument("--typical-acceptance", action="store_true",
                   help="LOSSY: Medusa's typical acceptance (sampling only); accepts more draft tokens but the "
                   "output no longer follows the target's distribution")
    g = p.add_argument_group("prompt lookup")
    g.add_argument("--lookup-max-ngram", type=_positive_int, default=PromptLookupConfig.max_ngram)
    g.add_argument("--lookup-tokens", type=_positive_int, default=PromptLookupConfig.num_tokens, help="draft tokens per match")
    g.add_argument("--lookup-branches", type=_positive_int, default=PromptLookupConfig.max_branches)
    g = p.add_argument_group("the draft tree (of a drafter folder or draft-model:SPEC; default: the tree stored with "
                             "the drafter, a chain of 4 for a draft model)")
    g.add_argument("--tree-depth", type=_positive_int, default=None, help="draft tokens along the deepest path")
    g.add_argument("--tree-top-k", type=_positive_int, default=None, help="children per expanded node (1: a chain)")
    g.add_argument("--max-nodes", type=_positive_int, default=None,
                   help="the node budget: draft tokens verified per step (a Medusa folder rebuilds its sparse tree for it "
                   "from its stored accuracies; prompt lookup: default %d)" % PromptLookupConfig.max_nodes)
    g = p.add_argument_group("how much to draft")
    g.add_argument("--policy", choices=POLICIES, default="auto",
                   help="adaptive: draft only while drafting pays for the prompt by this machine's measured costs (probing "
                   "now and then once it stops), and verify only the part of a valued tree (a block drafter's, copying's) "
                   "that pays at the live batch size; cut: only the latter; fixed: the drafter's whole tree every step; "
                   "profile: the drafts per batch size of the drafter folder's speculation_profile.json (`selfdraft costs "
                   "--drafter`); auto (default): profile for several prompts whose folder has one, else adaptive")
    _legacy_flags(g)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from selfdraft.configs.decode import DecodeConfig, TreeConfig
    from selfdraft.heads.target import load_target
    from selfdraft.inference.api import generate

    tree = {k: v for k, v in (("depth", args.tree_depth), ("top_k", args.tree_top_k), ("max_nodes", args.max_nodes))
            if v is not None}
    TreeConfig(**tree)  # bad values are refused before the target loads
    DecodeConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 seed=args.seed, acceptance="typical" if args.typical_acceptance else "exact")
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    if len(args.prompt) > 1:
        return _generate_batch(args, target, tree)
    result = generate(
        target,
        args.prompt[0],
        drafter=args.drafter,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        acceptance="typical" if args.typical_acceptance else "exact",
        tree=tree or None,
        policy=_policy(args),
        prompt_lookup=_prompt_lookup(args),
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        lossy = " [LOSSY: typical acceptance, not the target's distribution]" if result.decode["lossy"] else ""
        print(
            f"[{result.drafter}]{lossy} {result.new_tokens} tokens, {result.target_forwards} target forwards, "
            f"acceptance length {result.acceptance_length:.2f}, {result.tokens_per_second:.1f} tokens/s"
            + (f"; drafted {result.drafted_steps} of {result.drafted_steps + result.skipped_steps} steps (the rest did "
               "not pay)" if result.skipped_steps else ""),
            file=sys.stderr,
        )
    return 0


def _legacy_flags(group) -> None:
    """The previous release's options, kept one release as aliases of ``--policy`` (they say which)."""
    group.add_argument("--adaptive", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    group.add_argument("--schedule", choices=("confidence", "off"), default=None, help=argparse.SUPPRESS)
    group.add_argument("--speculation", choices=("auto", "off"), default=None, help=argparse.SUPPRESS)


def _policy(args) -> str:
    """--policy, or what the previous release's flags given instead of it mean (with a warning)."""
    from selfdraft.configs.decode import legacy_policy

    return legacy_policy(getattr(args, "adaptive", None), getattr(args, "schedule", None),
                         getattr(args, "speculation", None)) or args.policy


def _prompt_lookup(args):
    from selfdraft.configs.decode import PromptLookupConfig

    return PromptLookupConfig(max_ngram=args.lookup_max_ngram, min_ngram=1, num_tokens=args.lookup_tokens,
                              max_branches=args.lookup_branches,
                              max_nodes=args.max_nodes or max(PromptLookupConfig.max_nodes, args.lookup_tokens))


def _generate_batch(args, target, tree) -> int:
    """`selfdraft generate` with several --prompt: one batch, a result per prompt."""
    from selfdraft.inference.api import generate_batch

    results = generate_batch(
        target, args.prompt, drafter=args.drafter, chat=args.chat, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seeds=args.seed,
        acceptance="typical" if args.typical_acceptance else "exact", tree=tree or None,
        prompt_lookup=_prompt_lookup(args), policy=_policy(args))
    seconds = max(r.seconds for r in results)
    tokens = sum(r.new_tokens for r in results)
    for i, result in enumerate(results):
        if args.json:
            print(json.dumps({"row": i, **result.to_dict()}))
            continue
        print(result.text + ("\n" if i + 1 < len(results) else ""))
        print(f"[{result.drafter}] row {i}: {result.new_tokens} tokens, {result.target_forwards} target forwards, "
              f"acceptance length {result.acceptance_length:.2f}; done after {result.seconds:.2f} s", file=sys.stderr)
    print(f"[{results[0].drafter}] batch of {len(results)}: {tokens} tokens in {seconds:.2f} s, "
          f"{tokens / seconds:.1f} tokens/s", file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    """An argument parser whose epilog may be a function, called only when the help is shown: the lists of
    kinds and formats come from the registry, whose kinds import torch, which a command line that only asks
    for ``--version`` should not wait for."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def _kinds_and_formats() -> str:
    """What each registered kind writes (from the registry: a kind added at run time is listed too)."""
    from selfdraft.heads.kinds import registered

    lines = [f"  {name}: native, {', '.join(w.format for w in kind.writers) or '(no engine layout)'}"
             for name, kind in registered().items()]
    return "formats by drafter kind:\n" + "\n".join(lines)


def _trained_kinds() -> str:
    from selfdraft.heads.kinds import registered

    return f"trained drafter kinds (registered): {', '.join(registered())}"


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a trained drafter in selfdraft's native layout or a serving engine's",
                       description="Write a trained drafter for a serving engine (with a README.md model card and the "
                       "command that serves it), or as selfdraft's native folder. A drafter the engine cannot load as "
                       "trained is refused with the reason; nothing is written then.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_kinds_and_formats)
    p.add_argument("drafter", help="a training run folder (its drafter/, else its latest checkpoint), a checkpoint folder "
                   "or a native drafter folder")
    p.add_argument("--format", required=True,
                   help="native, or the name of an engine layout the drafter's kind writes (vllm, sglang, ...: each "
                   "kind declares its own, docs/export.md tables them); a name the kind does not write is refused with "
                   "the ones it does")
    p.add_argument("--out", required=True, help="folder to write (replaced atomically)")
    p.add_argument("--target", default=None, help="target spec, needed when the heads share its LM head (default: the recorded target)")
    p.set_defaults(func=_run_export)


def _run_export(args) -> int:
    from selfdraft.train.export import export

    _, message = export(args.drafter, args.format, args.out, target=args.target)
    print(message)
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a drafter (one process; use `accelerate launch -m selfdraft.train` for several)",
                       description="Train a drafter on a frozen target with the run config; same loop as "
                       "`accelerate launch -m selfdraft.train`.")
    p.add_argument("--config", required=True, help="a YAML file or a preset name from configs/ (e.g. smoke_cpu, medusa_smollm2)")
    p.add_argument("--resume", action="store_true", help="continue the run in train.output_dir from its latest checkpoint")
    p.add_argument("--resume-from", default=None, metavar="CHECKPOINT", help="continue from this checkpoint folder instead")
    p.add_argument("overrides", nargs="*", help="dotted overrides: train.lr=3e-4 data.max_length=256 ...")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from selfdraft.configs.run import load_run_config
    from selfdraft.train.loop import train

    config = load_run_config(args.config, args.overrides)  # train() decides train.features: auto
    result = train(config, resume=args.resume_from or args.resume)
    if result.drafter_dir is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"done: {result.step} steps, {result.train_tokens_per_second:.0f} training tokens/s; drafter in {result.drafter_dir}")
    return 0


def _add_features(sub) -> None:
    p = sub.add_parser("features", help="precompute a run's target features to a sharded on-disk cache (one process; "
                       "use `accelerate launch -m selfdraft.features` for several)",
                       description="Run the frozen target once over a run's data and store the hidden states its "
                       "drafter trains on (safetensors shards; rerun to resume). Train from them with "
                       "train.features=DIR: the same batches as computing them online, without the target's forward. "
                       "`accelerate launch [--num_processes N ...] -m selfdraft.features` takes the same arguments and "
                       "shares the shards among the processes; the files do not depend on how many wrote them, and "
                       "any number of processes resumes an interrupted cache.")
    p.add_argument("--config", required=True, help="the run config (a YAML file or a preset name) the cache is for")
    p.add_argument("--out", default=None, help="cache folder (default: the run folder's features/)")
    p.add_argument("--max-gb", type=float, default=20.0, help="refuse to start when the cache would be larger (default 20)")
    p.add_argument("--dtype", default="auto", help="auto (the target's dtype: bit-identical batches), float32, bfloat16")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="cache only the training examples the first N optimizer steps visit (default: all)")
    p.add_argument("--processes", type=_positive_int, default=1,
                   help="processes the run will train with (sets the visit order that --steps covers; not the processes "
                   "that write the cache)")
    p.add_argument("--shard-tokens", type=_positive_int, default=None,
                   help="tokens per shard, the unit of resumption and of sharing among processes (default 65536)")
    p.add_argument("--layers", default=None, help="comma-separated hidden_states indices (default: those the run's drafter needs)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the run config, as for `selfdraft train`")
    p.set_defaults(func=_run_features)


def _run_features(args) -> int:
    from selfdraft.configs.run import load_run_config
    from selfdraft.train.features import write_features

    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    except ValueError:
        raise SelfdraftError(f"--layers {args.layers!r}: give comma-separated integers, e.g. 2,15,27,30") from None
    config = load_run_config(args.config, args.overrides)
    out = write_features(config, args.out, max_gb=args.max_gb, dtype=args.dtype, steps=args.steps,
                         processes=args.processes, layers=layers,
                         **({"shard_tokens": args.shard_tokens} if args.shard_tokens else {}))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote target features to {out}; train from them with train.features={out}")
    return 0


def _add_distill(sub) -> None:
    from selfdraft.train.distill import DistillConfig

    d = DistillConfig()
    p = sub.add_parser("distill", help="regenerate a dataset's assistant turns with the target (self-distillation)",
                       description="Regenerate the assistant turns of a conversation source with the target, into "
                       "sharded JSONL that a training run reads as data.source. Rerun to resume.")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--source", default="sharegpt-embedded", help="sharegpt-embedded, a .json/.jsonl file or a dataset folder")
    p.add_argument("--out", required=True, help="output folder of shard-*.jsonl")
    p.add_argument("--max-conversations", type=_positive_int, default=None)
    p.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens)
    p.add_argument("--max-turns", type=_positive_int, default=d.max_turns)
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size)
    p.add_argument("--shard-size", type=_positive_int, default=d.shard_size)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy answers")
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=d.max_prompt_tokens,
                   help="a conversation whose context before a turn is longer stops before that turn")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on a CPU), float32 or bfloat16")
    p.add_argument("--device", default="cpu")
    s = p.add_argument_group("through a serving engine (the target's weights stay there; only its tokenizer is loaded)")
    s.add_argument("--server", metavar="URL", help="base URL of an OpenAI-compatible chat-completions server serving "
                   "the target (vLLM, SGLang, llama.cpp's server), e.g. http://127.0.0.1:8000")
    s.add_argument("--server-model", default=None, help="the served model's name (default: the only one it lists)")
    s.add_argument("--concurrency", type=_positive_int, default=16, help="requests in flight at once")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    s.add_argument("--retries", type=int, default=5, help="further tries after a transient failure (refused, 429, 5xx)")
    p.set_defaults(func=_run_distill)


def _run_distill(args) -> int:
    from selfdraft.configs.schema import DataConfig
    from selfdraft.heads.target import load_target, load_target_tokenizer
    from selfdraft.train.chat_server import ServerConfig
    from selfdraft.train.distill import DistillConfig, TargetText, distill

    server = None
    if args.server:
        server = ServerConfig(args.server, model=args.server_model, concurrency=args.concurrency,
                              timeout=args.request_timeout, retries=args.retries)
        target = TargetText(*load_target_tokenizer(args.target))
    else:
        target = load_target(args.target, dtype=args.dtype, device=args.device)
    out = distill(target, DataConfig(source=args.source, max_conversations=args.max_conversations), args.out,
                  DistillConfig(max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, batch_size=args.batch_size,
                                shard_size=args.shard_size, temperature=args.temperature,
                                max_prompt_tokens=args.max_prompt_tokens), server=server)
    print(f"wrote self-distilled conversations to {out} (use it as data.source={out})")
    return 0


def _add_bench(sub) -> None:
    from selfdraft.configs.decode import POLICIES, DecodeConfig
    from selfdraft.inference.drafter_specs import drafter_specs

    p = sub.add_parser(
        "bench", help="decoding methods side by side (ours and transformers'), with a report and plots",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode the same prompts with several methods in one process and compare tokens/s, speedup over "
        "our loop without a drafter (`none`, always run), acceptance length and token identity. Writes results.json, "
        "report.md and PNG plots to --out.",
        epilog=f"methods: {', '.join(entry.usage for entry in drafter_specs())}, hf-greedy (temperature 0), hf-sample "
        "(temperature > 0), hf-prompt-lookup (temperature 0), hf-assisted:SPEC, or a trained drafter's folder (native, of "
        "any registered kind, or an engine layout selfdraft reads).\noptions: METHOD@key=value,key=value, e.g. prompt-lookup@tokens=8, "
        "runs/e3/drafter@depth=5,top_k=4,max_nodes=12, runs/m/drafter@max_nodes=16, hybrid:runs/e3/drafter@max_nodes=8, "
        "hf-prompt-lookup@tokens=10, "
        "hf-assisted:SPEC@tokens=5.\ntasks: mt_bench (first turns, chat template; --limit takes the 8 categories in "
        "turn), mt_bench:CATEGORY, humaneval (raw completion), or a JSONL file of {\"prompt\": ..., \"id\": ..., "
        "\"chat\": true}.",
    )
    p.add_argument("--target", default="smollm2-135m", help="built-in name, local HF folder or hub name (default: %(default)s)")
    p.add_argument("--methods", action="append", default=None, metavar="M1,M2,...",
                   help="comma-separated methods, repeatable (default: hf-greedy,hf-prompt-lookup,none,prompt-lookup)")
    p.add_argument("--tasks", default="mt_bench,humaneval", help="comma-separated tasks (default: %(default)s)")
    p.add_argument("--temperatures", default="0", help="comma-separated temperatures, 0 is greedy (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=DecodeConfig.max_new_tokens)
    p.add_argument("--limit", type=int, default=10, help="prompts per task; 0 takes every prompt (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on a CPU), float32 (token identity "
                   "holds) or bfloat16 (default: %(default)s)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0, help="base seed; at temperature > 0 every method uses the same seed per prompt")
    p.add_argument("--out", required=True, help="folder for results.json, report.md and the plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (they need matplotlib)")
    p.add_argument("--fresh", action="store_true",
                   help="discard the journal (OUT/progress.jsonl) of an earlier run; without it, prompts it holds under "
                   "the same settings are reused and only the rest are decoded")
    p.add_argument("--batch-sizes", type=_positive_ints, default=None, metavar="B1,B2,...",
                   help="instead: tokens/s per batch size (e.g. 1,4,16), the prompts decoded B at a time by our batched "
                   "loop, hf-greedy (batched generate()) and vllm:FOLDER (B requests in flight); greedy; writes "
                   "batches.json, batches.md and batches.png")
    p.add_argument("--policy", choices=POLICIES, default="auto",
                   help="with --batch-sizes, how much our loop drafts (`selfdraft generate --help`): auto (default) lets a "
                   "drafter folder's speculation_profile.json set the drafts per batch size, else adaptive; fixed: its own "
                   "tree at every size")
    p.add_argument("--speculation", choices=("auto", "off"), default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    import shlex

    from selfdraft.inference.bench import render_tables, run_bench, split_methods

    if args.limit < 0:
        raise SelfdraftError(f"--limit must be >= 0 (0 takes every prompt), got {args.limit}")
    if args.batch_sizes:
        from selfdraft.inference.bench.batched import REPORT, batch_table, run_batch_bench

        if args.temperatures not in ("0", "0.0"):
            raise SelfdraftError("--batch-sizes benches greedy decoding: leave --temperatures at 0")
        methods = [m for text in (args.methods or ["hf-greedy,none,prompt-lookup"]) for m in split_methods(text)]
        results = run_batch_bench(args.target, methods, args.tasks, args.batch_sizes, args.max_new_tokens,
                                  args.limit or None, args.out, dtype=args.dtype, device=args.device,
                                  policy=_policy(args), plots=not args.no_plots,
                                  command=shlex.join(["selfdraft", *args.argv]))
        print(batch_table(results))
        print(f"\nreport: {os.path.join(args.out, REPORT)} (batches.json and batches.png next to it)")
        return 0
    methods = [m for text in (args.methods or ["hf-greedy,hf-prompt-lookup,none,prompt-lookup"]) for m in split_methods(text)]
    results = run_bench(
        args.target, methods, args.tasks, args.temperatures, args.max_new_tokens, args.limit or None, args.out,
        dtype=args.dtype, device=args.device, threads=args.threads, seed=args.seed, plots=not args.no_plots,
        command=shlex.join(["selfdraft", *args.argv]), fresh=args.fresh,
    )
    print(render_tables(results))
    print(f"\nreport: {os.path.join(args.out, 'report.md')} (results.json and plots next to it)")
    return 0


def _add_quickstart(sub) -> None:
    from selfdraft.quickstart import QuickstartConfig

    d = QuickstartConfig()
    p = sub.add_parser("quickstart", help="the main job on the embedded default: train a drafter, bench it, export it",
                       description="Train the best drafter we have for the embedded SmolLM2-135M-Instruct (or --target) "
                       "within a time budget, benchmark it against the vanilla loop, prompt lookup and transformers' decoding, and "
                       "export it for vLLM and SGLang (model cards with the measured acceptance length). Offline; on a "
                       "CPU or a GPU (--device). Each stage is recorded in OUT/stages.json; rerun to resume or to reuse "
                       "finished stages.")
    p.add_argument("--device", default=d.device, help="auto (a GPU where there is one, else the CPU), cpu or cuda: "
                   "where it trains and benches (default: %(default)s)")
    p.add_argument("--out", default=d.out, help="folder for everything (default: %(default)s)")
    p.add_argument("--budget-minutes", type=float, default=d.budget_minutes,
                   help="training time in minutes (default: %(default)s); loading, evaluation and the bench come on top")
    p.add_argument("--config", default=d.config, help="the run preset or YAML to train (default: %(default)s)")
    p.add_argument("--target", default=None, help="the target to train for and bench on: built-in name, local HF folder "
                   "or hub name (sets the run config's target.spec; default: the preset's)")
    p.add_argument("--bench-limit", type=_positive_int, default=d.bench_limit, help="prompts per bench task (default: %(default)s)")
    p.add_argument("--bench-tasks", default=d.bench_tasks, help="bench tasks (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens, help="bench tokens per prompt (default: %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads for the bench")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the run config, as for `selfdraft train`")
    p.set_defaults(func=_run_quickstart)


def _run_quickstart(args) -> int:
    from selfdraft.inference.bench import render_tables
    from selfdraft.quickstart import QuickstartConfig, quickstart

    qc = QuickstartConfig(out=args.out, budget_minutes=args.budget_minutes, config=args.config,
                          overrides=tuple(args.overrides), target=args.target, bench_tasks=args.bench_tasks,
                          bench_limit=args.bench_limit, max_new_tokens=args.max_new_tokens, threads=args.threads,
                          device=args.device)
    results = quickstart(qc)
    print(render_tables(results))
    print(f"\nreport: {os.path.join(args.out, 'bench', 'report.md')} (results.json and plots next to it)")
    return 0


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _add_costs(sub) -> None:
    p = sub.add_parser("costs", help="measure the target's verify cost T(batch, tokens per row) here: table and plot",
                       description="Time one target forward over B rows of m new tokens each (every row after 256 cached "
                       "tokens) for each batch size and token count, print the table (ms, and T(B, m) / T(B, 1): what "
                       "verifying m - 1 drafts per row costs in plain steps) and write costs.json and costs.png to --out. "
                       "Measured once per machine, target, dtype and grid, then read from the cache.")
    p.add_argument("--target", default="smollm2-135m", help="built-in name, local HF folder or hub name (default: %(default)s)")
    p.add_argument("--batch-sizes", type=_positive_ints, default=[1, 4, 16], help="comma-separated (default: 1,4,16)")
    p.add_argument("--tokens", type=_positive_ints, default=[1, 2, 4, 8, 16, 32],
                   help="tokens per row, comma-separated (default: 1,2,4,8,16,32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on a CPU), float32, bfloat16, float16")
    p.add_argument("--out", default="costs", help="folder for costs.json and costs.png (default: %(default)s)")
    p.add_argument("--drafter", default=None, help="a native drafter folder: also plan its speculation schedule (best "
                   "chain length per batch size from its held-out acceptance by position, these costs and its measured "
                   "drafting cost), print it with vLLM's num_speculative_tokens_per_batch_size, and write "
                   "speculation_profile.json to --out and into the drafter folder (its exports then carry it)")
    p.set_defaults(func=_run_costs)


def _run_costs(args) -> int:
    import json
    import pathlib

    from selfdraft.files import write_atomic
    from selfdraft.heads.target import load_target
    from selfdraft.inference.cost_report import plot_cost_surface
    from selfdraft.inference.costs import cost_surface

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    surface = cost_surface(target, args.batch_sizes, args.tokens)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "costs.json", json.dumps(surface.to_dict(), indent=1))
    plot = plot_cost_surface(surface, out / "costs.png")
    print(f"verify cost of {surface.target} ({surface.dtype}, {surface.device}, {surface.context} tokens cached per row):\n")
    print(surface.table())
    print(f"\nwritten: {out / 'costs.json'}, {plot}")
    if args.drafter:
        from selfdraft.inference.cost_report import write_drafter_profile

        profile, table, written = write_drafter_profile(args.drafter, target, surface, out)
        print(f"\nspeculation schedule of {args.drafter} (held-out acceptance by position "
              f"{' / '.join(f'{a:.2f}' for a in profile['acceptance_by_position'])}):\n")
        print(table)
        off = profile["drafting_off_above_batch"]
        if off is not None:
            print(f"\ndrafting is off above batch {off}")
        print(f"\nvLLM: --speculative-config '{json.dumps(profile['vllm'])}' (merged into the drafter's own)")
        print(f"written: {', '.join(str(w) for w in written)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from selfdraft import __version__

    parser = _Parser(prog="selfdraft", description="Self-drafting heads and exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"selfdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_train(sub)
    _add_distill(sub)
    _add_features(sub)
    _add_quickstart(sub)
    _add_export(sub)
    _add_bench(sub)
    _add_costs(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from selfdraft.log import setup_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        setup_logging()  # a bad $SELFDRAFT_LOG_LEVEL is a SelfdraftError too
        return args.func(args)
    except SelfdraftError as err:
        logger.error("%s", err)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
