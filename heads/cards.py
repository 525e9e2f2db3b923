"""Model cards: the README.md written into every engine export.

A card says what the drafter is for (target, kind, fused layers, draft vocabulary), how it was
trained (data, steps, batch, learning rate), how well (held-out top-1 by depth, and the acceptance
length where one was measured), and the exact command that serves it in that engine.
"""

from __future__ import annotations

import json
from typing import Any


def vllm_command(target: str, folder: str, method: str, num_speculative_tokens: int) -> str:
    """``vllm serve`` with a drafter: vLLM drafts a chain of ``num_speculative_tokens`` tokens."""
    spec = json.dumps({"method": method, "model": folder, "num_speculative_tokens": num_speculative_tokens})
    return f"vllm serve {target} --speculative-config '{spec}'"


def sglang_command(target: str, folder: str, algorithm: str, depth: int, top_k: int, nodes: int) -> str:
    """SGLang's server with an EAGLE-style drafter and its tree settings (``nodes`` draft tokens + the root)."""
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {folder} --speculative-num-steps {depth} "
            f"--speculative-eagle-topk {top_k} --speculative-num-draft-tokens {nodes + 1}")


def sglang_block_command(target: str, folder: str, algorithm: str, verified: int) -> str:
    """SGLang's server with a block drafter (``DFLASH``, ``DSPARK``) verifying ``verified`` tokens a step."""
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {folder} --speculative-num-draft-tokens {verified}")


ENGINE_NOTES = {
    "vllm": ["vLLM drafts a chain of `num_speculative_tokens` tokens. `selfdraft bench --methods vllm:FOLDER` "
             "decodes the same prompts in vLLM beside selfdraft's own loop.", ""],
    "sglang": ["`--speculative-num-steps` is the tree depth, `--speculative-eagle-topk` the children per node, "
               "`--speculative-num-draft-tokens` the tree's draft tokens plus one.", ""],
}


def model_card(*, engine: str, engine_name: str, title: str, target: dict[str, Any], folder: str,
               run_config: dict[str, Any] | None, evaluation: dict[str, Any] | None, details: list[str],
               command: str, acceptance: dict[str, Any] | None = None, python: bool = False,
               notes: list[str] | None = None) -> str:
    """README.md text for an export of a ``title`` drafter (e.g. EAGLE-3) for ``engine``. ``target`` is
    the recorded TargetIdentity dict; ``details`` are layout lines (fused layers, draft vocabulary,
    ...); ``command`` serves it (Python lines when ``python``); ``acceptance`` a measured
    ``{"acceptance_length": float, "where": str}`` or None; ``notes``: lines after the command in place of
    the engine's usual ones."""
    from selfdraft import __version__

    name = title
    lines = [f"# {name} drafter for {target['name']}, exported for {engine_name}", "",
             f"Written by selfdraft {__version__}. Weights: `model.safetensors`; layout: `config.json`.", "",
             "| | |", "|---|---|",
             f"| target | {target['name']} ({target['architecture']}, {target['num_layers']} layers, hidden "
             f"{target['hidden_size']}, vocabulary {target['vocab_size']}, tokenizer sha256 "
             f"{(target['tokenizer_hash'] or 'unknown')[:16]}) |",
             f"| drafter | {name}; " + "; ".join(details) + " |"]
    if run_config:
        data, train = run_config.get("data", {}), run_config.get("train", {})
        lines.append(f"| training data | {data.get('source')} (at most {data.get('max_conversations') or 'all'} "
                     f"conversations, {data.get('max_length')} tokens each, assistant tokens only) |")
        procs = "" if not train else (f"{train.get('max_steps')} steps x {train.get('micro_batch_size')} conversations"
                                      f" x {train.get('grad_accum')} accumulation per process, lr {train.get('lr')}")
        lines.append(f"| training | {procs} |")
    else:
        lines.append("| training | not recorded (an imported drafter) |")
    if evaluation:
        top1 = " / ".join(f"{a:.3f}" for a in evaluation["top1"])
        lines.append(f"| held-out top-1 by depth | {top1} (step {evaluation['step']}) |")
    else:
        lines.append("| held-out top-1 by depth | not recorded |")
    if acceptance:
        lines.append(f"| acceptance length | {acceptance['acceptance_length']:.2f} ({acceptance['where']}) |")
    else:
        lines.append(f"| acceptance length | not measured yet: `selfdraft bench --methods "
                     f"{'vllm:' if engine == 'vllm' else ''}{folder}` measures it |")
    lang = "python" if python else "bash"
    lines += ["", f"## Serve it with {engine_name}", "", f"```{lang}", command, "```", ""]
    lines += ENGINE_NOTES.get(engine, []) if notes is None else notes
    return "\n".join(lines)


PROFILE_FILE = "speculation_profile.json"
"""A drafter's speculation schedule on one machine (``selfdraft costs --drafter``), carried by its exports."""


