"""Golden exports: a fixed-seed run of every drafter kind, exported in every format its kind writes, must
give the files recorded in ``tests/golden/exports.json``.

A change meant to leave behaviour alone (a refactor) must leave every export of a fixed-seed run as it
was. Each kind trains a few optimizer steps (fp32, one thread, fixed seeds) on the tiny random Llama of
``conftest.tiny_target`` over a handful of fixed conversations, then every engine format of its kind
is written (a format it refuses is recorded with the refusal). Per exported file the golden keeps:

* weights (``.safetensors``): per tensor its shape, dtype and sha256, and a summary (sum, sum of
  absolute values and eight values at fixed strides) that other processors reproduce to rounding;
* JSON files: the parsed content with the run's temporary folder written as ``<run>``;
* any other file (the model card): its sha256 with the same substitution.

Tensor bytes are compared exactly where the golden was written under the same numerics (torch version
and the bits of a fixed float32 matmul, which differ between kernels of different processors); where
they differ, the summaries must agree to 1e-4 relative. Everything else is compared exactly.

A deliberate change of what an export holds rewrites the golden, and review sees the diff:

    SELFDRAFT_WRITE_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_export_golden.py
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import pytest
import torch

GOLDEN = pathlib.Path(__file__).parent / "golden" / "exports.json"
STEPS = 3
RUNS = {
    # name: (preset, overrides)
    "medusa": ("smoke_cpu", ["drafter.medusa.num_heads=2"]),
    "medusa2": ("smoke_cpu", ["drafter.medusa.num_heads=2", "drafter.medusa.lora.rank=2"]),
    "eagle": ("smoke_eagle", []),
    "eagle3": ("smoke_eagle3", ["drafter.eagle.draft_vocab_size=256"]),
    "dflash": ("smoke_cpu", ["drafter.kind=dflash", "drafter.block.block_size=4", "drafter.block.draft_vocab_size=256"]),
    "dspark": ("smoke_cpu", ["drafter.kind=dspark", "drafter.block.block_size=4", "drafter.block.draft_vocab_size=256"]),
}
CONVERSATIONS = [
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("What is 17 times 3?", "17 times 3 is 51."),
    ("Name three primary colours.", "Red, yellow and blue are the traditional primary colours."),
    ("Translate 'good morning' into French.", "'Good morning' in French is 'bonjour'."),
    ("def add(a, b):", "    return a + b\n\nprint(add(2, 3))  # 5"),
    ("Give a synonym for 'quick'.", "A synonym for 'quick' is 'rapid'."),
    ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue light scatters the most."),
    ("List the days of the weekend.", "Saturday and Sunday."),
]


def numerics() -> str:
    """torch's version and the bits of a fixed float32 matmul on this processor's kernels: where two
    machines agree, a fixed-seed run gives the same bytes on both."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(67, 129, generator=g), torch.randn(129, 33, generator=g)
    probe = (a @ b).numpy().tobytes() + torch.nn.functional.linear(a, b.T).numpy().tobytes()
    return f"torch {torch.__version__} / matmul {hashlib.sha256(probe).hexdigest()[:16]}"


