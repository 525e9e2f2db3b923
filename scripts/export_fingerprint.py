"""Fingerprint the exports of a fixed-seed run of every drafter kind, and compare two versions of the code.

    .venv/bin/python scripts/export_fingerprint.py                          # fingerprint the working tree's code
    .venv/bin/python scripts/export_fingerprint.py --compare HEAD           # ... and HEAD's, file by file
    .venv/bin/python scripts/export_fingerprint.py --compare HEAD --baseline-json /tmp/fingerprint-baseline.json
    .venv/bin/python scripts/export_fingerprint.py --against /tmp/fingerprint-baseline.json  # reuse a saved baseline
    .venv/bin/python scripts/export_fingerprint.py --repeat                 # the working tree twice: is it deterministic?
    .venv/bin/python scripts/export_fingerprint.py --compare HEAD --bench   # ... then bench the same drafters with both
    .venv/bin/python scripts/export_fingerprint.py --against /tmp/fingerprint-baseline.json --bench-only  # the bench alone

A refactor that must leave behaviour unchanged (issue 25) must leave the exports of a fixed-seed run
byte-identical. This script trains, on the CPU in fp32 (``train.mixed_precision=no``,
``target.dtype=float32``) with fixed seeds and one thread, a few optimizer steps of each drafter kind
(``medusa`` from the ``smoke_cpu`` preset, ``eagle`` from ``smoke_eagle``, ``eagle3`` from
``smoke_eagle3``; ``--kinds`` also takes ``medusa2``: ``smoke_cpu`` with LoRA rank 2) on a few short
conversations, then writes every export format the CLI lists (``selfdraft export --help``) and prints,
for each export folder, the sha256 of each weights file and of ``config.json``. A format the code
refuses for a kind (Medusa has no SGLang loader) is recorded as refused, with the reason.

Everything goes through the CLI (``python -m selfdraft.cli train|export``) in subprocesses, so the
same recipe runs against an older checkout: ``--compare REV`` makes a temporary ``git worktree`` of
REV under the work folder, builds a wheel of it and installs that (``pip install --no-deps --target``)
into a private folder put first on ``PYTHONPATH``; ``/work/main/.venv`` is not touched. Both sides
print ``selfdraft.__file__`` so you can see which code ran. Both sides train and export under the same
absolute paths (WORK/run, then moved to WORK/<side>), so paths recorded in the files cannot differ.

Format names may be renamed by a refactor: ``--format-alias OLD=NEW`` (default ``eagle=eagle-reference``)
names formats by NEW in the report, and each side is asked for NEW first and for OLD when its CLI
refuses NEW as an unknown choice.

Verdicts, per file:

* weights files (``*.safetensors`` ...) must be identical; where they differ, the tensors that differ
  are named (with the largest absolute difference when both files are still on disk);
* ``config.json`` of an engine layout (vllm, sglang, eagle-reference) must be identical;
* ``config.json`` of the native folder embeds the resolved run config (``run_config``) and the decode
  defaults (``decode``), whose schema a refactor may change: a difference confined to those keys
  (``--schema-keys``) is a "schema" difference, shown but not a failure; one elsewhere is a failure;
* any other file (the README.md model card) is reported, never a failure.

Every differing config.json is shown as a unified diff of the parsed JSON (sorted keys, indented).
Exit status: 0 when nothing that must be identical differs, 1 when something does, 2 when the recipe
could not run (a failed training or export, a REV that does not build).

``--bench`` (issue 25: "bench figures of a fixed drafter equal within noise"): after the exports, the
native folder of each kind written by the baseline side's run (the native format is the same in both
versions, so both sides decode identical weights) is benched with the baseline side's code, then with
the current side's, one after the other: ``python -m selfdraft.cli bench --target T --methods
none,prompt-lookup,<medusa folder>,<eagle folder>,<eagle3 folder> --tasks mt_bench,humaneval --limit 3
--max-new-tokens 48 --dtype float32 --threads 1 --no-plots --out WORK/bench/<side> --fresh`` (T: the
target the runs trained against, the smoke presets' embedded smollm2-135m; no tree options, whose syntax
differs between versions; ``--bench-tasks``, ``--bench-limit``, ``--bench-max-new-tokens``,
``--bench-target`` change the recipe). Each bench process prints the ``selfdraft.__file__`` it imported.
Then, per (task, method) row of the two results.json (and per category row): the deterministic fields
(acceptance length, tokens emitted, target forwards, exactness and mismatches, the accept histogram,
per-depth acceptance, draft nodes per step) and the token ids of every generation (from each side's
journal, progress.jsonl) must be identical: any difference fails (exit 1). The speedup over ``none`` is
shown side by side with the ratio new/old, "within noise" inside 1 +- ``--bench-noise`` (0.15), else
flagged prominently but never a failure (the machine is shared). ``--bench-only`` skips the exports and
benches the folders of ``--against JSON`` (rebuilding the commit it records) or of ``--compare REV``
(WORK/rev-<commit> left by an earlier run). The bench adds about 2 x 5-10 minutes on 2 shared cores.

Runtime: about 2.5-3 minutes per side on 2 shared CPU cores (a subprocess per training and per export,
each paying the torch import and the target load): about 6 minutes for ``--compare``, 3 for
``--against`` a saved baseline. Work files go to ``--work`` (default /tmp/export-fingerprint): the
exports of each side in WORK/<side>/exports, every subprocess's command line and output in WORK/logs/<side>/.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent

KINDS = {
    # kind: (preset, extra overrides)
    "medusa": ("smoke_cpu", []),
    "eagle": ("smoke_eagle", []),
    "eagle3": ("smoke_eagle3", []),
    "medusa2": ("smoke_cpu", ["drafter.medusa.lora.rank=2"]),
}
DEFAULT_KINDS = "medusa,eagle,eagle3"

# The recipe: keys every version of the run config has had since the smoke presets existed.
RECIPE = [
    "train.mixed_precision=no",
    "target.dtype=float32",
    "train.seed=0",
    "data.seed=0",
    "data.max_conversations=16",
    "data.max_length=64",
    "data.eval_fraction=0.125",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.save_every=0",
    "train.log_every=1",
    "train.report_to=none",
]
DEFAULT_FORMATS = ["native", "vllm", "sglang", "eagle"]  # when `export --help` lists no choices
DEFAULT_ALIASES = ["eagle=eagle-reference"]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy", ".npz")
ENV_DROP = ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ----------------------------------------------------------------------------------------------
# Small helpers


def log(message: str = "") -> None:
    print(message, flush=True)


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def category(rel: str) -> str:
    name = rel.rsplit("/", 1)[-1]
    if name == "config.json":
        return "config"
    if name.endswith(WEIGHT_SUFFIXES):
        return "weights"
    return "other"


def safetensors_header(path: pathlib.Path) -> tuple[dict, int]:
    """(the JSON header, the offset where tensor data starts) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def safetensors_digest(path: pathlib.Path) -> dict:
    """Per-tensor dtype, shape and sha256 of the data, and the file's metadata."""
    header, start = safetensors_header(path)
    out = {"metadata": header.pop("__metadata__", None), "tensors": {}}
    with open(path, "rb") as f:
        for name, info in sorted(header.items()):
            a, b = info["data_offsets"]
            f.seek(start + a)
            out["tensors"][name] = {"dtype": info["dtype"], "shape": info["shape"],
                                    "sha256": hashlib.sha256(f.read(b - a)).hexdigest()}
    return out


