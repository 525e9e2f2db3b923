"""Model cards: the README.md written into every engine export.

A card says what the drafter is for (target, kind, fused layers, draft vocabulary), how it was
trained (data, steps, batch, learning rate), how well (held-out top-1 by depth, and the acceptance
length where one was measured), and the exact command that serves it in that engine.
"""

from __future__ import annotations

import json
from typing import Any

KIND_NAMES = {"medusa": "Medusa", "eagle": "EAGLE-1", "eagle3": "EAGLE-3"}


def serving_command(engine: str, kind: str, target: str, folder: str, depth: int, top_k: int, nodes: int) -> str:
    """The shell command (or Python lines) that serves ``folder`` with ``target`` in ``engine``.
    ``depth``/``top_k``/``nodes`` are our dynamic-tree settings (a chain for Medusa in vLLM)."""
    if engine == "vllm":
        method = {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle3"}[kind]
        spec = json.dumps({"method": method, "model": folder, "num_speculative_tokens": depth})
        return f"vllm serve {target} --speculative-config '{spec}'"
    if engine == "sglang":
        algorithm = "EAGLE3" if kind == "eagle3" else "EAGLE"
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
                f"--speculative-draft-model-path {folder} --speculative-num-steps {depth} "
                f"--speculative-eagle-topk {top_k} --speculative-num-draft-tokens {nodes + 1}")
    if engine == "eagle":  # SafeAILab/EAGLE: depth counts drafter forwards after the first, total_token includes the root
        return ("from eagle.model.ea_model import EaModel\n"
                f"model = EaModel.from_pretrained(base_model_path={target!r}, ea_model_path={folder!r},\n"
                f"                                total_token={nodes + 1}, depth={max(depth - 1, 1)}, top_k={top_k}, "
                f"use_eagle3={kind == 'eagle3'})")
    raise ValueError(f"unknown engine {engine!r}")


def model_card(*, engine: str, engine_name: str, kind: str, target: dict[str, Any], target_path: str, folder: str,
               run_config: dict[str, Any] | None, evaluation: dict[str, Any] | None, tree: dict[str, int],
               details: list[str], acceptance: dict[str, Any] | None = None) -> str:
    """README.md text for an export. ``target`` is the recorded TargetIdentity dict; ``details`` are
    layout lines (fused layers, draft vocabulary, ...); ``acceptance`` a measured
    ``{"acceptance_length": float, "where": str}`` or None."""
    from selfdraft import __version__

    name = KIND_NAMES[kind]
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
    command = serving_command(engine, kind, target_path, folder, tree["depth"], tree["top_k"], tree["max_nodes"])
    lang = "python" if engine == "eagle" else "bash"
    lines += ["", f"## Serve it with {engine_name}", "", f"```{lang}", command, "```", ""]
    if engine == "vllm":
        lines += ["vLLM drafts a chain of `num_speculative_tokens` tokens. `selfdraft bench --methods vllm:FOLDER` "
                  "decodes the same prompts in vLLM beside selfdraft's own loop.", ""]
    elif engine == "sglang":
        lines += ["`--speculative-num-steps` is the tree depth, `--speculative-eagle-topk` the children per node, "
                  "`--speculative-num-draft-tokens` the tree's draft tokens plus one.", ""]
    return "\n".join(lines)
