"""Fixtures of the GPU check (tests/gpu/test_gpu.py): the device, random-weight targets built there from
configs, the prompts, and the report every test adds its figures to."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import platform
import time

import pytest

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
"""The smoke run's bodies: the same vocabularies and tokenizer, a toy body (on a CPU)."""


def _assets_module():
    spec = importlib.util.spec_from_file_location("selfdraft_gpu_assets", pathlib.Path(__file__).with_name("assets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Gpu:
    """The device, its sizes (``tiny`` off CUDA: the smoke run), the assets, and the report."""

    def __init__(self, device, assets: pathlib.Path, report: pathlib.Path):
        import torch

        self.torch, self.device, self.assets, self.path = torch, device, assets, report
        self.tiny = device.type != "cuda"
        self.report: dict = {"sections": {}}

    def record(self, section: str, **figures) -> dict:
        """Add figures to a section of the report and write it (after every test: a run cut short keeps them)."""
        entry = self.report["sections"].setdefault(section, {})
        entry.update(figures)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        return entry

    def section(self, name: str) -> dict:
        return self.report["sections"].get(name, {})

    def clock(self) -> float:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return round(self.torch.cuda.max_memory_allocated(self.device) / 2**30, 2) if self.device.type == "cuda" else None

    def config(self, which: str):
        from transformers import AutoConfig, LlamaConfig

        if which == "smollm2":
            cfg = AutoConfig.from_pretrained(self.assets / "smollm2")
        else:
            data = json.loads((self.assets / "llama-3.1-8b.json").read_text())
            data.pop("architectures"), data.pop("model_type")
            cfg = LlamaConfig(**data)
            cfg.architectures = ["LlamaForCausalLM"]
        if self.tiny:
            for key, value in TINY.items():
                setattr(cfg, key, value)
        return cfg

    def target(self, which: str, dtype):
        """A selfdraft Target with random weights of the ``which`` shape (smollm2, llama8b), built on the device."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from selfdraft.heads.target import Target, target_identity

        torch = self.torch
        torch.manual_seed(0)
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(self.config(which), dtype=dtype, attn_implementation="sdpa")
        model.eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(self.assets / "smollm2") if which == "smollm2" else None
        if tokenizer is not None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        return Target(model=model, tokenizer=tokenizer,
                      identity=target_identity(f"random-{which}", model.config, tokenizer, type(model).__name__))

    def prompts(self, task: str, n: int, tokenizer) -> list[list[int]]:
        from selfdraft.inference.api import encode_prompt
        from selfdraft.inference.prompts import jsonl_prompts

        return [encode_prompt(tokenizer, p.text, p.chat) for p in jsonl_prompts(self.assets / f"{task}.jsonl", n)]


@pytest.fixture(scope="session")
def gpu(test_device, tmp_path_factory) -> Gpu:
    """The check's state: ``SELFDRAFT_GPU_ASSETS`` (a folder tests/gpu/assets.py wrote; default: written now
    from the embedded target) and the report at ``SELFDRAFT_GPU_REPORT`` (default: a temporary folder)."""
    given = os.environ.get("SELFDRAFT_GPU_ASSETS")
    assets = pathlib.Path(given) if given else _assets_module().prepare(tmp_path_factory.mktemp("gpu-assets"))
    report = pathlib.Path(os.environ.get("SELFDRAFT_GPU_REPORT") or tmp_path_factory.mktemp("gpu-report") / "gpu_check.json")
    check = Gpu(test_device, assets, report)
    import torch
    import transformers

    environment = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                       cuda=torch.version.cuda, device=str(test_device), tiny=check.tiny, machine=platform.machine())
    if (assets / "MANIFEST.json").is_file():
        environment["prepared_from"] = json.loads((assets / "MANIFEST.json").read_text())
    if test_device.type == "cuda":
        from selfdraft.inference.bench.run import _gpu

        environment.update(gpu=_gpu(test_device), bf16_supported=torch.cuda.is_bf16_supported())
    else:
        from selfdraft.machine import cpu_flags, cpu_name

        environment.update(cpu=cpu_name(), cpu_flags=cpu_flags(), threads=torch.get_num_threads())
    check.record("environment", **environment)
    return check


@pytest.fixture(scope="session")
def smollm2_fp32(gpu):
    """SmolLM2-135M's shape in fp32 (random weights, its tokenizer), the prompts of both tasks and
    transformers' own greedy continuations of them (the reference every drafter must reproduce)."""
    torch = gpu.torch
    target = gpu.target("smollm2", torch.float32)
    n_new, per_task = (24, 1) if gpu.tiny else (64, 2)
    prompts = [ids for task in ("mt_bench", "humaneval") for ids in gpu.prompts(task, per_task, target.tokenizer)]
    references = []
    for ids in prompts:
        x = torch.tensor([ids], device=gpu.device)
        out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new,
                                    eos_token_id=None, pad_token_id=0)
        references.append(out[0, len(ids):].tolist())
    return target, prompts, references, n_new


@pytest.fixture(scope="session")
def llama8b(gpu):
    """Llama-3.1-8B's shape in bf16 (random weights; a toy body in fp32 in the smoke run): the costs' target."""
    torch = gpu.torch
    return gpu.target("llama8b", torch.float32 if gpu.tiny else torch.bfloat16)