def tensor_difference(a_path: pathlib.Path, b_path: pathlib.Path, name: str) -> str:
    """'max |a-b| = x over n of m elements' for one tensor present in both files (needs numpy)."""
    try:
        import numpy as np
    except ImportError:
        return ""
    arrays = []
    for path in (a_path, b_path):
        header, start = safetensors_header(path)
        info = header[name]
        lo, hi = info["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + lo)
            raw = f.read(hi - lo)
        dtype = info["dtype"]
        if dtype == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            np_dtype = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                        "I8": "i1", "U8": "u1", "BOOL": "?"}.get(dtype)
            if np_dtype is None:
                return ""
            arr = np.frombuffer(raw, dtype=np_dtype)
        arrays.append(arr.astype(np.float64))
    a, b = arrays
    if a.shape != b.shape:
        return ""
    diff = np.abs(a - b)
    return f"max |diff| {diff.max():.3g}, {int((diff > 0).sum())} of {diff.size} elements differ"


def json_lines(data) -> list[str]:
    return json.dumps(data, indent=2, sort_keys=True).splitlines()


def flatten(data, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict):
        out: dict[str, object] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: data}


def key_changes(a: dict, b: dict) -> dict[str, list[str]]:
    fa, fb = flatten(a), flatten(b)
    return {"removed": sorted(set(fa) - set(fb)), "added": sorted(set(fb) - set(fa)),
            "changed": sorted(k for k in set(fa) & set(fb) if fa[k] != fb[k])}


# ----------------------------------------------------------------------------------------------
# One side: a version of the code, run through its CLI


