"""``selfdraft bench``: decoding methods side by side on one target, in one process, timed fairly.

    selfdraft bench --target smollm2-135m --methods hf-greedy,prompt-lookup,runs/e3/drafter@depth=5,top_k=4 \
        --tasks mt_bench,humaneval --temperatures 0,1 --limit 10 --out bench/

Fairness: the target is loaded once; each method first decodes one warm-up prompt; then, prompt by
prompt, every method decodes the same prompt (the method order rotates from prompt to prompt), with
the same dtype, threads, and at temperature > 0 the same seed. The baseline is our loop without a
drafter (``none``): it always runs, and speedup = tokens/s of a method / tokens/s of ``none`` on the
same task and temperature. At temperature 0 every method's tokens are compared with ``none``'s; a
difference is printed as a WARNING and set in bold in the report.

Methods live in a registry (:data:`METHODS`, extend it with :func:`register`); any drafter folder that
:func:`~selfdraft.inference.drafters.make_drafter` reads (native Medusa / EAGLE-1 / EAGLE-3, a vLLM or
SGLang EAGLE layout) is a method too. ``METHOD@key=value,key=value`` sets a method's options.
:func:`run_bench` writes ``results.json``, ``report.md`` and PNG plots, each atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import platform
import re
import shlex
import sys
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import torch

from selfdraft.configs.decode import DecodeConfig, DraftModelConfig, DynamicTreeConfig, PromptLookupConfig
from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created
from selfdraft.inference.prompts import (
    MT_BENCH_CATEGORIES, Prompt, humaneval_prompts, jsonl_prompts, mt_bench_prompts, round_robin,
)

BASELINE = "none"
TASKS = ("mt_bench", *(f"mt_bench:{c}" for c in MT_BENCH_CATEGORIES), "humaneval")


# --- what a method produces -------------------------------------------------------------------------

@dataclass
class Generation:
    """One method's output for one prompt, with what the method can tell honestly about it.

    A field is None when the method cannot measure it (transformers' generate() reports no accept
    histogram, per-depth acceptance or drafting time).
    """

    token_ids: list[int]
    """The new tokens (an EOS token that stopped generation included)."""
    target_forwards: int | None = None
    """Target forward passes, the prefill included."""
    accept_histogram: dict[int, int] | None = None
    """Tokens emitted per target forward -> number of forwards."""
    depth_drafted: dict[int, int] | None = None
    """Depth d -> verification steps whose draft reached depth d."""
    depth_accepted: dict[int, int] | None = None
    """Depth d -> verification steps that accepted a draft token at depth d."""
    draft_seconds: float | None = None
    """Seconds spent drafting."""


Runner = Callable[[list[int], float, "int | None", int], Generation]
"""(prompt ids, temperature, seed, max_new_tokens) -> Generation; the benchmark times the call."""


class LoopRunner:
    """Our decoding loop (the one behind :func:`selfdraft.generate`) with one drafter."""

    def __init__(self, target, drafter):
        self.target, self.drafter = target, drafter

    def __call__(self, ids: list[int], temperature: float, seed: int | None, max_new_tokens: int) -> Generation:
        from selfdraft.inference.decode import speculative_decode
        from selfdraft.inference.session import CausalLMSession

        config = DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        session = CausalLMSession(self.target.model, hidden_layers=self.drafter.hidden_layers)
        out = speculative_decode(session, ids, self.drafter, config, eos_token_ids=self.target.eos_token_ids,
                                 max_context=self.target.max_context)
        s = out.stats
        return Generation(out.token_ids, s.target_forwards, dict(s.accept_histogram), dict(s.depth_drafted),
                          dict(s.depth_accepted), s.draft_seconds)


# generate() settings that change the output distribution and that only None switches off: our loop
# implements none of them, so an hf-* method next to a target whose generation_config sets one would
# not decode the same distribution.
_UNMATCHED_GENERATION_FIELDS = ("min_p", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                                "sequence_bias", "forced_bos_token_id", "forced_eos_token_id")


class HFRunner:
    """transformers' own ``generate()``: greedy, sampling, prompt lookup or assisted generation.

    Sampling uses temperature only (top-k 0, top-p 1), like our loop; every other logits processor
    is switched off explicitly, so that the target's generation_config cannot change the law (a
    repetition penalty, say). Target forwards are counted with a forward pre-hook (public torch API),
    so the acceptance length is measured; the accept histogram is known only when every forward
    emitted one token.
    """

    def __init__(self, target, extra: dict[str, Any] | None = None, assistant=None):
        gen = target.model.generation_config
        unmatched = [f"{k}={getattr(gen, k)!r}" for k in _UNMATCHED_GENERATION_FIELDS if getattr(gen, k, None) is not None]
        if unmatched:
            raise SelfdraftError(
                f"the target's generation_config sets {', '.join(unmatched)}: transformers' generate() applies it and "
                "our loop does not, so the hf-* methods would decode another distribution; drop those fields from "
                "generation_config.json or leave the hf-* methods out")
        self.target, self.extra, self.assistant = target, dict(extra or {}), assistant
        eos = list(target.eos_token_ids)
        tok = target.tokenizer
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (eos[0] if eos else 0)
        self.fixed = {"eos_token_id": eos or None, "pad_token_id": pad, "repetition_penalty": 1.0,
                      "no_repeat_ngram_size": 0, "min_new_tokens": 0}
        self.sampling = {"top_k": 0, "top_p": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}

    def __call__(self, ids: list[int], temperature: float, seed: int | None, max_new_tokens: int) -> Generation:
        model = self.target.model
        x = torch.tensor([ids], device=model.device)  # (1, T)
        kwargs = dict(self.fixed, max_new_tokens=max_new_tokens, do_sample=temperature > 0, **self.extra)
        if temperature > 0:
            kwargs.update(self.sampling, temperature=temperature)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        if temperature > 0 and seed is not None:
            torch.manual_seed(seed)  # generate() samples from torch's global generator
        forwards = 0

        def count(module, args):
            nonlocal forwards
            forwards += 1

        hook = model.register_forward_pre_hook(count)
        try:
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        finally:
            hook.remove()
        tokens = out[0, len(ids):].tolist()
        histogram = {1: forwards} if forwards == len(tokens) else None  # every forward emits >= 1 token
        drafts = self.assistant is not None or "prompt_lookup_num_tokens" in self.extra
        return Generation(tokens, forwards, histogram, draft_seconds=None if drafts else 0.0)


# --- the method registry ----------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be an integer >= 1")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be a number in [0, 1]")
    return value


def _schedule(text: str) -> str:
    if text not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError("must be constant, heuristic or heuristic_transient")
    return text


@dataclass(frozen=True)
class Method:
    """A decoding method the benchmark can run."""

    name: str
    """Registry key; with ``argument`` set the method is written ``name:ARGUMENT``."""
    build: Callable[[Any, "str | None", dict], Runner]
    """(loaded target, argument or None, parsed options) -> runner; loads whatever the method needs."""
    help: str
    options: dict[str, tuple[Callable[[str], Any], str]] = field(default_factory=dict)
    """Option key -> (parser of the value text, help)."""
    temperatures: str = "any"
    """``any``, ``greedy`` (temperature 0 only) or ``sample`` (temperature > 0 only)."""
    argument: str | None = None
    """Name of the argument after ``name:`` (e.g. ``SPEC``), or None."""

    def applies(self, temperature: float) -> bool:
        return {"any": True, "greedy": temperature == 0, "sample": temperature > 0}[self.temperatures]

    @property
    def usage(self) -> str:
        return f"{self.name}:{self.argument}" if self.argument else self.name


METHODS: dict[str, Method] = {}
"""The methods ``selfdraft bench`` knows by name (drafter folders are resolved separately)."""


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _prompt_lookup_config(options: dict) -> PromptLookupConfig:
    d = PromptLookupConfig
    tokens = options.get("tokens", d.num_tokens)
    return PromptLookupConfig(max_ngram=options.get("max_ngram", d.max_ngram), min_ngram=options.get("min_ngram", d.min_ngram),
                              num_tokens=tokens, max_branches=options.get("branches", d.max_branches),
                              max_nodes=options.get("nodes", max(d.max_nodes, tokens))).validate()


def _build_prompt_lookup(target, argument, options):
    from selfdraft.inference.drafters import PromptLookupDrafter

    return LoopRunner(target, PromptLookupDrafter(_prompt_lookup_config(options)))


def _build_draft_model(target, argument, options):
    from selfdraft.inference.drafters import make_drafter

    d = DraftModelConfig
    config = DraftModelConfig(depth=options.get("depth", d.depth), top_k=options.get("top_k", d.top_k),
                              max_nodes=options.get("nodes", d.max_nodes)).validate()
    return LoopRunner(target, make_drafter(f"draft-model:{argument}", target, draft_model=config))


def _build_hf_prompt_lookup(target, argument, options):
    extra = {"prompt_lookup_num_tokens": options.get("tokens", 10)}
    if "max_ngram" in options:
        extra["max_matching_ngram_size"] = options["max_ngram"]
    return HFRunner(target, extra)


def _build_hf_assisted(target, argument, options):
    from selfdraft.heads.target import load_target

    assistant = load_target(argument, dtype=target.dtype, device=str(target.device))
    mine, theirs = assistant.identity, target.identity
    if not mine.tokenizer_hash or mine.tokenizer_hash != theirs.tokenizer_hash:
        raise SelfdraftError(f"assistant model {argument!r} does not use the tokenizer of target {theirs.name!r}; "
                             "hf-assisted needs an assistant with the target's tokenizer")
    # The assistant is our own freshly loaded copy: transformers reads its drafting settings here.
    gen = assistant.model.generation_config
    if "tokens" in options:
        gen.num_assistant_tokens = options["tokens"]
    if "schedule" in options:
        gen.num_assistant_tokens_schedule = options["schedule"]
    if "confidence" in options:
        gen.assistant_confidence_threshold = options["confidence"]
    return HFRunner(target, assistant=assistant.model)


_TREE_OPTIONS = {"depth": (_positive_int, "draft depth"), "top_k": (_positive_int, "children per expanded node"),
                 "nodes": (_positive_int, "draft tokens kept per tree")}

register(Method("none", lambda t, a, o: LoopRunner(t, _no_drafter()), "our loop without a drafter: the baseline"))
register(Method("prompt-lookup", _build_prompt_lookup, "our loop, copying continuations of earlier n-grams", {
    "tokens": (_positive_int, "draft tokens per match"), "max_ngram": (_positive_int, "longest n-gram looked up"),
    "min_ngram": (_positive_int, "shortest n-gram looked up"), "branches": (_positive_int, "continuations merged into a tree"),
    "nodes": (_positive_int, "draft tokens per tree")}))
register(Method("draft-model", _build_draft_model, "our loop with a separate small model of the same tokenizer",
                _TREE_OPTIONS, argument="SPEC"))
register(Method("hf-greedy", lambda t, a, o: HFRunner(t), "transformers generate(), greedy", temperatures="greedy"))
register(Method("hf-sample", lambda t, a, o: HFRunner(t), "transformers generate(do_sample=True), top_k 0, top_p 1",
                temperatures="sample"))
register(Method("hf-prompt-lookup", _build_hf_prompt_lookup, "transformers generate(prompt_lookup_num_tokens=...)", {
    "tokens": (_positive_int, "prompt_lookup_num_tokens (default 10)"),
    "max_ngram": (_positive_int, "max_matching_ngram_size")}, temperatures="greedy"))
register(Method("hf-assisted", _build_hf_assisted, "transformers assisted generation with assistant_model=SPEC", {
    "tokens": (_positive_int, "num_assistant_tokens"), "schedule": (_schedule, "num_assistant_tokens_schedule"),
    "confidence": (_share, "assistant_confidence_threshold")}, argument="SPEC"))


def _no_drafter():
    from selfdraft.inference.drafters import NoDrafter

    return NoDrafter()


def _folder_method(path: str) -> Method | None:
    """A method for a drafter folder that make_drafter reads, or None when ``path`` is not one."""
    from selfdraft.heads.eagle_formats import is_engine_eagle_folder
    from selfdraft.heads.io import is_drafter_folder, read_record

    if is_drafter_folder(path):
        record = read_record(path)
        kind, stored = record.kind, record.decode.get("tree")
    elif is_engine_eagle_folder(path):
        kind, stored = "eagle (vLLM/SGLang layout)", None
    else:
        return None

    def build(target, argument, options):
        from selfdraft.inference.drafters import make_drafter

        if kind == "medusa":
            return LoopRunner(target, make_drafter(path, target, medusa_nodes=options.get("medusa_nodes")))
        tree = None
        if options:
            base = DynamicTreeConfig(**stored) if stored else DynamicTreeConfig()
            tree = dataclasses.replace(base, depth=options.get("depth", base.depth), top_k=options.get("top_k", base.top_k),
                                       max_nodes=options.get("nodes", base.max_nodes)).validate()
        return LoopRunner(target, make_drafter(path, target, dynamic_tree=tree))

    if kind == "medusa":
        options = {"medusa_nodes": (_positive_int, "rebuild the sparse tree for this node budget from the stored accuracies")}
    else:
        options = _TREE_OPTIONS
    return Method(f"{kind} drafter folder", build, f"our loop with the {kind} drafter in {path}", options)


@dataclass(frozen=True)
class MethodChoice:
    """A method as the user wrote it: its label (the text given), the method, its argument and options."""

    label: str
    method: Method
    argument: str | None
    options: dict[str, Any]


def method_names() -> str:
    return ", ".join(m.usage for m in METHODS.values()) + \
        ", or a drafter folder (native Medusa / EAGLE-1 / EAGLE-3, or a vLLM/SGLang EAGLE layout)"


def _lookup(spec: str) -> tuple[Method, str | None]:
    if spec in METHODS and METHODS[spec].argument is None:
        return METHODS[spec], None
    for name, method in METHODS.items():
        if method.argument and (spec == name or spec.startswith(name + ":")):
            argument = spec[len(name) + 1:]
            if not argument:
                raise SelfdraftError(f"method {name} needs an argument: {method.usage}")
            return method, argument
    folder = _folder_method(spec)
    if folder is not None:
        return folder, spec
    if os.path.exists(spec):
        raise SelfdraftError(f"{spec} is not a drafter folder (no selfdraft config.json, no EAGLE engine layout); "
                             f"for a separate draft model write draft-model:{spec}")
    raise SelfdraftError(f"unknown method {spec!r}; valid methods: {method_names()}")


def parse_method(text: str) -> MethodChoice:
    """``METHOD`` or ``METHOD@key=value,key=value`` -> MethodChoice (options parsed and checked)."""
    label = text.strip()
    spec, option_text = label, None
    if "@" in label and not os.path.exists(label):
        spec, option_text = label.rsplit("@", 1)
    if spec.endswith("/") and len(spec) > 1:
        spec = spec.rstrip("/")
    if not spec:
        raise SelfdraftError(f"empty method name in {text!r}; valid methods: {method_names()}")
    method, argument = _lookup(spec)
    options: dict[str, Any] = {}
    if option_text is not None:
        valid = ", ".join(method.options) or "none (it takes no options)"
        if not option_text:
            raise SelfdraftError(f"{label}: no options after '@'; valid options of {method.name}: {valid}")
        for item in option_text.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise SelfdraftError(f"{label}: option {item!r} is not key=value; valid options of {method.name}: {valid}")
            if key not in method.options:
                raise SelfdraftError(f"{label}: unknown option {key!r}; valid options of {method.name}: {valid}")
            if key in options:
                raise SelfdraftError(f"{label}: option {key!r} is given twice")
            parse, _ = method.options[key]
            try:
                options[key] = parse(value.strip())
            except ValueError as err:
                raise SelfdraftError(f"{label}: option {key}={value!r}: {err}") from None
    return MethodChoice(label.rstrip("/") if option_text is None else label, method, argument, options)


def split_methods(text: str) -> list[str]:
    """Split a comma-separated method list; the ``key=value`` items after ``METHOD@`` stay with it:
    ``none,runs/x/drafter@depth=5,top_k=4`` -> ``["none", "runs/x/drafter@depth=5,top_k=4"]``."""
    items: list[str] = []
    for part in text.split(","):
        if items and "@" in items[-1] and re.fullmatch(r"\s*[A-Za-z_]\w*\s*=.*", part):
            items[-1] += "," + part
        elif part.strip():
            items.append(part.strip())
    return items


# --- tasks ------------------------------------------------------------------------------------------

def task_prompts(task: str, limit: int | None) -> list[Prompt]:
    """The prompts of a task: ``mt_bench`` (round robin over the 8 categories), ``mt_bench:<category>``,
    ``humaneval``, or a JSONL file path (see :func:`~selfdraft.inference.prompts.jsonl_prompts`)."""
    if task == "mt_bench":
        return round_robin(mt_bench_prompts(), limit)
    if task.startswith("mt_bench:") and task[len("mt_bench:"):] in MT_BENCH_CATEGORIES:
        category = task[len("mt_bench:"):]
        return [p for p in mt_bench_prompts() if p.category == category][:limit]
    if task == "humaneval":
        return humaneval_prompts(limit)
    if os.path.isfile(task):
        return jsonl_prompts(task, limit)
    if os.path.exists(task):
        raise SelfdraftError(f"task {task} is a folder; give a JSONL prompts file")
    if task.endswith(".jsonl") or os.sep in task:
        raise SelfdraftError(f"prompts file {task} does not exist")
    raise SelfdraftError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}, or the path of a JSONL prompts file")


def _split(value: str | Sequence[str]) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)


def parse_temperatures(value: str | Sequence[float]) -> list[float]:
    items = _split(value) if isinstance(value, str) else list(value)
    try:
        temps = [float(t) for t in items]
    except ValueError:
        raise SelfdraftError(f"temperatures must be numbers >= 0 (0 is greedy), got {value!r}") from None
    if not temps or any(not t >= 0 for t in temps) or len(set(temps)) != len(temps):
        raise SelfdraftError(f"temperatures must be distinct numbers >= 0 (0 is greedy), got {value!r}")
    return temps


# --- the benchmark ----------------------------------------------------------------------------------

@dataclass
class _Tally:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    forwards: int | None = 0
    histogram: Counter | None = field(default_factory=Counter)
    drafted: Counter | None = field(default_factory=Counter)
    accepted: Counter | None = field(default_factory=Counter)
    draft_seconds: float | None = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def add(self, prompt_id: str, g: Generation, seconds: float) -> None:
        self.prompts += 1
        self.tokens += len(g.token_ids)
        self.seconds += seconds
        self.outputs[prompt_id] = g.token_ids
        self.forwards = None if self.forwards is None or g.target_forwards is None else self.forwards + g.target_forwards
        self.histogram = None if self.histogram is None or g.accept_histogram is None else self.histogram + Counter(g.accept_histogram)
        if self.drafted is None or g.depth_drafted is None or g.depth_accepted is None:
            self.drafted = self.accepted = None
        else:
            self.drafted.update(g.depth_drafted)
            self.accepted.update(g.depth_accepted)
        self.draft_seconds = None if self.draft_seconds is None or g.draft_seconds is None else self.draft_seconds + g.draft_seconds


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix of the other, else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed every method uses for one prompt (stable whatever --limit selects)."""
    return (seed + zlib.crc32(prompt_id.encode("utf-8"))) % 2**31


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> float:
    import time

    _sync(device)
    return time.perf_counter()


