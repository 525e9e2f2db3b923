"""The Python API behind ``selfdraft generate``: same options, same fields.

Example::

    from selfdraft import load_target, make_drafter, generate

    target = load_target("smollm2-135m", dtype="bfloat16")
    drafter = make_drafter("prompt-lookup", target)
    for prompt in prompts:
        result = generate(target, prompt, drafter=drafter, chat=True, max_new_tokens=128)
        print(result.text, result.acceptance_length, result.tokens_per_second)
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Sequence

from selfdraft.configs.decode import DecodeConfig, PromptLookupConfig, TreeConfig, legacy_policy
from selfdraft.errors import SelfdraftError
from selfdraft.inference.batch import BatchSession
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.drafters import Drafter
from selfdraft.inference.policy import FIXED, policy_for
from selfdraft.inference.specs import make_drafter


@dataclass
class GenerationResult:
    """One generation and its statistics (the fields of ``selfdraft generate --json``)."""

    text: str
    token_ids: list[int]
    """The new tokens only (an EOS token that stopped generation is included)."""
    new_tokens: int
    prompt_tokens: int
    target_forwards: int
    """Target forward passes, the prefill included."""
    acceptance_length: float
    """Tokens emitted per target forward (tau): new_tokens / target_forwards."""
    accept_histogram: dict[int, int]
    """Tokens emitted per forward -> how many forwards emitted that many."""
    depth_acceptance: dict[int, float]
    """Draft depth d -> share of verification steps with a depth-d draft that accepted a token there."""
    draft_nodes_per_step: float
    """Draft nodes verified per step (after the drafting policy's cut)."""
    proposed_nodes_per_step: float
    """Draft nodes the drafter proposed per step (before the cut)."""
    seconds: float
    tokens_per_second: float
    draft_seconds: float
    """Time spent inside the drafter (its share of ``seconds`` is the drafting cost)."""
    drafted_steps: int
    """Verification steps that ran the drafter."""
    skipped_steps: int
    """Plain steps the drafting policy chose because drafting did not pay (``policy="adaptive"``)."""
    stop_reason: str
    drafter: str
    decode: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``: raw text, or a single user turn through the tokenizer's chat template."""
    if tokenizer is None:
        raise SelfdraftError("this target has no tokenizer: pass input_ids instead of a text prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SelfdraftError("--chat needs a tokenizer with a chat template; this target has none")
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def generate(
    target,
    prompt: str | None = None,
    *,
    input_ids: Sequence[int] | None = None,
    drafter: str | Drafter = "none",
    chat: bool = False,
    max_new_tokens: int = DecodeConfig.max_new_tokens,
    temperature: float = DecodeConfig.temperature,
    top_k: int = DecodeConfig.top_k,
    top_p: float = DecodeConfig.top_p,
    seed: int | None = DecodeConfig.seed,
    stop_on_eos: bool = DecodeConfig.stop_on_eos,
    acceptance: str = DecodeConfig.acceptance,
    tree: TreeConfig | dict | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    prompt_lookup: PromptLookupConfig = PromptLookupConfig(),
    policy: str = "auto",
    schedule: str | None = None,
    adaptive: str | None = None,
) -> GenerationResult:
    """Decode one prompt with a drafter and return the text and acceptance statistics.

    ``target`` is a loaded :class:`~selfdraft.heads.target.Target` (reuse it across prompts) or a
    spec for :func:`~selfdraft.heads.target.load_target` (loaded with ``dtype`` and ``device``).
    ``drafter`` is a :class:`Drafter` or a spec: ``none``, ``prompt-lookup``, ``draft-model:SPEC``.
    Give either ``prompt`` (text; ``chat`` wraps it as a user turn) or ``input_ids``.
    ``acceptance="typical"`` is Medusa's LOSSY typical acceptance (sampling only). ``tree`` sets a
    trained drafter folder's tree (a :class:`TreeConfig`, or a dict of the fields to change in its
    stored tree, e.g. ``{"max_nodes": 8}``: a Medusa drafter then rebuilds its sparse tree for that node
    budget from its stored accuracies). ``policy`` decides how much to draft (inference/policy.py):
    ``auto``/``adaptive`` (the default) drafts only while drafting pays for this prompt by this machine's
    measured costs, probing now and then once it stops, and verifies only the part of a valued tree worth
    verifying; ``cut`` only the latter; ``fixed`` the drafter's whole tree every step. ``schedule`` and
    ``adaptive`` are the previous release's options, kept one release as aliases (with a warning).
    """
    config = DecodeConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop_on_eos=stop_on_eos, acceptance=acceptance,
    )
    if isinstance(target, str):
        from selfdraft.heads.target import load_target

        target = load_target(target, dtype=dtype, device=device)
    if (prompt is None) == (input_ids is None):
        raise SelfdraftError("give exactly one of prompt (text) or input_ids")
    ids = list(input_ids) if input_ids is not None else encode_prompt(target.tokenizer, prompt, chat)
    policy = legacy_policy(adaptive=adaptive, schedule=schedule) or policy
    folder = drafter if isinstance(drafter, str) else None
    drafter = make_drafter(drafter, target, tree=tree, prompt_lookup=prompt_lookup)

    session = BatchSession(target.model, hidden_layers=drafter.hidden_layers)
    out = speculative_decode(
        session, ids, drafter, config, eos_token_ids=target.eos_token_ids, max_context=target.max_context,
        policy=policy_for(target, drafter, policy, folder=_folder(folder)),
    )
    return _result(target, ids, out, drafter, config)


def _folder(spec: str | None) -> str | None:
    """The drafter folder a drafter spec names, if it is one (its speculation profile may apply)."""
    import os

    return spec if spec is not None and os.path.isdir(spec) else None


def _result(target, ids: list[int], out, drafter: Drafter, config: DecodeConfig) -> GenerationResult:
    """A :class:`GenerationResult` from one row's :class:`~selfdraft.inference.decode.DecodeOutput`."""
    stats = out.stats
    new = len(out.token_ids)
    steps = max(stats.target_forwards - 1, 1)
    text = target.tokenizer.decode(out.token_ids, skip_special_tokens=True) if target.tokenizer is not None else ""
    return GenerationResult(
        text=text,
        token_ids=out.token_ids,
        new_tokens=new,
        prompt_tokens=len(ids),
        target_forwards=stats.target_forwards,
        acceptance_length=new / stats.target_forwards,
        accept_histogram=dict(sorted(stats.accept_histogram.items())),
        depth_acceptance=stats.depth_acceptance(),
        draft_nodes_per_step=stats.draft_nodes / steps,
        proposed_nodes_per_step=stats.proposed_nodes / steps,
        seconds=out.seconds,
        tokens_per_second=new / out.seconds if out.seconds > 0 else float("inf"),
        draft_seconds=stats.draft_seconds,
        drafted_steps=stats.drafted_steps,
        skipped_steps=stats.skipped_steps,
        stop_reason=out.stop_reason,
        drafter=drafter.name,
        decode={"max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "top_k": config.top_k,
                "top_p": config.top_p, "seed": config.seed, "acceptance": config.acceptance, "lossy": config.lossy},
    )


def generate_batch(
    target,
    prompts: Sequence[str] | None = None,
    *,
    input_ids: Sequence[Sequence[int]] | None = None,
    drafter: str | Drafter = "none",
    chat: bool = False,
    max_new_tokens: int = DecodeConfig.max_new_tokens,
    temperature: float = DecodeConfig.temperature,
    top_k: int = DecodeConfig.top_k,
    top_p: float = DecodeConfig.top_p,
    seeds: Sequence[int | None] | int | None = DecodeConfig.seed,
    stop_on_eos: bool = DecodeConfig.stop_on_eos,
    acceptance: str = DecodeConfig.acceptance,
    tree: TreeConfig | dict | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    prompt_lookup: PromptLookupConfig = PromptLookupConfig(),
    policy: str = "auto",
    speculation: str | None = None,
) -> list[GenerationResult]:
    """Decode several prompts together, one target forward per step for all of them (inference/batch.py),
    and return one result per prompt, in order. Each row is exact as :func:`generate` is; a row's
    ``seconds`` is the time until it finished.

    Options as :func:`generate`; ``seeds``: one per prompt, or one int for every row. ``policy="auto"``
    (the default) follows the drafter folder's ``speculation_profile.json`` (``selfdraft costs --drafter``):
    per live batch size the drafts it found to pay, none where drafting does not pay; for any other drafter
    it is ``adaptive``: the batch drafts while drafting pays at the live batch size by this machine's
    measured costs, and valued trees are cut to what pays there (inference/policy.py). ``"fixed"`` drafts
    the drafter's own tree at every step. ``speculation`` is the previous release's option (an alias).
    """
    from selfdraft.inference.decode import batched_decode
    from selfdraft.inference.batch import check_batch_fits

    policy = legacy_policy(speculation=speculation) or policy
    if isinstance(target, str):
        from selfdraft.heads.target import load_target

        target = load_target(target, dtype=dtype, device=device)
    if (prompts is None) == (input_ids is None):
        raise SelfdraftError("give exactly one of prompts (texts) or input_ids (token id lists)")
    if isinstance(prompts, str):
        raise SelfdraftError("prompts is one string: give a list of prompts (or use generate() for one)")
    ids = [list(p) for p in input_ids] if input_ids is not None else [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    per_row = list(seeds) if isinstance(seeds, (list, tuple)) else [seeds] * len(ids)
    config = DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=per_row[0] if per_row else None, stop_on_eos=stop_on_eos, acceptance=acceptance)
    if ids:
        check_batch_fits(target.model, len(ids), max(map(len, ids)) + max_new_tokens)
    folder = _folder(drafter) if isinstance(drafter, str) else None
    drafter = make_drafter(drafter, target, tree=tree, prompt_lookup=prompt_lookup)
    rule = policy_for(target, drafter, policy, folder=folder, rows=len(ids)) if ids else FIXED
    session = BatchSession(target.model, hidden_layers=drafter.hidden_layers)
    outs = batched_decode(session, ids, drafter, config, seeds=per_row, eos_token_ids=target.eos_token_ids,
                          max_context=target.max_context, policy=rule)
    return [_result(target, row, out, drafter, dataclasses.replace(config, seed=seed))
            for row, out, seed in zip(ids, outs, per_row)]
