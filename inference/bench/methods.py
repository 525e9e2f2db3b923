"""The method registry (:data:`METHODS`, :func:`register`), drafter folders as methods, and the parsing of
``METHOD@key=value,key=value`` and of method lists. A new method is a :func:`register` call here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from selfdraft.configs.decode import PromptLookupConfig
from selfdraft.errors import SelfdraftError
from selfdraft.inference.bench.runners import HFRunner, LoopRunner, Runner


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


def _policy(text: str) -> str:
    from selfdraft.configs.decode import POLICIES

    if text not in POLICIES:
        raise ValueError(f"must be one of {', '.join(POLICIES)}")
    return text


def _on_off(text: str) -> str:
    if text not in ("on", "off", "confidence"):
        raise ValueError("must be on or off")
    return text


_POLICY_OPTION = {
    "policy": (_policy, "how much to draft (`selfdraft generate --help`): auto (default), adaptive, cut, fixed or profile"),
    "adaptive": (_on_off, "the previous release's option (on: policy=adaptive, off: policy=cut)"),
    "schedule": (_on_off, "the previous release's option (off with adaptive=off: policy=fixed)"),
}


def _take_policy(options: dict) -> str | None:
    """Pop the policy options from a method's ``options``: the policy named, or None (the bench's)."""
    from selfdraft.configs.decode import legacy_policy

    adaptive, schedule = options.pop("adaptive", None), options.pop("schedule", None)
    policy = options.pop("policy", None)
    return legacy_policy(adaptive, schedule) or policy


def _schedule(text: str) -> str:
    if text not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError("must be constant, heuristic or heuristic_transient")
    return text


def _engine(text: str) -> str:
    if text not in ("serve", "inline"):
        raise ValueError("must be serve or inline")
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
                              max_nodes=options.get("max_nodes", max(d.max_nodes, tokens)))


def _build_prompt_lookup(target, argument, options):
    from selfdraft.inference.drafters import PromptLookupDrafter

    options = dict(options)
    return LoopRunner(target, PromptLookupDrafter(_prompt_lookup_config(options)), _take_policy(options))


def _build_draft_model(target, argument, options):
    from selfdraft.inference.specs import make_drafter

    options = dict(options)
    policy = _take_policy(options)
    return LoopRunner(target, make_drafter(f"draft-model:{argument}", target, tree=options or None), policy)


def _build_copy(target, argument, options):
    from selfdraft.configs.decode import CopyConfig
    from selfdraft.inference.hybrid import CopyDrafter

    options = dict(options)
    policy = _take_policy(options)
    return LoopRunner(target, CopyDrafter(CopyConfig(**options)), policy)


def _build_hybrid(target, argument, options):
    from selfdraft.configs.decode import HybridConfig
    from selfdraft.inference.hybrid import hybrid_for
    from selfdraft.inference.specs import make_drafter

    options = dict(options)
    policy = _take_policy(options)
    config = HybridConfig(**({"max_nodes": options.pop("max_nodes")} if "max_nodes" in options else {}))
    inner = make_drafter(argument, target, tree=options or None)
    return LoopRunner(target, hybrid_for(target, inner, config), policy)


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


def _build_vllm(target, argument, options):
    from selfdraft.inference.bench.runners import VllmRunner

    folder = None if argument in (None, "none") else argument
    return VllmRunner(target, folder, options.get("tokens"), in_process=options.get("engine") == "inline")


_TREE_OPTIONS = {"depth": (_positive_int, "draft depth"), "top_k": (_positive_int, "children per expanded node"),
                 "max_nodes": (_positive_int, "draft tokens kept per tree (the node budget)")}

register(Method("none", lambda t, a, o: LoopRunner(t, _no_drafter()), "our loop without a drafter: the baseline"))
register(Method("prompt-lookup", _build_prompt_lookup, "our loop, copying continuations of earlier n-grams", {
    "tokens": (_positive_int, "draft tokens per match"), "max_ngram": (_positive_int, "longest n-gram looked up"),
    "min_ngram": (_positive_int, "shortest n-gram looked up"), "branches": (_positive_int, "continuations merged into a tree"),
    "max_nodes": (_positive_int, "draft tokens per tree (the node budget)"), **_POLICY_OPTION}))
register(Method("copy", _build_copy, "our loop, copying the frequent continuations of the longest earlier match of "
                "the text's suffix (SuffixDecoding's way; cut to what pays on this machine)", {
    "depth": (_positive_int, "deepest copied token"), "max_nodes": (_positive_int, "draft tokens per tree (the node budget)"),
    "max_pattern": (_positive_int, "longest suffix matched"), **_POLICY_OPTION}))
register(Method("hybrid", _build_hybrid, "our loop with copying and the drafter SPEC (a drafter folder or "
                "draft-model:SPEC) merged into one tree per step", {
    "max_nodes": (_positive_int, "draft tokens in the merged tree (the node budget)"),
    "depth": (_positive_int, "the drafter's draft depth"), "top_k": (_positive_int, "the drafter's children per expanded node"),
    **_POLICY_OPTION}, argument="SPEC"))
register(Method("draft-model", _build_draft_model, "our loop with a separate small model of the same tokenizer",
                {**_TREE_OPTIONS, **_POLICY_OPTION}, argument="SPEC"))
register(Method("hf-greedy", lambda t, a, o: HFRunner(t), "transformers generate(), greedy", temperatures="greedy"))
register(Method("hf-sample", lambda t, a, o: HFRunner(t), "transformers generate(do_sample=True), top_k 0, top_p 1",
                temperatures="sample"))
register(Method("hf-prompt-lookup", _build_hf_prompt_lookup, "transformers generate(prompt_lookup_num_tokens=...)", {
    "tokens": (_positive_int, "prompt_lookup_num_tokens (default 10)"),
    "max_ngram": (_positive_int, "max_matching_ngram_size")}, temperatures="greedy"))
register(Method("hf-assisted", _build_hf_assisted, "transformers assisted generation with assistant_model=SPEC", {
    "tokens": (_positive_int, "num_assistant_tokens"), "schedule": (_schedule, "num_assistant_tokens_schedule"),
    "confidence": (_share, "assistant_confidence_threshold")}, argument="SPEC"))
register(Method("vllm", _build_vllm, "vLLM itself (its CPU build, in .venv-vllm) with a drafter exported by "
                "`selfdraft export --format vllm` (a chain of num_speculative_tokens), vllm:suffix for its built-in "
                "suffix decoding, or vllm:none for plain decoding; timed by vLLM per prompt",
                {"tokens": (_positive_int, "num_speculative_tokens (default: Medusa heads, else 3; suffix: 24)"),
                                             "engine": (_engine, "serve (default: the engine core in a process of its own, "
                                                                 "as `vllm serve` runs it) or inline (one process: starts "
                                                                 "faster; same model code and kernels, for checks)")},
                argument="FOLDER"))


def _no_drafter():
    from selfdraft.inference.drafters import NoDrafter

    return NoDrafter()


def _folder_method(path: str) -> Method | None:
    """A method for a drafter folder that make_drafter reads, or None when ``path`` is not one."""
    from selfdraft.heads.kinds import get_kind
    from selfdraft.inference.specs import folder_kind

    kind = folder_kind(path)
    if kind is None:
        return None
    options = {k: v for k, v in _TREE_OPTIONS.items() if k in get_kind(kind).tree_options}
    options.update(_POLICY_OPTION)

    def build(target, argument, options):
        from selfdraft.inference.specs import make_drafter

        options = dict(options)
        policy = _take_policy(options)
        return LoopRunner(target, make_drafter(path, target, tree=options or None), policy, folder=path)

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
        ", or a drafter folder (native Medusa / EAGLE-1 / EAGLE-3 / DFlash / DSpark, or an engine layout selfdraft reads)"


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