def _warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


# --- the journal: an interrupted bench resumes ----------------------------------------------------

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
                _warn(f"{self.path}: dropping a torn or unreadable line (an interrupted write); that prompt is decoded again")
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
    fields = {f.name: data[f.name] for f in dataclasses.fields(Generation)}
    for key in ("accept_histogram", "depth_drafted", "depth_accepted"):
        if fields[key] is not None:
            fields[key] = {int(k): v for k, v in fields[key].items()}
    return Generation(**fields)


def run_bench(
    target,
    methods: str | Sequence[str],
    tasks: str | Sequence[str],
    temperatures: str | Sequence[float] = (0.0,),
    max_new_tokens: int = DecodeConfig.max_new_tokens,
    limit: int | None = 10,
    out: str | os.PathLike = "bench",
    *,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    seed: int = 0,
    plots: bool = True,
    progress: bool = True,
    command: str | None = None,
    fresh: bool = False,
) -> dict:
    """Run every method on every prompt of every task at every temperature; write ``out``/results.json,
    report.md and plots; return the results (what results.json holds).

    Finished prompts are journaled in ``out``/progress.jsonl (see :class:`Journal`): a rerun with the
    same settings reuses them and decodes only the rest, so an interrupted bench continues where it
    stopped and a larger ``limit`` adds prompts to a finished one. ``fresh`` discards the journal.

    ``target`` is a spec for :func:`~selfdraft.heads.target.load_target` (loaded with ``dtype`` and
    ``device``) or a loaded Target. ``methods``, ``tasks`` and ``temperatures`` are lists or
    comma-separated strings. ``limit`` caps the prompts per task (None: all). ``threads`` sets torch's
    thread count for the run (restored afterwards). Bad names and options are SelfdraftErrors raised
    before anything is decoded.
    """
    from tqdm import tqdm

    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SelfdraftError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise SelfdraftError(f"limit must be an integer >= 1 (or None for every prompt), got {limit!r}")
    if threads is not None and threads < 1:
        raise SelfdraftError(f"threads must be >= 1, got {threads}")
    temps = parse_temperatures(temperatures)
    choices = [parse_method(m) for m in (split_methods(methods) if isinstance(methods, str) else methods)]
    if not any(c.label == BASELINE for c in choices):
        choices.insert(0, parse_method(BASELINE))
    labels = [c.label for c in choices]
    if len(set(labels)) != len(labels):
        raise SelfdraftError(f"a method is listed twice: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
    short = method_labels(labels)
    task_names = _split(tasks)
    if not task_names:
        raise SelfdraftError(f"no task given; valid tasks: {', '.join(TASKS)}, or the path of a JSONL prompts file")
    if len(set(task_names)) != len(task_names):
        raise SelfdraftError(f"a task is listed twice in {task_names}")
    prompts = {task: task_prompts(task, limit) for task in task_names}
    if plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise SelfdraftError("the plots need matplotlib: pip install 'selfdraft[bench]' (or matplotlib), or pass --no-plots")
    out = pathlib.Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)  # fail now, not after the run
    except OSError as err:
        raise SelfdraftError(f"cannot create the output folder {out}: {err}") from err

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if isinstance(target, str):
            from selfdraft.heads.target import load_target

            target = load_target(target, dtype=dtype, device=device)
        from selfdraft.inference.api import encode_prompt

        encoded: dict[str, list[tuple[Prompt, list[int]]]] = {}
        for task, items in prompts.items():
            encoded[task] = []
            for prompt in items:
                ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
                if len(ids) + max_new_tokens > target.max_context:
                    raise SelfdraftError(
                        f"prompt {prompt.id} of task {task} has {len(ids)} tokens; with max_new_tokens {max_new_tokens} "
                        f"it needs {len(ids) + max_new_tokens} positions but the target holds {target.max_context}")
                encoded[task].append((prompt, ids))
        runners = {c.label: c.method.build(target, c.argument, c.options) for c in choices}

        skipped = [{"method": c.label, "temperature": t,
                    "reason": f"{c.method.name} runs at temperature 0 only" if c.method.temperatures == "greedy"
                    else f"{c.method.name} runs at temperature > 0 only"}
                   for t in temps for c in choices if not c.method.applies(t)]
        journal = Journal(out, _settings(target, choices, max_new_tokens, seed), fresh=fresh)
        plan = []  # (task, t, index, prompt, ids, digest, active, journaled runs or None)
        for task, items in encoded.items():
            for t in temps:
                active = [c for c in choices if c.method.applies(t)]
                for index, (prompt, ids) in enumerate(items):
                    digest = _ids_digest(ids)
                    plan.append((task, t, index, prompt, ids, digest, active,
                                 journal.get(task, t, prompt.id, digest, [c.label for c in active])))
        reused = sum(1 for *_, done in plan if done is not None)
        dev = target.device
        if reused < len(plan):
            if reused:
                print(f"bench: {reused} of {len(plan)} prompts are in {journal.path} from an earlier run with the "
                      "same settings; decoding the rest", file=sys.stderr, flush=True)
            warm_ids = next(ids for items in encoded.values() for _, ids in items)
            for c in choices:
                t = next((t for t in temps if c.method.applies(t)), None)
                if t is not None:
                    runners[c.label](warm_ids, t, prompt_seed(seed, "warm-up"), max_new_tokens)

        tallies: dict[tuple[str, float, str], _Tally] = {}
        by_category: dict[tuple[str, str, float, str], _Tally] = {}
        bar = tqdm(total=sum(len(active) for *_, active, _ in plan), file=sys.stderr, disable=not progress,
                   unit="gen", dynamic_ncols=True)
        try:
            for task, t, index, prompt, ids, digest, active, done in plan:
                if done is None:
                    bar.set_description(f"{task} T={t:g}")
                    s = prompt_seed(seed, prompt.id) if t > 0 else None
                    shift = index % len(active)
                    done = {}
                    for c in active[shift:] + active[:shift]:  # rotate the order from prompt to prompt
                        bar.set_postfix_str(_short(short[c.label], 48), refresh=False)
                        start = _clock(dev)
                        generation = runners[c.label](ids, t, s, max_new_tokens)
                        done[c.label] = (generation, _clock(dev) - start)
                        bar.update(1)
                    journal.add(task, t, prompt.id, digest, done)
                else:
                    bar.update(len(active))
                for c in active:
                    tallies.setdefault((task, t, c.label), _Tally()).add(prompt.id, *done[c.label])
                    if prompt.category:
                        by_category.setdefault((task, prompt.category, t, c.label), _Tally()).add(prompt.id, *done[c.label])
        finally:
            bar.close()
        meta = _meta(target, choices, task_names, temps, max_new_tokens, limit, seed, command)
        meta["journal"] = {"path": JOURNAL, "prompts": len(plan), "reused": reused,
                           "note": "every method of a prompt is timed back to back in one session; reused prompts "
                                   "come from an earlier session with the same settings"}
    finally:
        torch.set_num_threads(old_threads)

    rows = []
    for task in task_names:
        for t in temps:
            base = tallies[(task, t, BASELINE)]
            for c in choices:
                if (task, t, c.label) in tallies:
                    rows.append(_row(task, t, c, tallies[(task, t, c.label)], base))
    category_rows = []  # the same fields per category, where a task's prompts span more than one
    for task in task_names:
        categories = list(dict.fromkeys(p.category for p, _ in encoded[task] if p.category))
        for category in categories if len(categories) > 1 else []:
            for t in temps:
                base = by_category[(task, category, t, BASELINE)]
                for c in choices:
                    if (task, category, t, c.label) in by_category:
                        category_rows.append({"category": category,
                                              **_row(task, t, c, by_category[(task, category, t, c.label)], base)})
    results = {"meta": meta, "rows": rows, "category_rows": category_rows, "skipped": skipped,
               "prompts": {task: [p.id for p, _ in items] for task, items in encoded.items()}}
    for row in rows:
        if row["exact"] is False:
            shown = ", ".join(f"{m['prompt_id']} at token {m['first_divergence']}" for m in row["mismatches"][:5])
            hint = ("; in bf16/fp16 a forward over several tokens rounds differently from one over a single token, "
                    "compare in float32") if meta["dtype"] != "float32" else "; in float32 this is a bug"
            _warn(f"{row['method']} is not token-identical to {BASELINE} on task {row['task']} at temperature 0: "
                  f"{len(row['mismatches'])} of {row['prompts']} prompts differ (first divergence: {shown}){hint}")
    write_outputs(results, out, plots=plots)
    return results


