"""What a method produces (:class:`Generation`) and the runners that produce it: our loop with a
drafter (:class:`LoopRunner`) and transformers' ``generate()`` (:class:`HFRunner`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from selfdraft.configs.decode import DecodeConfig
from selfdraft.errors import SelfdraftError


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
    seconds: float | None = None
    """Wall time the method measured itself (an engine in another process); None: the benchmark's
    clock around the call."""
    engine_steps: tuple[int, int] | None = None
    """(verification steps that carried drafts, accepted draft tokens) as an engine counts them, where
    it reports them instead of target forwards (vLLM)."""
    draft_nodes: int | None = None
    """Draft tree nodes the target verified, summed over the steps (the verify batch is this + 1 a step)."""
    drafted_steps: int | None = None
    """Verification steps that ran the drafter (fewer than target forwards - 1 where the drafting policy
    chose plain steps)."""


Runner = Callable[[list[int], float, "int | None", int], Generation]
"""(prompt ids, temperature, seed, max_new_tokens) -> Generation; the benchmark times the call."""


class LoopRunner:
    """Our decoding loop (the one behind :func:`selfdraft.generate`) with one drafter, under the drafting
    policy ``policy`` (None: the bench's, ``auto`` unless it says otherwise); ``folder``: the drafter folder,
    whose speculation profile the policy may follow. The batch-1 policy is made here (its costs measured
    or read before anything is timed); :meth:`policy_at` makes the others before the batched bench times."""

    def __init__(self, target, drafter, policy: str | None = None, folder: str | None = None):
        self.target, self.drafter, self.policy, self.folder = target, drafter, policy, folder
        self._policies: dict[tuple[int, str], object] = {}
        self.policy_at(1)

    def policy_at(self, rows: int, default: str = "auto"):
        from selfdraft.inference.policy import policy_for

        key = (rows, self.policy or default)
        if key not in self._policies:
            self._policies[key] = policy_for(self.target, self.drafter, key[1], folder=self.folder, rows=rows)
        return self._policies[key]

    def __call__(self, ids: list[int], temperature: float, seed: int | None, max_new_tokens: int) -> Generation:
        from selfdraft.inference.batch import BatchSession
        from selfdraft.inference.decode import speculative_decode

        config = DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        session = BatchSession(self.target.model, hidden_layers=self.drafter.hidden_layers)
        out = speculative_decode(session, ids, self.drafter, config, eos_token_ids=self.target.eos_token_ids,
                                 max_context=self.target.max_context, policy=self.policy_at(1))
        s = out.stats
        return Generation(out.token_ids, s.target_forwards, dict(s.accept_histogram), dict(s.depth_drafted),
                          dict(s.depth_accepted), s.draft_seconds, draft_nodes=s.draft_nodes,
                          drafted_steps=s.drafted_steps)


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


class VllmRunner:
    """vLLM itself (in its own venv, see :mod:`selfdraft.inference.vllm_engine`) with an exported
    drafter, or plainly with ``folder=None``.

    Starting the engine takes most of a minute, so the benchmark hands the runner every call it will
    make (:meth:`prepare`) and vLLM decodes them all in one engine, timing each prompt itself
    (``Generation.seconds``). Target forwards are the verification steps that carried drafts plus the
    prefill; vLLM does not report drafting time.
    """

    def __init__(self, target, folder: str | None, num_speculative_tokens: int | None = None, *, in_process: bool = False):
        """``folder``: an exported drafter, None for plain decoding, or ``"suffix"`` for vLLM's built-in
        suffix decoding (``method: suffix``; ``num_speculative_tokens`` its most drafts per step, vLLM's
        default where None)."""
        from selfdraft.heads.target import target_folder
        from selfdraft.inference.vllm_engine import speculative_config, suffix_config, vllm_python

        if vllm_python() is None:
            from selfdraft.inference.vllm_engine import SETUP_HINT

            raise SelfdraftError(f"vllm methods need vLLM's venv: {SETUP_HINT}")
        if target.device.type != "cpu":
            raise SelfdraftError("the vllm methods run vLLM's CPU build here: bench with --device cpu")
        path = target_folder(target.identity.name)
        if path is None:
            raise SelfdraftError(f"vLLM needs the target as a model folder; {target.identity.name!r} is a hub name")
        self.target, self.target_path = target, str(path)
        if folder == "suffix":
            self.speculative = suffix_config(num_speculative_tokens)
        else:
            self.speculative = speculative_config(folder, num_speculative_tokens) if folder else None
        self.dtype = str(target.dtype).removeprefix("torch.")
        self.in_process = in_process  # run_vllm's: the engine core in the worker's own process
        self.results: dict[tuple, Generation] = {}
        self.version: str | None = None

    @property
    def max_model_len(self) -> int:
        """The context vLLM is started with: the target's, or 4096 where it declares none worth the name."""
        return self.target.max_context if self.target.max_context < 2**20 else 4096

    def prepare(self, calls: list[tuple[list[int], float, "int | None", int]]) -> None:
        """Decode every (ids, temperature, seed, max_new_tokens) the benchmark will ask for, in one engine."""
        from selfdraft.inference.vllm_engine import run_vllm

        todo = [c for c in dict.fromkeys((tuple(i), t, s, n) for i, t, s, n in calls) if c not in self.results]
        for n in sorted({c[3] for c in todo}):
            batch = [c for c in todo if c[3] == n]
            out = run_vllm(self.target_path, [list(c[0]) for c in batch], n, speculative=self.speculative,
                           temperatures=[c[1] for c in batch], seeds=[c[2] for c in batch], dtype=self.dtype,
                           max_model_len=self.max_model_len,
                           warmup=[list(batch[0][0])], in_process=self.in_process)
            self.version = f"vllm {out['vllm_version']}"
            for call, r in zip(batch, out["results"]):
                tokens = r["token_ids"]
                if self.speculative is None:  # one target forward per token
                    self.results[call] = Generation(tokens, target_forwards=len(tokens), accept_histogram={1: len(tokens)},
                                                    depth_drafted={}, depth_accepted={}, draft_seconds=0.0,
                                                    seconds=r["seconds"])
                    continue
                drafts, accepted = r["drafts"], r["accepted_per_position"]
                # A drafter drafts at every step: the steps that drafted, and the prefill. Suffix decoding
                # drafts only where its tree matches; each step emits its accepted drafts and one token of
                # its own, so tokens - accepted counts the others too (vLLM also counts drafts accepted past
                # max_tokens, which makes that count the smaller one for a drafter).
                self.results[call] = Generation(
                    tokens, target_forwards=max(drafts + 1, len(tokens) - r["accepted_tokens"]), accept_histogram=None,
                    depth_drafted={d + 1: drafts for d in range(len(accepted))},
                    depth_accepted={d + 1: a for d, a in enumerate(accepted)},
                    draft_seconds=None, seconds=r["seconds"], engine_steps=(drafts, r["accepted_tokens"]))

    def __call__(self, ids: list[int], temperature: float, seed: int | None, max_new_tokens: int) -> Generation:
        key = (tuple(ids), temperature, seed, max_new_tokens)
        if key not in self.results:
            self.prepare([(ids, temperature, seed, max_new_tokens)])
        return self.results[key]
