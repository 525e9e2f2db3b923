"""Decode options: how many tokens, how to sample, and the shape of every drafter's tree.

Each field is documented once, here; the CLI and the Python API take their defaults from these
dataclasses. Every dataclass checks itself when it is made: a bad value is a :class:`SelfdraftError`
that names the option.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from selfdraft.errors import SelfdraftError

logger = logging.getLogger(__name__)

POLICIES = ("auto", "adaptive", "cut", "fixed", "profile")
"""The drafting policies (inference/policy.py says what each does); ``auto`` is the default."""


def legacy_policy(adaptive: str | None = None, schedule: str | None = None, speculation: str | None = None) -> str | None:
    """The policy the options of the previous release (``adaptive``, ``schedule``, ``speculation``) mean,
    with a warning that names it; None when none was given."""
    if adaptive is None and schedule is None and speculation is None:
        return None
    for option, value, allowed in (("adaptive", adaptive, ("on", "off")), ("schedule", schedule, ("confidence", "off")),
                                   ("speculation", speculation, ("auto", "off"))):
        if value is not None and value not in allowed:
            raise SelfdraftError(f"unknown {option} {value!r}; choose one of {', '.join(allowed)} (or better, a drafting "
                                 f"policy: {', '.join(POLICIES)})")
    if speculation == "off" or (adaptive == "off" and schedule == "off"):
        name = "fixed"
    elif adaptive == "off":
        name = "cut"
    else:
        name = "auto"
    given = ", ".join(f"{k}={v!r}" for k, v in (("adaptive", adaptive), ("schedule", schedule), ("speculation", speculation))
                      if v is not None)
    logger.warning("%s: these options are replaced by the drafting policy; this is policy=%r (--policy %s), which "
                   "the next release will require", given, name, name)
    return name


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

    def __post_init__(self):
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
    """Draft tokens copied after a match (the depth of each branch). Short, for a CPU, where verifying
    a few tokens costs about one token's forward and more cost more; a GPU affords longer drafts."""
    max_branches: int = 1
    """Distinct continuations (earliest matches first) merged into one tree; 1 drafts a chain."""
    max_nodes: int = 16
    """The node budget: most draft tokens in one tree."""

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SelfdraftError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        for name in ("num_tokens", "max_branches", "max_nodes"):
            if getattr(self, name) < 1:
                raise SelfdraftError(f"prompt lookup {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class CopyConfig:
    """Copy drafting (SuffixDecoding's way): the longest suffix of the sequence that occurred before, and
    a tree of what followed its occurrences, each node valued by how often it followed."""

    max_pattern: int = 32
    """Longest suffix of the sequence matched against its earlier text."""
    depth: int = 8
    """Deepest copied token."""
    max_nodes: int = 16
    """The node budget: most draft tokens in one tree."""
    max_occurrences: int = 64
    """Most recent occurrences of the matched suffix whose continuations are counted."""
    min_value: float = 0.05
    """Nodes valued below this probability are not proposed."""

    def __post_init__(self):
        for name in ("max_pattern", "depth", "max_nodes", "max_occurrences"):
            if getattr(self, name) < 1:
                raise SelfdraftError(f"copy drafting {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_value < 1.0:
            raise SelfdraftError(f"copy drafting min_value must be in [0, 1), got {self.min_value}")


@dataclass(frozen=True)
class HybridConfig:
    """Hybrid drafting: a copy tree and a drafter's tree merged into one verification tree per step."""

    max_nodes: int = 16
    """The node budget of the merged tree, before the cut to what pays on this machine's cost curve."""
    prior: float = 4.0
    """Pseudo-count of each source's calibration (accepted over predicted nodes) at its start."""
    memory: float = 0.98
    """Weight of the past in each source's running calibration and gain."""

    def __post_init__(self):
        if self.max_nodes < 1:
            raise SelfdraftError(f"hybrid max_nodes must be >= 1, got {self.max_nodes}")
        if self.prior <= 0:
            raise SelfdraftError(f"hybrid prior must be > 0, got {self.prior}")
        if not 0.0 <= self.memory < 1.0:
            raise SelfdraftError(f"hybrid memory must be in [0, 1), got {self.memory}")


@dataclass(frozen=True)
class TreeConfig:
    """The draft tree a trained drafter proposes per step: the one tree setting of every drafter kind,
    in run configs (``drafter.tree``), exports, the CLI (``--tree-depth``, ``--tree-top-k``,
    ``--max-nodes``) and bench options (``@depth=,top_k=,max_nodes=``).

    Dynamic trees (EAGLE-2 style, and a draft model's) expand the ``top_k`` best nodes per depth into
    their ``top_k`` best children and keep the ``max_nodes`` best overall; Medusa's sparse tree takes
    the ``max_nodes`` most likely choices from its measured per-head accuracies (its depth is its
    number of heads). The defaults are a small tree: on a CPU, verifying many more tokens than one
    costs more than they bring; on a GPU, :data:`GPU_TREE` verifies a far larger tree for the same
    forward."""

    depth: int = 3
    """Draft tokens along the deepest path (drafter forwards per proposal)."""
    top_k: int = 2
    """Children proposed per expanded node, and nodes expanded per depth."""
    max_nodes: int = 4
    """The node budget: draft tokens verified per step, best cumulative draft probability first."""

    def __post_init__(self):
        for name in ("depth", "top_k", "max_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SelfdraftError(f"tree {name} must be an integer >= 1, got {value!r}")

    @property
    def most_nodes(self) -> int:
        """The most nodes a dynamic tree of this shape holds: ``top_k`` at depth 1, ``top_k`` squared at each
        further depth (the ``top_k`` expanded nodes' children), at most ``max_nodes``."""
        return min(self.max_nodes, self.top_k + (self.depth - 1) * self.top_k ** 2)


GPU_TREE = TreeConfig(depth=6, top_k=10, max_nodes=60)
"""EAGLE-2's published setting, for GPUs."""
DRAFT_MODEL_TREE = TreeConfig(depth=4, top_k=1, max_nodes=16)
"""A separate draft model's default tree: a chain of four tokens (one drafter forward per token)."""