def _meta(target, choices, tasks, temps, max_new_tokens, limit, seed, command) -> dict:
    import transformers

    from selfdraft import __version__

    dev = target.device
    return {
        "target": target.identity.name,
        "target_identity": target.identity.to_dict(),
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "selfdraft": __version__,
        "python": platform.python_version(),
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpu": _cpu_name(),
                    "cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else shlex.join(sys.argv),
        "methods": {c.label: {"method": c.method.name, "argument": c.argument, "options": c.options,
                              "description": c.method.help} for c in choices},
        "baseline": BASELINE,
        "tasks": list(tasks),
        "temperatures": temps,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "seed": seed,
        "speedup": f"tokens/s of the method / tokens/s of {BASELINE} on the same task and temperature",
        "timing": "wall clock around each generation (prompt ids in, new token ids out), warm-up excluded",
    }


def _row(task: str, t: float, c: MethodChoice, tally: _Tally, base: _Tally) -> dict:
    tps = tally.tokens / tally.seconds if tally.seconds > 0 else float("inf")
    base_tps = base.tokens / base.seconds if base.seconds > 0 else float("inf")
    mismatches = []
    if t == 0:
        for prompt_id, tokens in tally.outputs.items():
            div = first_divergence(tokens, base.outputs[prompt_id])
            if div is not None:
                mismatches.append({"prompt_id": prompt_id, "first_divergence": div})
    depth = None
    if tally.drafted is not None:
        depth = {str(d): tally.accepted[d] / n for d, n in sorted(tally.drafted.items())}
    return {
        "task": task,
        "method": c.label,
        "temperature": t,
        "baseline": c.label == BASELINE,
        "prompts": tally.prompts,
        "new_tokens": tally.tokens,
        "seconds": tally.seconds,
        "tokens_per_second": tps,
        "speedup": tps / base_tps,
        "acceptance_length": tally.tokens / tally.forwards if tally.forwards else None,
        "acceptance_histogram": {str(k): v for k, v in sorted(tally.histogram.items())} if tally.histogram is not None else None,
        "per_depth_acceptance": depth,
        "target_forwards": tally.forwards,
        "target_forwards_per_token": tally.forwards / tally.tokens if tally.forwards is not None and tally.tokens else None,
        "drafting_time_share": tally.draft_seconds / tally.seconds if tally.draft_seconds is not None and tally.seconds > 0 else None,
        "exact": (not mismatches) if t == 0 else None,
        "mismatches": mismatches,
    }


