"""Decode options: how many tokens, how to sample, and how each built-in drafter shapes its tree.

Each field is documented once, here; the CLI and the Python API take their defaults from these
dataclasses. ``validate()`` turns bad values into a :class:`SelfdraftError` that names the option.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfdraft.errors import SelfdraftError


@dataclass(frozen=True)
class DecodeConfig:
    """Sampling and stopping for one generation."""

    max_new_tokens: int = 128
    """Stop after this many new tokens (at least 1)."""
    temperature: float = 0.0
    """0 decodes greedily (argmax); above 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0: no limit). Ignored when greedy."""
    top_p: float = 1.0
    """Sample only from the smallest set of most likely tokens whose mass reaches top_p (1: no limit)."""
    seed: int | None = None
    """Seed of the sampler's random generator (None: a fresh random seed)."""
    stop_on_eos: bool = True
    """Stop after the target emits one of its end-of-sequence tokens (the EOS token is kept)."""
    acceptance: str = "exact"
    """``exact`` keeps the target's distribution; ``typical`` (LOSSY, sampling only) accepts a draft
    token when its target probability exceeds min(typical_epsilon, typical_delta * exp(-entropy)),
    Medusa's typical acceptance: longer accepted paths, but the output distribution changes."""
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "DecodeConfig":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SelfdraftError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise SelfdraftError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SelfdraftError(f"top_k must be an integer >= 0 (0 means no limit), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SelfdraftError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.acceptance not in ("exact", "typical"):
            raise SelfdraftError(f"acceptance must be 'exact' or 'typical' (lossy), got {self.acceptance!r}")
        if self.acceptance == "typical" and self.greedy:
            raise SelfdraftError("typical acceptance is a sampling mode: give temperature > 0 (greedy is exact anyway)")
        if self.acceptance == "typical" and not (0 < self.typical_epsilon <= 1 and self.typical_delta > 0):
            raise SelfdraftError("typical acceptance needs 0 < typical_epsilon <= 1 and typical_delta > 0")
        return self

    @property
    def lossy(self) -> bool:
        """True when the output distribution is NOT the target's (typical acceptance)."""
        return self.acceptance == "typical"


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup: copy what followed an earlier occurrence of the last few tokens."""

    max_ngram: int = 3
    """Longest suffix n-gram to look for; shorter ones are tried when it is not found."""
    min_ngram: int = 1
    """Shortest suffix n-gram that may produce a draft."""
    num_tokens: int = 4
    """Draft tokens copied after a match (the depth of each branch). 4 suits a CPU, where verifying 5
    tokens costs about one token's forward and more cost more: on SmolLM2-135M it ran at 1.23x / 1.92x
    (MT-bench / HumanEval subsets) against 1.13x / 1.87x for 7 and 1.03x / 1.75x for 10; a GPU affords
    longer drafts."""
    max_branches: int = 1
    """Distinct continuations (earliest matches first) merged into one tree; 1 drafts a chain."""
    max_nodes: int = 16
    """Most draft tokens in one tree."""

    def validate(self) -> "PromptLookupConfig":
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SelfdraftError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        for name in ("num_tokens", "max_branches", "max_nodes"):
            if getattr(self, name) < 1:
                raise SelfdraftError(f"prompt lookup {name} must be >= 1, got {getattr(self, name)}")
        return self


@dataclass(frozen=True)
class DraftModelConfig:
    """A separate small model with the target's tokenizer drafts a chain (top_k=1) or a tree."""

    depth: int = 4
    """Draft steps per proposal (tree depth)."""
    top_k: int = 1
    """Children per expanded node, and nodes expanded per depth; 1 drafts a chain."""
    max_nodes: int = 16
    """Most draft tokens kept in the tree, best cumulative draft log-probability first."""

    def validate(self) -> "DraftModelConfig":
        for name in ("depth", "top_k", "max_nodes"):
            if getattr(self, name) < 1:
                raise SelfdraftError(f"draft model {name} must be >= 1, got {getattr(self, name)}")
        return self


@dataclass(frozen=True)
class DynamicTreeConfig:
    """EAGLE-2 dynamic tree: expand the top_k best nodes per depth, keep the max_nodes best overall.

    The defaults suit a CPU: with the few-row kernel of ``heads/small_batch.py`` a verify forward over
    5 tokens costs about one token's, over 8 tokens 1.3x, over 16 tokens 1.6x (SmolLM2-135M, 2-core
    AVX2), and 3/2/4 was the fastest of 3/2/4, 3/4/7 and 4/4/15 for EAGLE-3 there (1.04x and 1.00x
    on MT-bench and HumanEval subsets vs 0.97x/0.89x and 0.82x/0.74x). On a GPU EAGLE-2's own setting
    (depth 6, top_k 10, max_nodes 60) verifies far larger trees for free.
    """

    depth: int = 3
    """Draft tokens along the deepest path (drafter forwards per proposal)."""
    top_k: int = 2
    """Children proposed per expanded node, and nodes expanded per depth."""
    max_nodes: int = 4
    """Draft tokens kept in the tree, best cumulative draft log-probability first."""

    def validate(self) -> "DynamicTreeConfig":
        for name in ("depth", "top_k", "max_nodes"):
            if getattr(self, name) < 1:
                raise SelfdraftError(f"dynamic tree {name} must be >= 1, got {getattr(self, name)}")
        return self


GPU_DYNAMIC_TREE = DynamicTreeConfig(depth=6, top_k=10, max_nodes=60)
"""EAGLE-2's published setting, for GPUs."""