def summary(t: torch.Tensor) -> list[float]:
    """sum, sum of |x| and eight values at fixed strides of ``t``, in float64."""
    flat = t.detach().to(torch.float64).flatten()
    picks = [flat[(i * max(1, flat.numel() // 8)) % flat.numel()].item() for i in range(8)] if flat.numel() else []
    return [flat.sum().item(), flat.abs().sum().item(), *picks]


def fingerprint(folder: pathlib.Path, paths: dict[str, str]) -> dict:
    """Per file of ``folder``: tensors' shapes, dtypes, sha256 and summaries; JSON content; other files'
    sha256; with each absolute path of ``paths`` written as its placeholder."""
    from safetensors import safe_open

    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        if path.suffix == ".safetensors":
            tensors = {}
            with safe_open(str(path), "pt") as f:
                for key in sorted(f.keys()):
                    t = f.get_tensor(key)
                    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
                    tensors[key] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                    "sha256": hashlib.sha256(raw).hexdigest(), "summary": summary(t)}
            files[name] = {"tensors": tensors}
        else:
            text = path.read_text(encoding="utf-8")
            for real, placeholder in paths.items():
                text = text.replace(real, placeholder)
            files[name] = {"json": json.loads(text)} if path.suffix == ".json" else \
                {"sha256": hashlib.sha256(text.encode()).hexdigest()}
    return files


def golden_run(tiny_target: pathlib.Path, root: pathlib.Path) -> dict:
    """{run: {format: fingerprint or {"refused": message}}} of every run in RUNS, trained and exported under ``root``."""
    from selfdraft.configs.run import load_run_config
    from selfdraft.errors import SelfdraftError
    from selfdraft.heads.registry import export_formats
    from selfdraft.train.export import export
    from selfdraft.train.loop import train

    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS), encoding="utf-8")
    paths = {str(root): "<run>", str(tiny_target): "<target>"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, (preset, overrides) in RUNS.items():
            config = load_run_config(preset, [
                *overrides, f"target.spec={tiny_target}", "target.dtype=float32", f"data.source={data}",
                "data.max_length=64", "data.max_conversations=8", "data.eval_fraction=0", f"train.output_dir={root / name}",
                f"train.max_steps={STEPS}", "train.micro_batch_size=2", "train.grad_accum=1", "train.warmup_steps=1",
                "train.eval_every=0", f"train.save_every={STEPS}", "train.log_every=1", "train.mixed_precision=no",
                "train.seed=0"])
            drafter = train(config).drafter_dir
            exports = {"native": fingerprint(drafter, paths)}
            for fmt in export_formats()[1:]:
                try:
                    folder, _ = export(drafter, fmt, root / f"{name}-{fmt}")
                except SelfdraftError as err:
                    message = str(err)
                    for real, placeholder in paths.items():
                        message = message.replace(real, placeholder)
                    exports[fmt] = {"refused": message}
                    continue
                exports[fmt] = fingerprint(folder, paths)
            out[name] = exports
        return out
    finally:
        torch.set_num_threads(threads)


def differences(got: dict, want: dict, exact_bytes: bool, where: str = "") -> list[str]:
    """What differs between two fingerprints (of runs, formats, files, tensors), one line each."""
    if isinstance(want, dict) and isinstance(got, dict):
        if "tensors" in want and "tensors" in got:
            return [line for key in sorted(set(got["tensors"]) | set(want["tensors"]))
                    for line in _tensor(got["tensors"].get(key), want["tensors"].get(key), exact_bytes, f"{where}/{key}")]
        if "json" in want or "sha256" in want or "refused" in want:
            return [] if got == want else [f"{where}: differs:\n  golden {json.dumps(want)[:400]}\n  now    {json.dumps(got)[:400]}"]
        lines = []
        for key in sorted(set(got) | set(want)):
            if key not in got:
                lines.append(f"{where}/{key}: missing now")
            elif key not in want:
                lines.append(f"{where}/{key}: not in the golden")
            else:
                lines += differences(got[key], want[key], exact_bytes, f"{where}/{key}")
        return lines
    return [] if got == want else [f"{where}: {got!r} != golden {want!r}"]


def _tensor(got, want, exact_bytes: bool, where: str) -> list[str]:
    if got is None or want is None:
        return [f"{where}: {'missing now' if got is None else 'not in the golden'}"]
    if (got["shape"], got["dtype"]) != (want["shape"], want["dtype"]):
        return [f"{where}: {got['dtype']}{got['shape']} != golden {want['dtype']}{want['shape']}"]
    if exact_bytes:
        return [] if got["sha256"] == want["sha256"] else [f"{where}: bytes differ (summary {got['summary'][:3]} vs {want['summary'][:3]})"]
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got["summary"], want["summary"]))
    return [] if close else [f"{where}: summary {got['summary']} != golden {want['summary']}"]


@pytest.mark.slow
def test_a_fixed_seed_run_exports_what_the_golden_records(tiny_target, tmp_path):
    got = golden_run(tiny_target, tmp_path)
    if os.environ.get("SELFDRAFT_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"numerics": numerics(), "runs": got}, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {GOLDEN} (SELFDRAFT_WRITE_GOLDEN=1): review its diff")
    if not GOLDEN.is_file():
        pytest.fail(f"{GOLDEN} is missing: SELFDRAFT_WRITE_GOLDEN=1 pytest tests/test_export_golden.py writes it")
    golden = json.loads(GOLDEN.read_text())
    exact = golden["numerics"] == numerics()
    problems = differences(got, golden["runs"], exact)
    print(f"\ngolden exports: {sum(len(v) for v in got.values())} exports of {len(got)} runs compared "
          f"({'bytes' if exact else 'summaries: golden numerics ' + golden['numerics'] + ', here ' + numerics()})", end="")
    assert not problems, "the exports differ from tests/golden/exports.json:\n" + "\n".join(problems[:40])


def test_the_comparison_catches_what_a_refactor_could_change(tmp_path):
    """A transposed or rescaled tensor, a renamed one, a changed config value and a file gone: each is named,
    by bytes and (for tensors of the same shape) by the summaries other processors compare."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 6, generator=g)
    save_file({"w": w, "b": torch.randn(6, generator=g)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"aux_layers": [2, 3, 4], "out": str(tmp_path)}))
    base = fingerprint(tmp_path, {str(tmp_path): "<run>"})
    assert base["config.json"] == {"json": {"aux_layers": [2, 3, 4], "out": "<run>"}}
    assert differences(base, base, True) == [] and differences(base, base, False) == []
    for changed in ({"w": w.T.contiguous()}, {"w": w * 1.001}, {"weight": w}):
        save_file({**changed, "b": torch.zeros(6)}, tmp_path / "model.safetensors")
        now = fingerprint(tmp_path, {str(tmp_path): "<run>"})
        for exact in (True, False):
            assert differences(now, base, exact), (changed, exact)
    (tmp_path / "config.json").write_text(json.dumps({"aux_layers": [3, 4, 5], "out": str(tmp_path)}))
    (tmp_path / "model.safetensors").unlink()
    lines = differences(fingerprint(tmp_path, {str(tmp_path): "<run>"}), base, True)
    assert any(line.startswith("/config.json") for line in lines) and "/model.safetensors: missing now" in lines