class Side:
    def __init__(self, label: str, python: str, pythonpath: str | None, root: pathlib.Path, threads: int,
                 hide_gpus: bool, timeout: float, description: str):
        self.label, self.python, self.pythonpath = label, python, pythonpath
        self.root, self.threads, self.hide_gpus, self.timeout = root, threads, hide_gpus, timeout
        self.description = description
        self.format_names: dict[str, str] = {}  # canonical -> the name this side's CLI took
        self.logs = root / "logs" / label
        self.calls = 0
        self.commit: str | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ENV_DROP and not k.startswith("ACCELERATE_")}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
                   DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0",
                   OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads), PYTHONDONTWRITEBYTECODE="1")
        if self.hide_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def run(self, args: list[str], name: str) -> tuple[int, str, str, float]:
        """Run ``python ARGS`` with this side's environment, in the work folder (never the repository,
        whose selfdraft/ would shadow the copy on PYTHONPATH). Returns (rc, stdout, stderr, seconds)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.calls += 1
        start = time.monotonic()
        try:
            proc = subprocess.run([self.python, *args], cwd=self.root, env=self.env(), capture_output=True,
                                  text=True, timeout=self.timeout)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = 124, exc.stdout or "", (exc.stderr or "") + f"\n[timed out after {self.timeout:.0f} s]"
            out = out.decode() if isinstance(out, bytes) else out
            err = err.decode() if isinstance(err, bytes) else err
        seconds = time.monotonic() - start
        (self.logs / f"{self.calls:02d}-{name}.log").write_text(
            f"$ {shlex.join([self.python, *args])}\n# rc {rc}, {seconds:.1f} s\n--- stdout\n{out}\n--- stderr\n{err}\n")
        return rc, out, err, seconds

    def probe(self) -> dict:
        code = ("import json, selfdraft, selfdraft.cli, importlib; "
                "m = {n: getattr(importlib.import_module(n), '__file__', None) for n in "
                "('selfdraft', 'selfdraft.cli', 'selfdraft.configs.run')}; "
                "print(json.dumps({'files': m, 'version': selfdraft.__version__}))")
        rc, out, err, _ = self.run(["-c", code], "probe")
        if rc != 0:
            raise RecipeError(f"[{self.label}] cannot import selfdraft:\n{tail(err)}")
        info = json.loads(out.strip().splitlines()[-1])
        rc, out, err, _ = self.run(["-m", "selfdraft.cli", "export", "--help"], "export-help")
        m = re.search(r"--format\s+\{([^}]*)\}", out)
        info["export_choices"] = m.group(1).split(",") if m else None
        return info

    def export(self, run_dir: pathlib.Path, canonical: str, old: str | None, out: pathlib.Path) -> dict:
        """Export with the canonical (new) format name, else with the old one when the CLI refuses the
        new. Returns {status: ok | refused | error, cli_format, seconds, message, attempts}."""
        names = [self.format_names[canonical]] if canonical in self.format_names else [canonical] + ([old] if old else [])
        attempts = []
        for name in names:
            shutil.rmtree(out, ignore_errors=True)
            rc, _, stderr, seconds = self.run(
                ["-m", "selfdraft.cli", "export", str(run_dir), "--format", name, "--out", str(out)],
                f"export-{run_dir.name}-{name}")
            attempt = {"cli_format": name, "rc": rc, "seconds": round(seconds, 1)}
            attempts.append(attempt)
            if rc == 0 and out.is_dir():
                attempt["status"] = "ok"
                self.format_names[canonical] = name
                break
            # A refusal is the CLI's one-line error (exit status 2, no traceback); anything else is a failure.
            lines = [line for line in stderr.strip().splitlines() if line.strip()]
            if rc == 2 and lines and "Traceback" not in stderr:
                attempt["status"] = "refused"
                attempt["message"] = re.sub(r"^selfdraft(?: \w+)?: error: ", "", lines[-1])
                attempt["unknown_name"] = "invalid choice" in stderr or "unknown export format" in stderr
            else:
                attempt["status"] = "error"
                attempt["message"] = f"rc {rc}: {tail(stderr, 3)}"
                break
        # Report the success, else the most telling refusal: not an unknown-name one where another exists.
        chosen = next((a for a in attempts if a["status"] == "ok"), None) or \
            next((a for a in attempts if a["status"] == "error"), None) or \
            next((a for a in attempts if not a.get("unknown_name")), attempts[-1])
        record = {k: chosen[k] for k in ("status", "cli_format", "seconds", "message") if k in chosen}
        if len(attempts) > 1:
            record["attempts"] = attempts
        return record


class RecipeError(Exception):
    pass


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def folder_files(folder: pathlib.Path) -> dict[str, dict]:
    files = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(folder).as_posix()
        entry: dict = {"category": category(rel), "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        if rel.endswith(".safetensors"):
            with contextlib.suppress(Exception):
                entry["safetensors"] = safetensors_digest(path)
        if entry["category"] == "config":
            try:
                entry["json"] = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                entry["json"] = None
        files[rel] = entry
    return files


def fingerprint(side: Side, kinds: list[str], steps: int, aliases: dict[str, str], extra: list[str],
                formats: list[str] | None = None) -> dict:
    """Train and export every kind with ``side``'s code; return the fingerprint (and leave the folders
    under WORK/<label>)."""
    log(f"\n=== {side.label}: {side.description}")
    info = side.probe()
    log(f"[{side.label}] selfdraft.__file__ = {info['files']['selfdraft']} (selfdraft.cli: {info['files']['selfdraft.cli']}, "
        f"selfdraft.configs.run: {info['files']['selfdraft.configs.run']})")
    choices = info["export_choices"] or DEFAULT_FORMATS
    if formats is None:
        formats = list(dict.fromkeys(aliases.get(c, c) for c in choices))
    back = {new: old for old, new in aliases.items()}
    log(f"[{side.label}] export --format choices: " + (", ".join(info["export_choices"]) if info["export_choices"] else
        "not listed by --help") + f"; writing {', '.join(formats)}")

    live = side.root / "run"  # the same absolute path for every side
    dest = side.root / side.label
    shutil.rmtree(live, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    started = time.monotonic()
    result = {"label": side.label, "description": side.description, "code": info, "python": side.python,
              "pythonpath": side.pythonpath, "threads": side.threads, "steps": steps, "kinds": {}, "errors": []}
    for kind in kinds:
        preset, kind_overrides = KINDS[kind]
        run_dir = live / "runs" / kind
        overrides = [f"train.output_dir={run_dir}", f"train.max_steps={steps}", *RECIPE, *kind_overrides, *extra]
        args = ["-m", "selfdraft.cli", "train", "--config", preset, *overrides]
        log(f"[{side.label}] train {kind}: selfdraft train --config {preset} ... ({steps} steps)")
        rc, out, err, seconds = side.run(args, f"train-{kind}")
        entry: dict = {"preset": preset, "overrides": overrides, "train_seconds": round(seconds, 1), "exports": {}}
        result["kinds"][kind] = entry
        if rc != 0:
            entry["error"] = f"training failed (rc {rc}): {tail(err, 3)}"
            result["errors"].append(f"{kind}: {entry['error']}")
            log(f"[{side.label}]   TRAINING FAILED (rc {rc}); log in {side.logs}:\n{tail(err)}")
            continue
        done = [line for line in out.splitlines() if line.startswith("done:")]
        entry["train_done"] = done[-1] if done else None
        log(f"[{side.label}]   {done[-1] if done else 'trained'} ({seconds:.0f} s)")
        for fmt in formats:
            out_dir = live / "exports" / kind / fmt
            record = side.export(run_dir, fmt, back.get(fmt), out_dir)
            used, seconds = record["cli_format"], record["seconds"]
            if record["status"] == "ok":
                record["files"] = folder_files(out_dir)
                log(f"[{side.label}]   export {kind} {fmt}" + (f" (as --format {used})" if used != fmt else "")
                    + f": {len(record['files'])} files ({seconds:.0f} s)")
                for rel, f in record["files"].items():
                    if f["category"] in ("weights", "config"):
                        log(f"      {f['sha256']}  {kind}/{fmt}/{rel}")
            elif record["status"] == "refused":
                log(f"[{side.label}]   export {kind} {fmt}: refused (--format {used}): {record['message']}")
            else:
                result["errors"].append(f"{kind} {fmt}: export failed ({record['message'].splitlines()[0]})")
                log(f"[{side.label}]   export {kind} {fmt}: FAILED; log in {side.logs}:\n{record['message']}")
            entry["exports"][fmt] = record
    result["seconds"] = round(time.monotonic() - started, 1)
    shutil.rmtree(live / "runs", ignore_errors=True)  # checkpoints and rendered data: not needed
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(live, dest)
    result["folder"] = str(dest)
    log(f"[{side.label}] done in {result['seconds']:.0f} s; exports in {dest / 'exports'}")
    return result


# ----------------------------------------------------------------------------------------------
# Comparison


def compare(base: dict, cur: dict, schema_keys: set[str]) -> dict:
    """Per export file: identical / schema / differs / info, with details; and whether any must-match file differs."""
    rows: list[dict] = []
    failed = False
    bname, cname = base["label"], cur["label"]
    for kind in list(dict.fromkeys([*base["kinds"], *cur["kinds"]])):
        bk, ck = base["kinds"].get(kind), cur["kinds"].get(kind)
        if bk is None or ck is None:
            rows.append({"kind": kind, "format": "*", "file": "*", "verdict": "differs",
                         "detail": f"kind only run by {cname if bk is None else bname}"})
            failed = True
            continue
        if bk.get("error") or ck.get("error"):
            rows.append({"kind": kind, "format": "*", "file": "*", "verdict": "error",
                         "detail": "; ".join(f"{n}: {k['error']}" for n, k in ((bname, bk), (cname, ck)) if k.get("error"))})
            failed = True
            continue
        for fmt in list(dict.fromkeys([*bk["exports"], *ck["exports"]])):
            be, ce = bk["exports"].get(fmt), ck["exports"].get(fmt)
            where = {"kind": kind, "format": fmt}
            if be is None or ce is None:
                rows.append({**where, "file": "*", "verdict": "differs",
                             "detail": f"format offered only by {cname if be is None else bname}"})
                failed = True
                continue
            if be["status"] != "ok" or ce["status"] != "ok":
                if be["status"] == ce["status"] == "refused":
                    same = be["message"] == ce["message"]
                    rows.append({**where, "file": "*", "verdict": "refused by both",
                                 "detail": be["message"] if same else
                                 f"message changed: {bname}: {be['message']!r} | {cname}: {ce['message']!r}"})
                else:
                    verdict = "error" if "error" in (be["status"], ce["status"]) else "differs"
                    rows.append({**where, "file": "*", "verdict": verdict,
                                 "detail": f"{bname}: {be['status']} {be.get('message', '')} | "
                                           f"{cname}: {ce['status']} {ce.get('message', '')}".strip()})
                    failed = True
                continue
            bf, cf = be["files"], ce["files"]
            for rel in sorted(set(bf) | set(cf)):
                row = {**where, "file": rel, "category": category(rel)}
                rows.append(row)
                a, b = bf.get(rel), cf.get(rel)
                must = row["category"] in ("weights", "config")
                if a is None or b is None:
                    row["verdict"] = "differs" if must else "info"
                    row["detail"] = f"only in {cname if a is None else bname}"
                    failed |= must
                    continue
                row["sha256"] = {bname: a["sha256"], cname: b["sha256"]}
                if a["sha256"] == b["sha256"]:
                    row["verdict"] = "identical"
                    continue
                if row["category"] == "weights":
                    row["verdict"] = "differs"
                    row["detail"] = weights_detail(a, b, pathlib.Path(base.get("folder", "")) / "exports" / kind / fmt / rel,
                                                   pathlib.Path(cur.get("folder", "")) / "exports" / kind / fmt / rel)
                    failed = True
                elif row["category"] == "config":
                    ja, jb = a.get("json"), b.get("json")
                    if ja is None or jb is None:
                        row["verdict"], row["detail"] = "differs", "not valid JSON on one side"
                        failed = True
                        continue
                    row["diff"] = list(difflib.unified_diff(json_lines(ja), json_lines(jb), f"{bname}/{kind}/{fmt}/{rel}",
                                                            f"{cname}/{kind}/{fmt}/{rel}", lineterm="", n=2))
                    top = sorted(k for k in set(ja) | set(jb) if ja.get(k, ...) != jb.get(k, ...)) if isinstance(ja, dict) and isinstance(jb, dict) else ["<root>"]
                    row["keys"] = key_changes(ja, jb) if isinstance(ja, dict) and isinstance(jb, dict) else {}
                    if ja == jb:
                        row["verdict"], row["detail"] = "formatting", "same JSON, different bytes (key order or layout)"
                        failed |= fmt != "native"
                    elif fmt == "native" and set(top) <= schema_keys:
                        row["verdict"] = "schema"
                        row["detail"] = f"differs only under {', '.join(top)}"
                    else:
                        row["verdict"] = "differs"
                        row["detail"] = f"top-level keys that differ: {', '.join(top)}"
                        failed = True
                else:
                    row["verdict"] = "info"
                    row["detail"] = "differs (not checked)"
                    row["diff"] = list(difflib.unified_diff(
                        (pathlib.Path(base.get("folder", "")) / "exports" / kind / fmt / rel).read_text(errors="replace").splitlines()
                        if (pathlib.Path(base.get("folder", "")) / "exports" / kind / fmt / rel).is_file() else [],
                        (pathlib.Path(cur.get("folder", "")) / "exports" / kind / fmt / rel).read_text(errors="replace").splitlines()
                        if (pathlib.Path(cur.get("folder", "")) / "exports" / kind / fmt / rel).is_file() else [],
                        f"{bname}/{kind}/{fmt}/{rel}", f"{cname}/{kind}/{fmt}/{rel}", lineterm="", n=1))[:40]
    return {"baseline": bname, "current": cname, "failed": failed, "files": rows}


def weights_detail(a: dict, b: dict, a_path: pathlib.Path, b_path: pathlib.Path) -> str:
    sa, sb = a.get("safetensors"), b.get("safetensors")
    if not sa or not sb:
        return f"{a['bytes']} vs {b['bytes']} bytes"
    parts = []
    ta, tb = sa["tensors"], sb["tensors"]
    if set(ta) != set(tb):
        only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
        parts.append(f"tensor names differ (only baseline: {only_a[:6]}, only current: {only_b[:6]})")
    changed = [n for n in sorted(set(ta) & set(tb)) if ta[n] != tb[n]]
    both_present = a_path.is_file() and b_path.is_file()
    for n in changed[:12]:
        if ta[n]["dtype"] != tb[n]["dtype"] or ta[n]["shape"] != tb[n]["shape"]:
            parts.append(f"{n}: {ta[n]['dtype']}{ta[n]['shape']} vs {tb[n]['dtype']}{tb[n]['shape']}")
        else:
            extra = tensor_difference(a_path, b_path, n) if both_present else ""
            parts.append(f"{n}: values differ" + (f" ({extra})" if extra else ""))
    if len(changed) > 12:
        parts.append(f"... {len(changed) - 12} more tensors differ")
    if sa["metadata"] != sb["metadata"]:
        parts.append(f"metadata {sa['metadata']} vs {sb['metadata']}")
    if not parts:
        parts.append("same tensors, different byte layout (order or header)")
    return "; ".join(parts)


def print_comparison(result: dict) -> None:
    log(f"\n=== comparison: {result['baseline']} (baseline) vs {result['current']}")
    width = max((len(f"{r['kind']}/{r['format']}/{r['file']}") for r in result["files"]), default=10)
    for r in result["files"]:
        name = f"{r['kind']}/{r['format']}/{r['file']}"
        line = f"  {r['verdict']:<16} {name:<{width}}"
        if r.get("detail"):
            line += f"  {r['detail']}"
        log(line)
    for r in result["files"]:
        if r.get("diff"):
            label = {"schema": "not a failure: the native record's run_config/decode schema may change",
                     "info": "not checked"}.get(r["verdict"], "MUST BE IDENTICAL")
            log(f"\n--- {r['kind']}/{r['format']}/{r['file']}: {r['verdict']} ({label})")
            keys = r.get("keys") or {}
            for what in ("removed", "added", "changed"):
                if keys.get(what):
                    log(f"  keys {what}: {', '.join(keys[what])}")
            for line in r["diff"]:
                log(line)
    counts: dict[str, int] = {}
    for r in result["files"]:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    log("\nsummary: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    log("RESULT: " + ("FAIL: a weights file, a config.json that must match or a format's availability differs, "
                      "or a side could not train or export (see above)"
                      if result["failed"] else "OK: every weights file and engine-layout config.json is identical"))


# ----------------------------------------------------------------------------------------------
# Bench: the same fixed drafter folders decoded by both sides' code

# Decoding is deterministic (greedy, float32, one thread): these fields of a results.json row must be
# identical between the two sides. Timing fields (seconds, tokens_per_second, speedup,
# drafting_time_share) are not: the speedup is shown side by side with a noise band.
BENCH_MUST_MATCH = ("prompts", "new_tokens", "acceptance_length", "engine_acceptance_length", "target_forwards",
                    "exact", "mismatches", "acceptance_histogram", "per_depth_acceptance", "draft_nodes_per_step")
BENCH_FIXED_METHODS = ["none", "prompt-lookup"]
# Runs ``python -m selfdraft.cli ARGS`` (runpy, as -m does) after saying which files it imports.
BENCH_LAUNCHER = (
    "import importlib.util, runpy, sys, selfdraft; "
    "print('BENCH-IMPORTS ' + selfdraft.__file__ + ' ' + importlib.util.find_spec('selfdraft.cli').origin, "
    "file=sys.stderr, flush=True); "
    "runpy.run_module('selfdraft.cli', run_name='__main__', alter_sys=True)"
)


def bench_folders(exports: pathlib.Path, kinds: list[str]) -> dict[str, str]:
    """kind -> the native drafter folder under ``exports`` (the baseline side's), for the kinds that have one."""
    folders = {}
    for kind in kinds:
        folder = exports / kind / "native"
        if (folder / "config.json").is_file():
            folders[kind] = str(folder)
    return folders


def bench_target(folders: dict[str, str]) -> str:
    """The target the runs trained against (the native record's run_config.target.spec, else target.name):
    one for every folder."""
    targets = {}
    for kind, folder in folders.items():
        record = json.loads((pathlib.Path(folder) / "config.json").read_text(encoding="utf-8"))
        spec = ((record.get("run_config") or {}).get("target") or {}).get("spec") or (record.get("target") or {}).get("name")
        if not spec:
            raise RecipeError(f"{folder}/config.json names no target (run_config.target.spec, target.name); give --bench-target")
        targets[kind] = spec
    if len(set(targets.values())) != 1:
        raise RecipeError(f"the drafters were trained against different targets {targets}; give --bench-target")
    return next(iter(targets.values()))


def bench_side(side: Side, folders: dict[str, str], target: str, opts: argparse.Namespace) -> dict:
    """Run ``selfdraft bench`` with ``side``'s code on the given drafter folders; return results.json,
    the token ids of every generation (from the journal) and which selfdraft files the process imported."""
    out = side.root / "bench" / side.label
    shutil.rmtree(out, ignore_errors=True)
    methods = [*BENCH_FIXED_METHODS, *folders.values()]
    cli = ["bench", "--target", target, "--methods", ",".join(methods), "--tasks", opts.bench_tasks,
           "--limit", str(opts.bench_limit), "--max-new-tokens", str(opts.bench_max_new_tokens), "--dtype", "float32",
           "--threads", str(side.threads), "--no-plots", "--out", str(out), "--fresh"]
    log(f"\n=== bench [{side.label}]: {side.description}")
    log(f"[{side.label}] python -m selfdraft.cli {shlex.join(cli)}")
    rc, _, stderr, seconds = side.run(["-c", BENCH_LAUNCHER, *cli], "bench")
    marker = next((line.split()[1:] for line in stderr.splitlines() if line.startswith("BENCH-IMPORTS ")), None)
    if marker:
        log(f"[{side.label}] the bench process imported selfdraft.__file__ = {marker[0]} (selfdraft.cli: {marker[1]})")
        imported = pathlib.Path(marker[0]).resolve()
        if side.pythonpath and not imported.is_relative_to(pathlib.Path(side.pythonpath).resolve()):
            raise RecipeError(f"[{side.label}] the bench imported {imported}, not the copy in {side.pythonpath}")
        if not side.pythonpath and not imported.is_relative_to(REPO):
            log(f"WARNING: [{side.label}] the bench imported {imported}, which is not under {REPO}")
    if rc != 0 or not (out / "results.json").is_file():
        raise RecipeError(f"[{side.label}] bench failed (rc {rc}, {seconds:.0f} s; log in {side.logs}):\n{tail(stderr)}")
    log(f"[{side.label}] bench done in {seconds:.0f} s; results in {out}")
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    tokens: dict[str, list] = {}  # "task|temperature|method|prompt" -> token ids
    journal = out / "progress.jsonl"
    if journal.is_file():
        for line in journal.read_text(encoding="utf-8").splitlines()[1:]:
            if not line.strip():
                continue
            record = json.loads(line)
            for label, run in record["runs"].items():
                tokens[f"{record['task']}|{float(record['temperature']):g}|{label}|{record['prompt_id']}"] = run.get("token_ids")
    return {"label": side.label, "description": side.description, "imports": marker, "commit": side.commit,
            "command": ["python", "-m", "selfdraft.cli", *cli], "seconds": round(seconds, 1), "out": str(out),
            "results": results, "tokens": tokens}


def _bench_key(row: dict) -> tuple:
    return (row["task"], row.get("category"), float(row["temperature"]), row["method"])


def compare_bench(old: dict, new: dict, folders: dict[str, str], noise: float) -> dict:
    """Per (task, method): must-match fields identical? speedup ratio new/old within the noise band?"""
    names = {folder: kind for kind, folder in folders.items()}
    ro, rn = old["results"], new["results"]
    failed, problems = False, []
    if ro.get("prompts") != rn.get("prompts"):
        problems.append(f"the sides decoded different prompts: {ro.get('prompts')} vs {rn.get('prompts')}")
        failed = True
    if ro.get("skipped") != rn.get("skipped"):
        problems.append(f"skipped methods differ: {ro.get('skipped')} vs {rn.get('skipped')}")
        failed = True
    rows = []
    for section in ("rows", "category_rows"):
        a = {_bench_key(r): r for r in ro.get(section, [])}
        b = {_bench_key(r): r for r in rn.get(section, [])}
        for key in list(dict.fromkeys([*a, *b])):
            task, cat, t, method = key
            row = {"section": section, "task": task if cat is None else f"{task}:{cat}", "temperature": t,
                   "method": method, "name": names.get(method, method)}
            rows.append(row)
            x, y = a.get(key), b.get(key)
            if x is None or y is None:
                row["differs"] = [f"row only in {old['label'] if y is None else new['label']}"]
                failed = True
                continue
            row["differs"] = [f for f in BENCH_MUST_MATCH if x.get(f) != y.get(f)]
            for f in ("acceptance_length", "new_tokens", "exact", "speedup", "tokens_per_second", "baseline"):
                row[f] = [x.get(f), y.get(f)]
            if section == "rows":  # the token ids of every prompt, from each side's journal
                bad = []
                prefix = f"{task}|{t:g}|{method}|"
                for pk in sorted(k for k in set(old["tokens"]) | set(new["tokens"]) if k.startswith(prefix)):
                    ta, tb = old["tokens"].get(pk), new["tokens"].get(pk)
                    if ta != tb:
                        at = next((i for i, (p, q) in enumerate(zip(ta or [], tb or [])) if p != q),
                                  min(len(ta or []), len(tb or [])))
                        bad.append(f"{pk[len(prefix):]} (first difference at token {at})")
                if bad:
                    row["differs"].append("token_ids: " + ", ".join(bad))
            if row["differs"]:
                failed = True
            so, sn = x.get("speedup"), y.get("speedup")
            if x.get("baseline") or y.get("baseline"):
                row["speed"] = "baseline"
            elif so and sn:
                row["ratio"] = sn / so
                row["speed"] = "within noise" if abs(row["ratio"] - 1) <= noise else "OUTSIDE NOISE"
    return {"old": old["label"], "new": new["label"], "noise": noise, "failed": failed, "problems": problems, "rows": rows}


def print_bench(result: dict, old: dict, new: dict) -> None:
    o, n = result["old"], result["new"]
    log(f"\n=== bench comparison: {o} (old) vs {n} (new); same drafter folders, same prompts, float32, greedy")
    for side in (old, new):
        imports = side.get("imports") or ["?", "?"]
        log(f"  {side['label']}: selfdraft.__file__ = {imports[0]}; results in {side['out']}")

    def fmt(value, pattern: str) -> str:
        return "-" if value is None else format(value, pattern)

    main = [r for r in result["rows"] if r["section"] == "rows"]
    w_task = max([len("task"), *(len(r["task"]) for r in main)])
    w_m = max([len("method"), *(len(r["name"]) for r in main)])
    log(f"\n  {'task':<{w_task}}  {'method':<{w_m}}  {'tau old':>8} {'tau new':>8}  {'tokens o/n':>11}  {'exact o/n':>11}  "
        f"{'speedup old':>11} {'speedup new':>11} {'ratio':>7}  verdict")
    for r in main:
        if "acceptance_length" not in r:
            log(f"  {r['task']:<{w_task}}  {r['name']:<{w_m}}  DIFFERS: {'; '.join(r['differs'])}")
            continue
        tau, tok, ex, sp = r["acceptance_length"], r["new_tokens"], r["exact"], r["speedup"]
        verdict = "identical" if not r["differs"] else "DIFFERS: " + ", ".join(d.split(":")[0] for d in r["differs"])
        verdict += f"; speed {r.get('speed', '?')}" + (f" ({(r['ratio'] - 1) * 100:+.0f}%)" if "ratio" in r else "")
        log(f"  {r['task']:<{w_task}}  {r['name']:<{w_m}}  {fmt(tau[0], '.4f'):>8} {fmt(tau[1], '.4f'):>8}  "
            f"{f'{tok[0]}/{tok[1]}':>11}  {f'{ex[0]}/{ex[1]}':>11}  {fmt(sp[0], '.3f'):>11} {fmt(sp[1], '.3f'):>11} "
            f"{fmt(r.get('ratio'), '.3f'):>7}  {verdict}")
    log("  (methods: " + ", ".join(sorted({f"{r['name']} = {r['method']}" for r in main if r['name'] != r['method']})) + ")")
    base = [r for r in main if r.get("baseline") and r["baseline"][0]]
    if base:
        log("  tokens/s of none (machine load): " + ", ".join(
            f"{r['task']} {fmt(r['tokens_per_second'][0], '.1f')} -> {fmt(r['tokens_per_second'][1], '.1f')}" for r in base))
    for p in result["problems"]:
        log(f"  DIFFERS: {p}")
    for r in result["rows"]:
        if r["differs"]:
            log(f"  DIFFERS {r['task']} T={r['temperature']:g} {r['name']}: {'; '.join(r['differs'])}")
    exact_false = [r for r in main if "exact" in r and False in r["exact"]]
    for r in exact_false:
        log(f"  NOTE: {r['task']} {r['name']} is not token-identical to none (exact {r['exact'][0]}/{r['exact'][1]}): "
            "in float32 that is a decoding bug on that side")
    outside = [r for r in main if r.get("speed") == "OUTSIDE NOISE"]
    if outside:
        log(f"\n  !!! SPEEDUP OUTSIDE THE +-{result['noise'] * 100:.0f}% NOISE BAND (not a failure: timing on a shared "
            "machine; rerun to tell noise from a slowdown):")
        for r in outside:
            log(f"  !!!   {r['task']} {r['name']}: {r['speedup'][0]:.3f}x -> {r['speedup'][1]:.3f}x (ratio {r['ratio']:.3f})")
    log("BENCH RESULT: " + ("FAIL: a deterministic bench figure (acceptance length, tokens, exactness ...) differs "
                            "between the two sides: a behaviour change" if result["failed"] else
                            "OK: acceptance lengths, tokens emitted (every token id) and exactness flags are identical; "
                            + ("every speedup within noise" if not outside else f"{len(outside)} speedup(s) outside the noise band")))


# ----------------------------------------------------------------------------------------------
# A REV as an importable copy


def resolve(rev: str) -> str:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise RecipeError(f"{rev} is not a commit of {REPO}: {commit.stderr.strip()}")
    return commit.stdout.strip()


def build_rev(rev: str, commit_id: str, python: str, root: pathlib.Path) -> tuple[str, pathlib.Path]:
    """(PYTHONPATH folder, worktree) for REV: a git worktree, a wheel of it, the wheel installed with
    --target into a private folder."""
    tree = root / f"src-{commit_id[:12]}"
    wheel_dir, site = root / f"wheel-{commit_id[:12]}", root / f"site-{commit_id[:12]}"
    remove_worktree(tree)
    shutil.rmtree(wheel_dir, ignore_errors=True)
    shutil.rmtree(site, ignore_errors=True)
    log(f"building {rev} ({commit_id[:12]}): git worktree in {tree}, wheel, install into {site}")
    steps = [
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit_id],
        [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheel_dir), str(tree)],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        if proc.returncode != 0:
            raise RecipeError(f"{shlex.join(cmd)} failed:\n{tail(proc.stdout + proc.stderr)}")
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RecipeError(f"expected one wheel in {wheel_dir}, found {[w.name for w in wheels]}")
    cmd = [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheels[0])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise RecipeError(f"{shlex.join(cmd)} failed:\n{tail(proc.stdout + proc.stderr)}")
    return str(site), tree


