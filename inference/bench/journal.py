"""The journal: an interrupted bench resumes. ``OUT/progress.jsonl`` holds every finished prompt."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from typing import Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.inference.bench.common import _write_atomic
from selfdraft.inference.bench.methods import MethodChoice
from selfdraft.inference.bench.runners import Generation

logger = logging.getLogger(__name__)

JOURNAL = "progress.jsonl"


def _folder_digest(path: str) -> str:
    """sha256 over the names and bytes of the json and safetensors files directly in ``path``."""
    digest = hashlib.sha256()
    for f in sorted(pathlib.Path(path).iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            digest.update(f.name.encode("utf-8") + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def _settings(target, choices: Sequence[MethodChoice], max_new_tokens: int, seed: int) -> dict:
    """What must not change between the sessions of one bench: a finished prompt is reused only under
    the same settings (tasks, temperatures and --limit may change: prompts are journaled one by one)."""
    methods = {}
    for c in choices:
        folder = c.argument if c.argument and os.path.isdir(c.argument) else None
        methods[c.label] = {"method": c.method.name, "argument": c.argument, "options": c.options,
                            "files_sha256": _folder_digest(folder) if folder else None}
    return {"target": target.identity.to_dict(), "dtype": str(target.dtype).replace("torch.", ""),
            "device": str(target.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "max_new_tokens": max_new_tokens, "seed": seed, "methods": methods}


def _ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode("ascii")).hexdigest()[:16]


class Journal:
    """``OUT/progress.jsonl``: the settings on the first line, then one line per finished prompt (task,
    temperature, prompt) with every method's generation and seconds. All methods of a prompt are timed
    back to back in one session, so a prompt taken from the journal is as fair as one decoded now; a
    rerun with the same settings decodes only the prompts the journal lacks. Each line is flushed and
    fsynced; a torn last line (a kill mid-write) is dropped on load."""

    def __init__(self, out: pathlib.Path, settings: dict, fresh: bool = False):
        self.path = out / JOURNAL
        self.settings = json.loads(json.dumps(settings))  # the form it takes in the file
        self.groups: dict[tuple[str, float, str], dict] = {}
        if fresh and self.path.exists():
            self.path.unlink()
        if not self.path.exists():
            _write_atomic(self.path, (json.dumps({"settings": self.settings}) + "\n").encode("utf-8"))
            return
        lines = self.path.read_text(encoding="utf-8").split("\n")
        try:
            head = json.loads(lines[0])["settings"]
        except (ValueError, KeyError, TypeError):
            raise SelfdraftError(f"{self.path} is not a selfdraft bench journal; use another --out or pass --fresh") from None
        if head != self.settings:
            diff = sorted(k for k in set(head) | set(self.settings) if head.get(k) != self.settings.get(k))
            if "methods" in diff:
                old, new = head.get("methods", {}), self.settings["methods"]
                changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                diff[diff.index("methods")] = f"methods ({', '.join(changed)})"
            raise SelfdraftError(
                f"{self.path} holds a bench with other settings ({'; '.join(diff)} differ); a resumed bench must "
                "keep the target, dtype, threads, methods (and their files), max_new_tokens and seed: use another "
                "--out, or pass --fresh to start this one over")
        good = lines[:1]
        for line in filter(str.strip, lines[1:]):
            try:
                record = json.loads(line)
                key = (record["task"], float(record["temperature"]), record["prompt_id"])
            except (ValueError, KeyError, TypeError):
                logger.warning("%s: dropping a torn or unreadable line (an interrupted write); that prompt is decoded again",
                               self.path)
                _write_atomic(self.path, ("\n".join(good) + "\n").encode("utf-8"))
                break
            self.groups[key] = record
            good.append(line)

    def get(self, task: str, temperature: float, prompt_id: str, ids_digest: str, labels: Sequence[str]) -> dict | None:
        """The journaled generations of one prompt, or None if it must be decoded (absent, another
        prompt text under that id, or another set of methods at that temperature)."""
        record = self.groups.get((task, temperature, prompt_id))
        if record is None or record["ids_sha256"] != ids_digest or sorted(record["runs"]) != sorted(labels):
            return None
        return {label: (_generation_from_json(run), run["seconds"]) for label, run in record["runs"].items()}

    def add(self, task: str, temperature: float, prompt_id: str, ids_digest: str,
            runs: dict[str, tuple[Generation, float]]) -> None:
        record = {"task": task, "temperature": temperature, "prompt_id": prompt_id, "ids_sha256": ids_digest,
                  "runs": {label: {**_generation_to_json(g), "seconds": s} for label, (g, s) in runs.items()}}
        self.groups[(task, temperature, prompt_id)] = record
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _generation_to_json(g: Generation) -> dict:
    out = dataclasses.asdict(g)
    for key in ("accept_histogram", "depth_drafted", "depth_accepted"):
        if out[key] is not None:
            out[key] = {str(k): v for k, v in out[key].items()}
    return out


def _generation_from_json(data: dict) -> Generation:
    fields = {f.name: data.get(f.name) for f in dataclasses.fields(Generation)}  # later fields: None in older journals
    for key in ("accept_histogram", "depth_drafted", "depth_accepted"):
        if fields[key] is not None:
            fields[key] = {int(k): v for k, v in fields[key].items()}
    if fields["engine_steps"] is not None:
        fields["engine_steps"] = tuple(fields["engine_steps"])
    return Generation(**fields)