# --- outputs ----------------------------------------------------------------------------------------

def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        as_if_created(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


PLOTS = ("speedup.png", "acceptance_histograms.png", "per_depth_acceptance.png")


def write_outputs(results: dict, out: str | os.PathLike, plots: bool = True) -> list[pathlib.Path]:
    """Write results.json, report.md and (with ``plots``) the PNG plots into ``out``, each atomically."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "report.md"]
    _write_atomic(written[0], (json.dumps(results, indent=2) + "\n").encode("utf-8"))
    _write_atomic(written[1], render_report(results, plots=plots).encode("utf-8"))
    if plots:
        for name, figure in zip(PLOTS, (_speedup_figure, _histogram_figure, _depth_figure)):
            _write_atomic(out / name, _png(figure(results)))
            written.append(out / name)
    return written


def _fmt(value, pattern: str, none: str = "-") -> str:
    return none if value is None else format(value, pattern)


def _groups(results: dict) -> list[tuple[str, float, list[dict]]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in results["rows"]:
        groups.setdefault((row["task"], row["temperature"]), []).append(row)
    return [(task, t, rows) for (task, t), rows in groups.items()]


def _table(task: str, t: float, rows: list[dict]) -> tuple[str, str]:
    """(title, markdown table) of one task x temperature."""
    lines = ["| method | tok/s | speedup | tau | forwards/token | drafting share | exact |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = f"`{r['method']}` (baseline)" if r["baseline"] else f"`{r['method']}`"
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else f"**NO** ({len(r['mismatches'])}/{r['prompts']})")
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {_fmt(r['acceptance_length'], '.2f')} "
                     f"| {_fmt(r['target_forwards_per_token'], '.2f')} | {_fmt(r['drafting_time_share'], '.0%')} | {exact} |")
    return f"{task}, temperature {t:g} ({rows[0]['prompts']} prompts)", "\n".join(lines)


def _skipped_line(results: dict, t: float) -> str | None:
    skipped = [s for s in results["skipped"] if s["temperature"] == t]
    if not skipped:
        return None
    return "Not run at this temperature: " + "; ".join(f"`{s['method']}` ({s['reason']})" for s in skipped) + "."


def render_tables(results: dict) -> str:
    """One markdown table per task x temperature (what ``selfdraft bench`` prints to stdout)."""
    parts = []
    for task, t, rows in _groups(results):
        parts += [*_table(task, t, rows), *filter(None, [_skipped_line(results, t)])]
    return "\n\n".join(parts)


def _category_table(results: dict, task: str, t: float) -> str:
    """Markdown table of speedup (tau) per method x category of ``task`` at ``t``; '' if none."""
    rows = [r for r in results.get("category_rows", []) if r["task"] == task and r["temperature"] == t]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != BASELINE]
    if not categories or not methods:
        return ""
    cell = {(r["method"], r["category"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"{c} ({cell[BASELINE, c]['prompts']})" for c in categories) + " |",
             "|---|" + "---:|" * len(categories)]
    for m in methods:
        parts = []
        for c in categories:
            r = cell.get((m, c))
            tau = f" ({r['acceptance_length']:.2f})" if r and r["acceptance_length"] is not None else ""
            parts.append(f"{r['speedup']:.2f}x{tau}" if r else "-")
        lines.append(f"| `{m}` | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def render_report(results: dict, plots: bool = True) -> str:
    m = results["meta"]
    machine = m["machine"]
    lines = [
        "# selfdraft bench", "",
        f"Target `{m['target']}`, {m['dtype']}, {m['device']}, {m['threads']} threads; torch {m['torch']}, "
        f"transformers {m['transformers']}; {machine['cpu'] or machine['machine']}"
        + (f", {machine['gpu']}" if machine["gpu"] else "") + f" ({machine['platform']}); {m['date']}.", "",
        f"{m['max_new_tokens']} new tokens per prompt, up to {m['limit'] or 'all'} prompts per task, seed {m['seed']}. "
        f"Baseline: `{BASELINE}` (our loop without a drafter); speedup = {m['speedup']}. tau = tokens per target "
        "forward; tok/s = new tokens / seconds, summed over the prompts; drafting share = time in the drafter / "
        "generation time (- where a method cannot measure it). "
        "exact: token-identical to the baseline on every prompt (temperature 0 only).", "",
        f"Command: `{m['command']}`", "",
    ]
    for task, t, rows in _groups(results):
        title, table = _table(task, t, rows)
        lines += [f"## {title}", "", table, ""]
        for r in rows:
            if r["exact"] is False:
                shown = ", ".join(f"{x['prompt_id']} at token {x['first_divergence']}" for x in r["mismatches"])
                lines += [f"**WARNING: `{r['method']}` is not token-identical to `{BASELINE}` on {len(r['mismatches'])} "
                          f"of {r['prompts']} prompts (first divergence: {shown}).**", ""]
        depth_lines = [f"- `{r['method']}`: " + ", ".join(f"d{d} {a:.2f}" for d, a in r["per_depth_acceptance"].items())
                       for r in rows if r["per_depth_acceptance"]]
        if depth_lines:
            lines += ["Per-depth acceptance (share of steps that drafted depth d and accepted a token there):", "",
                      *depth_lines, ""]
        by_category = _category_table(results, task, t)
        if by_category:
            lines += ["Speedup over the baseline by category (tau; prompts per category in brackets):", "",
                      by_category, ""]
        skipped = _skipped_line(results, t)
        if skipped:
            lines += [skipped, ""]
    if plots:
        lines += ["## Plots", "", *(f"![{name[:-4]}]({name})" for name in PLOTS), ""]
    return "\n".join(lines)


def _png(figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def _figure(n: int, width: float = 6.0, height: float = 3.6):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height * n), layout="constrained")
    return figure, [figure.add_subplot(n, 1, i + 1) for i in range(n)]


def _colors(results: dict) -> dict[str, str]:
    """One colour per method, the same in every plot."""
    return {label: f"C{i % 10}" for i, label in enumerate(results["meta"]["methods"])}


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]


def _cut_path(label: str, parts: int) -> str:
    """``label`` with the path in its spec cut to the last ``parts`` parts; prefix and options kept."""
    spec, at, options = label.partition("@")
    prefix, colon, path = spec.partition(":") if ":" in spec and "/" not in spec.split(":")[0] else ("", "", spec)
    if "/" in path:
        path = "/".join(pathlib.PurePath(path).parts[-parts:])
    return prefix + colon + path + at + options


def method_labels(methods: Sequence[str]) -> dict[str, str]:
    """Short, distinct legend labels: a drafter folder's path cut to its last two parts, more where
    that is needed to tell two methods apart, options kept (``runs/eagle3-smollm2/drafter@depth=3``
    -> ``eagle3-smollm2/drafter@depth=3``)."""
    parts: dict[str, int | None] = dict.fromkeys(methods, 2)  # None: the label in full
    while True:
        labels = {m: m if n is None else _cut_path(m, n) for m, n in parts.items()}
        clashing = [m for m, n in parts.items() if n is not None and list(labels.values()).count(labels[m]) > 1]
        if not clashing:
            return labels
        for m in clashing:
            longer = _cut_path(m, parts[m] + 1)
            parts[m] = None if longer == labels[m] else parts[m] + 1


def _speedup_figure(results: dict):
    temps = results["meta"]["temperatures"]
    tasks = results["meta"]["tasks"]
    labels = method_labels(results["meta"]["methods"])
    figure, axes = _figure(len(temps), width=max(6.0, 1.6 * len(tasks) + 3) + 0.09 * max(map(len, labels.values())))
    for ax, t in zip(axes, temps):
        rows = [r for r in results["rows"] if r["temperature"] == t and not r["baseline"]]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / max(len(methods), 1)
        for j, method in enumerate(methods):
            xs, ys = [], []
            for i, task in enumerate(tasks):
                hit = [r for r in rows if r["task"] == task and r["method"] == method]
                if hit:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(hit[0]["speedup"])
            ax.bar(xs, ys, width, label=labels[method], color=_colors(results)[method])
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(tasks)), [_short(task, 20) for task in tasks])
        ax.set_ylabel(f"speedup vs {BASELINE}")
        ax.set_title(f"temperature {t:g}")
        if methods:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, "only the baseline ran", ha="center", transform=ax.transAxes)
    return figure


def _histogram_figure(results: dict):
    drafting = {r["method"] for r in results["rows"]
                if r["per_depth_acceptance"] or set(r["acceptance_histogram"] or {}) - {"1"}}
    rows = [r for r in results["rows"] if r["method"] in drafting and r["acceptance_histogram"]]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    labels = method_labels(results["meta"]["methods"])
    figure, axes = _figure(max(len(methods), 1), height=3.0)
    for ax, method in zip(axes, methods):
        series = [r for r in rows if r["method"] == method]
        top = max(int(k) for r in series for k in r["acceptance_histogram"])
        width = 0.8 / len(series)
        for j, r in enumerate(series):
            counts = r["acceptance_histogram"]
            total = sum(counts.values())
            ax.bar([k - 0.4 + width * (j + 0.5) for k in range(1, top + 1)],
                   [counts.get(str(k), 0) / total for k in range(1, top + 1)], width,
                   label=f"{_short(r['task'], 20)}, T={r['temperature']:g}")
        ax.set_xticks(range(1, top + 1))
        ax.set_xlabel("tokens emitted per target forward")
        ax.set_ylabel("share of forwards")
        ax.set_title(labels[method])
        ax.legend(fontsize="small")
    if not methods:
        axes[0].text(0.5, 0.5, "no drafting method reported a histogram", ha="center", transform=axes[0].transAxes)
    return figure


def _depth_figure(results: dict):
    from matplotlib.ticker import MaxNLocator

    groups = _groups(results)
    labels = method_labels(results["meta"]["methods"])
    figure, axes = _figure(len(groups), width=6.0 + 0.09 * max(map(len, labels.values())), height=3.0)
    for ax, (task, t, rows) in zip(axes, groups):
        drew = False
        for r in rows:
            depth = r["per_depth_acceptance"]
            if depth:
                ax.plot([int(d) for d in depth], list(depth.values()), marker="o", label=labels[r["method"]],
                        color=_colors(results)[r["method"]])
                drew = True
        ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft depth d")
        ax.set_ylabel("accepted at d")
        ax.set_title(f"{_short(task, 30)}, temperature {t:g}")
        if drew:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, "no drafting method", ha="center", transform=ax.transAxes)
    return figure