def remove_worktree(tree: pathlib.Path) -> None:
    if tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(tree, ignore_errors=True)


def worktree_state() -> str:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.splitlines()
    return f"working tree of {REPO} (HEAD {head}" + (f", {len(dirty)} modified tracked files)" if dirty else ", clean)")


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--compare", metavar="REV", help="also run REV's code (a git revision of this repository) and compare")
    p.add_argument("--against", metavar="JSON", help="compare with a fingerprint saved earlier (--json or --baseline-json) "
                   "instead of running a REV")
    p.add_argument("--repeat", action="store_true", help="run the working tree's code (or --code's) twice and compare "
                   "(a determinism check)")
    p.add_argument("--code", metavar="REV", help="run REV's code as the current side instead of the working tree's "
                   "(e.g. --compare HEAD~1 --code HEAD checks one commit)")
    p.add_argument("--json", metavar="OUT", help="write the fingerprint(s) and the comparison as JSON")
    p.add_argument("--baseline-json", metavar="OUT", help="with --compare: write REV's fingerprint alone (reusable with --against)")
    p.add_argument("--kinds", default=DEFAULT_KINDS, help=f"comma-separated, of {', '.join(KINDS)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per kind (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more run-config override for every kind")
    p.add_argument("--format-alias", action="append", default=None, metavar="OLD=NEW",
                   help=f"a renamed export format (repeatable; default: {' '.join(DEFAULT_ALIASES)}; 'none' for no alias)")
    p.add_argument("--formats", default=None, metavar="F1,F2,...",
                   help="export formats to write, by their new names (default: the choices `selfdraft export --help` "
                   f"lists, else {','.join(DEFAULT_FORMATS)}, renamed by the aliases)")
    p.add_argument("--schema-keys", default="run_config,decode",
                   help="top-level keys of the native config.json whose differences are schema differences (default: %(default)s)")
    p.add_argument("--work", default="/tmp/export-fingerprint", help="work folder (default: %(default)s)")
    p.add_argument("--python", default=None, help="interpreter with torch and the project's dependencies "
                   "(default: the repository's .venv/bin/python, else this one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    p.add_argument("--allow-gpu", action="store_true", help="do not hide GPUs (CUDA_VISIBLE_DEVICES='') from the runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one subprocess may take (default: %(default)s)")
    p.add_argument("--keep-rev", action="store_true", help="keep REV's worktree, wheel and install folder")
    b = p.add_argument_group("bench (--bench)")
    b.add_argument("--bench", action="store_true", help="after the exports, bench the baseline side's native drafter "
                   "folders with both sides' code and compare the results")
    b.add_argument("--bench-only", action="store_true", help="the bench without the exports: with --against JSON "
                   "(the folders and commit it records) or --compare REV (WORK/rev-<commit> left by an earlier run)")
    b.add_argument("--bench-tasks", default="mt_bench,humaneval", help="(default: %(default)s)")
    b.add_argument("--bench-limit", type=int, default=3, help="prompts per task (default: %(default)s)")
    b.add_argument("--bench-max-new-tokens", type=int, default=48, help="(default: %(default)s)")
    b.add_argument("--bench-target", default=None, help="the bench target (default: the one the runs trained against)")
    b.add_argument("--bench-noise", type=float, default=0.15, help="a speedup ratio new/old within 1 +- this is "
                   "'within noise' (default: %(default)s)")
    args = p.parse_args(argv)
    args.bench = args.bench or args.bench_only

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    if sum(bool(x) for x in (args.compare, args.against, args.repeat)) > 1:
        p.error("give at most one of --compare, --against, --repeat")
    if args.baseline_json and not args.compare:
        p.error("--baseline-json goes with --compare")
    if args.bench and not (args.compare or args.against or args.repeat):
        p.error("--bench needs two sides: --compare REV, --against JSON or --repeat")
    if args.bench_only and not (args.compare or args.against):
        p.error("--bench-only goes with --against JSON or --compare REV")
    if args.bench_only and args.baseline_json:
        p.error("--bench-only writes no fingerprint for --baseline-json")
    aliases: dict[str, str] = {}
    for item in (args.format_alias if args.format_alias is not None else DEFAULT_ALIASES):
        if item == "none":
            continue
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            p.error(f"--format-alias wants OLD=NEW, got {item!r}")
        aliases[old] = new
    formats = [f.strip() for f in args.formats.split(",") if f.strip()] if args.formats else None
    python = args.python or (str(REPO / ".venv/bin/python") if (REPO / ".venv/bin/python").exists() else sys.executable)
    root = pathlib.Path(args.work).resolve()
    root.mkdir(parents=True, exist_ok=True)

    lock = open(root / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another export_fingerprint run holds {root}/.lock; use another --work", file=sys.stderr)
        return 2

    started = time.monotonic()
    side = lambda label, pythonpath, description: Side(label, python, pythonpath, root, args.threads,  # noqa: E731
                                                      not args.allow_gpu, args.timeout, description)
    doc: dict = {"recipe": RECIPE, "kinds": kinds, "steps": args.steps, "extra_overrides": args.set, "aliases": aliases}
    built: dict[str, tuple[str, pathlib.Path]] = {}  # commit -> (site, worktree)

    def rev_side(rev: str, prefix: str) -> Side:
        commit = resolve(rev)
        if commit not in built:
            built[commit] = build_rev(rev, commit, python, root)
        site = built[commit][0]
        s = side(f"{prefix}-{commit[:12]}", site, f"{rev} = {commit} (installed in {site})")
        s.commit = commit
        return s

    def run_side(s: Side) -> dict:
        result = fingerprint(s, kinds, args.steps, aliases, args.set, formats)
        imported = pathlib.Path(result["code"]["files"]["selfdraft"]).resolve()
        if s.pythonpath:
            result["commit"] = s.commit
            if not imported.is_relative_to(pathlib.Path(s.pythonpath).resolve()):
                raise RecipeError(f"[{s.label}] imported {imported}, not the copy in {s.pythonpath}")
        elif not imported.is_relative_to(REPO):
            log(f"WARNING: [{s.label}] imported {imported}, which is not under {REPO}")
        return result

    def current_side() -> Side:
        if args.code:
            return rev_side(args.code, "code2" if args.repeat else "code")
        return side("worktree-2" if args.repeat else "worktree", None, worktree_state())

    def bench(base_side: Side, cur_side: Side, exports: pathlib.Path) -> int:
        """Bench the native folders under ``exports`` with both sides' code, one after the other; 0 or 1."""
        folders = bench_folders(exports, kinds)
        if not folders:
            raise RecipeError(f"no native drafter folder under {exports} to bench (kinds {', '.join(kinds)})")
        missing = [k for k in kinds if k not in folders]
        if missing:
            log(f"WARNING: no native folder of {', '.join(missing)} under {exports}: not benched")
        target = args.bench_target or bench_target(folders)
        log(f"\n=== bench: the native folders of {', '.join(folders)} under {exports} (written by {base_side.label}'s "
            f"run), target {target}, tasks {args.bench_tasks}, {args.bench_limit} prompts each, "
            f"{args.bench_max_new_tokens} new tokens, float32, {args.threads} thread(s); {base_side.label} first, then "
            f"{cur_side.label}")
        old = bench_side(base_side, folders, target, args)
        new = bench_side(cur_side, folders, target, args)
        result = compare_bench(old, new, folders, args.bench_noise)
        doc["bench"] = {"folders": folders, "target": target, "old": {k: v for k, v in old.items() if k != "tokens"},
                        "new": {k: v for k, v in new.items() if k != "tokens"}, "comparison": result}
        print_bench(result, old, new)
        return 1 if result["failed"] else 0

    def fingerprints_then_bench() -> int:
        status, baseline, base_side = 0, None, None
        if args.compare:
            base_side = rev_side(args.compare, "rev")
            baseline = run_side(base_side)
            if args.baseline_json:
                pathlib.Path(args.baseline_json).write_text(json.dumps(baseline, indent=1) + "\n")
                log(f"wrote the baseline's fingerprint to {args.baseline_json}")
        elif args.against:
            baseline = json.loads(pathlib.Path(args.against).read_text())
            if "kinds" not in baseline:  # a --json document: its baseline, else its only side
                baseline = baseline.get("baseline") or baseline["current"]
            log(f"baseline: {args.against} ({baseline['label']}: {baseline.get('description', '')})")
        elif args.repeat:
            base_side = side("worktree-1", None, worktree_state()) if not args.code else rev_side(args.code, "code1")
            baseline = run_side(base_side)
        cur_side = current_side()
        current = run_side(cur_side)
        doc["current"] = current
        if baseline is not None:
            doc["baseline"] = baseline
            result = compare(baseline, current, {k.strip() for k in args.schema_keys.split(",") if k.strip()})
            doc["comparison"] = result
            print_comparison(result)
            status = 1 if result["failed"] else 0
        errors = [f"{r['label']}: {e}" for r in (baseline, current) if r for e in r.get("errors", [])]
        if args.bench:
            if base_side is None:  # --against: the saved side's code, rebuilt from the commit it records
                if not baseline.get("commit"):
                    raise RecipeError(f"{args.against} records no commit to bench its side's code with")
                base_side = rev_side(baseline["commit"], "rev")
            exports = pathlib.Path(baseline.get("folder") or root / base_side.label) / "exports"
            status = max(status, bench(base_side, cur_side, exports))
        if errors:
            log("\nthe recipe did not run through:\n  " + "\n  ".join(errors))
            status = 2
        return status

    status = 0
    try:
        if args.bench_only:
            if args.against:
                saved = json.loads(pathlib.Path(args.against).read_text())
                if "kinds" not in saved:
                    saved = saved.get("baseline") or saved["current"]
                if not saved.get("commit") or not saved.get("folder"):
                    raise RecipeError(f"{args.against} records no commit and folder of its side; bench with --compare REV")
                log(f"baseline: {args.against} ({saved['label']}: {saved.get('description', '')}); benching its folders")
                base_side, exports = rev_side(saved["commit"], "rev"), pathlib.Path(saved["folder"]) / "exports"
            else:
                base_side = rev_side(args.compare, "rev")
                exports = root / base_side.label / "exports"
            cur_side = current_side()
            for s in (base_side, cur_side):
                log(f"\n=== {s.label}: {s.description}")
                info = s.probe()
                log(f"[{s.label}] selfdraft.__file__ = {info['files']['selfdraft']} (selfdraft.cli: {info['files']['selfdraft.cli']})")
            status = bench(base_side, cur_side, exports)
        else:
            status = fingerprints_then_bench()
    except RecipeError as err:
        print(f"export_fingerprint: {err}", file=sys.stderr)
        doc["error"] = str(err)
        status = 2
    finally:
        if not args.keep_rev:
            for commit, (site, tree) in built.items():
                remove_worktree(tree)
                shutil.rmtree(root / f"wheel-{commit[:12]}", ignore_errors=True)
                shutil.rmtree(site, ignore_errors=True)
        doc["seconds"] = round(time.monotonic() - started, 1)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
            log(f"wrote {args.json}")
    log(f"total {doc['seconds']:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