def sglang_adaptive_config(entries) -> dict[str, dict]:
    """The schedule as SGLang's ``--speculative-adaptive-config`` JSON: a key where the length changes (the
    first at batch size 1), each pinned to its one length, which a batch carries up to the next key as
    ``vllm_ranges`` (inference/cost_report.py) does. ``entries``: schedule entries or their dicts (a profile's
    schedule). Read in sgl-project/sglang ``python/sglang/srt/speculative/adaptive_spec_params.py`` at
    015c872 and ``adaptive_step_router.py`` at a12239f: integer-string batch-size keys, each with
    ``candidate_steps``; a batch takes the largest key at or below its size, after CUDA-graph padding;
    one candidate pins the step count, 0 drafts nothing; EAGLE / EAGLE-3 with top-k 1 only."""
    pairs = sorted((int(e["batch"]), int(e["tokens"])) if isinstance(e, dict) else (e.batch, e.tokens) for e in entries)
    config: dict[str, dict] = {}
    last = None
    for i, (batch, tokens) in enumerate(pairs):
        if tokens != last:
            config["1" if i == 0 else str(batch)] = {"candidate_steps": [tokens]}
            last = tokens
    return config


SGLANG_ADAPTIVE_FILE = "speculative_adaptive.json"
"""In an SGLang export with a speculation profile: the schedule as ``--speculative-adaptive-config``."""


def sglang_settings(entries) -> dict[str, Any]:
    """SGLang's settings for a schedule (entries or their dicts): the longest chain as
    ``speculative_num_steps`` and :func:`sglang_adaptive_config`."""
    longest = max((int(e["tokens"]) if isinstance(e, dict) else e.tokens for e in entries), default=0)
    return {"speculative_num_steps": longest, "speculative_adaptive_config": sglang_adaptive_config(entries)}


def sglang_schedule(profile: dict[str, Any]) -> dict[str, Any]:
    """A profile's SGLang settings; profiles written before they carried them get them from their schedule."""
    return profile["sglang"] if "sglang" in profile else sglang_settings(profile["schedule"])


def profile_section(profile: dict[str, Any], engine: str, folder: str = "FOLDER", per_batch: bool = True) -> str:
    """The model card's section for a speculation profile: the schedule per batch size, where it was
    measured, and the engine's setting that applies it (vLLM's per-batch-size draft lengths, SGLang's
    adaptive config in ``folder``); ``per_batch`` False: the engine verifies a fixed length with this
    layout (SGLang's block drafters), so only where drafting stops paying applies."""
    machine = profile.get("machine", {})
    where = ", ".join(str(machine[k]) for k in ("cpu", "gpu") if machine.get(k)) or "this machine"
    lines = ["", "## Speculation schedule", "",
             f"Planned by `selfdraft costs --drafter` on {where} ({profile['cost_surface']['dtype']}, "
             f"{profile['cost_surface']['device']}) from the held-out acceptance by position "
             f"{' / '.join(f'{a:.2f}' for a in profile['acceptance_by_position'])} and the verify cost measured there "
             f"(`{PROFILE_FILE}` holds the cost table). Another machine needs its own: rerun the command there.", "",
             "| batch size | drafts per step | predicted speedup |", "|---|---|---|"]
    lines += [f"| {e['batch']} | {e['tokens']} | {e['speedup']:.2f}x |" for e in profile["schedule"]]
    if profile.get("drafting_off_above_batch") is not None:
        lines += ["", f"Drafting does not pay above batch size {profile['drafting_off_above_batch']} here."]
    if not any(int(e["tokens"]) for e in profile["schedule"]):
        lines += ["", "Drafting paid at no measured batch size there: serve the target without this drafter on "
                  "that machine."]
    elif not per_batch:
        lines += ["", "This engine verifies the same number of tokens at every batch size with this layout, so the "
                  "schedule applies there only as where drafting stops paying: serve the target without the drafter "
                  "at larger batch sizes."]
    elif engine == "vllm":
        lines += ["", "vLLM applies it per batch size with these speculative-config entries (merged into the "
                  "`--speculative-config` above):", "", "```json", json.dumps(profile["vllm"]), "```"]
    elif engine == "sglang":
        steps = int(sglang_schedule(profile)["speculative_num_steps"])
        lines += ["", f"SGLang applies it per batch size as a chain (its adaptive speculation takes EAGLE and EAGLE-3 "
                  f"with top-k 1 only): `{SGLANG_ADAPTIVE_FILE}` pins the draft steps per batch size (a batch takes "
                  "the largest batch-size key at or below its size, after CUDA-graph padding; 0 steps: no drafting). "
                  "Put these in place of the tree settings of the command above:", "", "```bash",
                  f"--speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1} "
                  f"--speculative-adaptive --speculative-adaptive-config {folder}/{SGLANG_ADAPTIVE_FILE}", "```"]
    return "\n".join(lines) + "\n"
