"""Sampled speculative output has exactly the target's distribution (after temperature / top-k / top-p).

The target is a tiny real Llama (vocabulary 8) with a mix of peaked and flat conditionals. For a
fixed prompt, the exact probability of each of the V^L continuations of L = 4 new tokens is the
product of the target's processed conditionals (``target_probs``). Many independent runs of the
full decoding loop (``speculative_decode``, one seed each) are compared with it by a chi-square
goodness-of-fit test, for a chain drafter, a 6-node tree drafter and a drafter that is right or
wrong in turns. L = 4 because the loop's prefill emits the first token: the first verification then
has 3 tokens left, so a depth-2 tree is verified in full, bonus included (with L = 3 only depth 1
would ever be checked).

Most runs use a table session: a stub TargetSession whose logits for a context are the tiny model's
logits for that exact prefix (a plain full forward, memoised), so tens of thousands of runs take
seconds. One configuration runs the real ``CausalLMSession`` (cache, tree mask, compaction).

The models live on ``SELFDRAFT_TEST_DEVICE`` (the ``test_device`` fixture, default cpu): the sampler
draws with a generator on that device, and the exact law is computed from that device's logits.

The test has teeth: planted biased rules are rejected by the same test with a quarter of the samples:
min(1, p/q) with the draft's softmax over deterministic top-k children (the mistake docs/exactness.md warns
about), and the right walk that forgets to renormalise the residual.
"""

from __future__ import annotations


import itertools
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.configs.decode import DecodeConfig
from selfdraft.inference.decode import speculative_decode
from selfdraft.inference.drafters import Drafter
from selfdraft.inference.policy import FIXED
from selfdraft.inference.session import CausalLMSession, StepOutput
from selfdraft.inference.tree import DraftTree, build_tree_buffers
from selfdraft.inference.verify import sample_verify, target_probs

VOCAB = 8
PROMPT = (1, 5, 3)
OTHER_PROMPT = (2, 7, 1, 4, 6)  # a second prompt, longer, for the batched rows
NEW_TOKENS = 4  # L: continuations are the V^L token tuples
ALPHA = 1e-3  # a correct sampler fails a single configuration this rarely
REJECT = 1e-6  # the planted biased rule must fall below this


# --- the tiny target, its draft model, and memoised prefix logits ------------------------------------

def tiny_llama(seed: int) -> LlamaForCausalLM:
    """Vocabulary 8, hidden 32, 2 layers. A large init (0.2) and a doubled LM head make the
    conditionals differ by context: some nearly one-hot, some close to uniform."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    return model


def perturbed(model: LlamaForCausalLM, seed: int, scale: float) -> LlamaForCausalLM:
    """A different model close to ``model``: every non-norm weight plus ``scale`` x another init."""
    other = tiny_llama(seed).to(next(model.parameters()).device)
    with torch.no_grad():
        for (name, fresh), (_, base) in zip(other.named_parameters(), model.named_parameters()):
            fresh.copy_(base if "norm" in name else base + scale * fresh)
    return other


class PrefixLogits:
    """logits(context) = the model's last-position logits (V,) float32 for exactly that prefix, on the
    model's device, from a plain full forward without a cache, memoised by the token tuple;
    ``host(context)``: the same on the CPU (for the exact law)."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, context) -> torch.Tensor:
        context = tuple(context)
        row = self.memo.get(context)
        if row is None:
            with torch.inference_mode():
                row = self.model(torch.tensor([context], device=self.model.device)).logits[0, -1].float()
            self.memo[context] = row
        return row

    def host(self, context) -> torch.Tensor:
        return self(context).cpu()


class TableSession:
    """A TargetSession whose logits come from a PrefixLogits table (the protocol of session.py).

    verify() returns, at each tree position, the logits given the committed sequence, the root and
    the position's ancestor path; commit() checks that ``keep`` is a root-first path in the tree.
    """

    trees = True

    def __init__(self, logits: PrefixLogits):
        self.logits = logits
        self.committed: tuple[int, ...] = ()
        self.length = 0
        self._contexts: list[tuple[int, ...]] = []
        self._parent: list[int] = []

    def prefill(self, input_ids) -> StepOutput:
        assert not self.committed, "prefill on a used session"
        self.committed = tuple(int(t) for t in input_ids)
        self.length = len(self.committed)
        return StepOutput(logits=self.logits(self.committed)[None])  # (1, V)

    def verify(self, root, tree: DraftTree, buffers) -> StepOutput:
        tokens = list(tree.token_ids)
        parent = list(buffers.parents)
        assert parent[1:] == [p + 1 for p in tree.parents.tolist()], "buffers do not match the tree"
        contexts = [self.committed + (int(root),)]
        for i in range(1, buffers.size):  # parents come first
            contexts.append(contexts[parent[i]] + (tokens[i - 1],))
        self._contexts, self._parent = contexts, parent
        return StepOutput(logits=torch.stack([self.logits(c) for c in contexts]))  # (M, V)

    def commit(self, keep) -> None:
        keep = list(keep)
        assert keep and keep[0] == 0, f"keep must start at the root, got {keep}"
        for a, b in zip(keep, keep[1:]):
            assert self._parent[b] == a, f"keep {keep} is not a path in the tree"
        self.committed = self._contexts[keep[-1]]
        self.length = len(self.committed)


# --- drafters (deterministic given the context) ------------------------------------------------------

class RecordingDrafter(Drafter):
    """Proposals memoised by context; ``last_q`` maps each tree position with children to the
    draft distribution (V,) at that position, for the planted biased rule to read."""

    def __init__(self):
        self.memo: dict[tuple[int, ...], tuple[DraftTree, dict[int, torch.Tensor]]] = {}
        self.last_q: dict[int, torch.Tensor] = {}

    def propose(self, state, sequence):
        key = tuple(sequence)
        if key not in self.memo:
            self.memo[key] = self.build(key)
        tree, self.last_q = self.memo[key]
        return tree, state

    def build(self, sequence: tuple[int, ...]) -> tuple[DraftTree, dict[int, torch.Tensor]]:
        raise NotImplementedError


class GreedyChainDrafter(RecordingDrafter):
    """The draft model's greedy chain of ``depth`` tokens."""

    def __init__(self, draft: PrefixLogits, depth: int = 3):
        super().__init__()
        self.draft, self.depth = draft, depth

    def build(self, sequence):
        chain, qs = [], {}
        for d in range(self.depth):
            q = self.draft(sequence + tuple(chain)).double().softmax(-1)
            qs[d] = q  # position d is the root (d = 0) or chain node d - 1
            chain.append(int(q.argmax()))
        return DraftTree.chain(chain), qs


class TopTwoTreeDrafter(RecordingDrafter):
    """The draft model's top-2 tokens below the root and its top-2 below each: 6 nodes, 2 levels."""

    def __init__(self, draft: PrefixLogits):
        super().__init__()
        self.draft = draft

    def build(self, sequence):
        q0 = self.draft(sequence).double().softmax(-1)
        first = torch.topk(q0, 2).indices.tolist()
        tokens, parents, qs = list(first), [-1, -1], {0: q0}
        for j, tok in enumerate(first):
            q = self.draft(sequence + (tok,)).double().softmax(-1)
            qs[j + 1] = q
            tokens += torch.topk(q, 2).indices.tolist()
            parents += [j, j]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents)), qs


class RightOrWrongDrafter(RecordingDrafter):
    """The target's own argmax chain (3 tokens) for two contexts in three, the target's least
    likely tokens (outside any top-k) otherwise; which one depends on the context only."""

    def __init__(self, target: PrefixLogits):
        super().__init__()
        self.target = target

    def build(self, sequence):
        right = sum(sequence) % 3 != 0
        chain = []
        for _ in range(3):
            logits = self.target(sequence + tuple(chain))
            chain.append(int(logits.argmax() if right else logits.argmin()))
        return DraftTree.chain(chain), {}


# --- the planted biased rule -------------------------------------------------------------------------

def make_wrong_rule(drafter: RecordingDrafter):
    """min(1, p/q) per child, q = the draft softmax renormalised over the node's (deterministic)
    children; when every child is rejected, sample from normalised max(0, p - q). Biased here."""

    def wrong_rule(probs, tokens, buffers, generator):
        token_at = list(tokens)
        accepted, node = [], 0
        while True:
            kids = buffers.children[node]
            p = probs[node]
            q = torch.zeros_like(p)
            if kids:
                kid_tokens = [token_at[c - 1] for c in kids]
                restricted = drafter.last_q[node][kid_tokens]
                q[kid_tokens] = restricted / restricted.sum()
            chosen = -1
            for child in kids:
                tok = token_at[child - 1]
                ratio = min(1.0, float(p[tok]) / float(q[tok]))
                if float(torch.rand((), dtype=torch.float64, device=p.device, generator=generator)) < ratio:
                    chosen = child
                    break
            if chosen < 0:
                residual = (p - q).clamp(min=0.0)
                if float(residual.sum()) <= 0.0:
                    residual = p
                return accepted, int(torch.multinomial(residual, 1, generator=generator))
            accepted.append(chosen)
            node = chosen

    return wrong_rule


# --- exact distribution, sampling, the test statistic ------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __str__(self):
        return f"T={self.temperature} top_k={self.top_k} top_p={self.top_p}"


@dataclass
class Samples:
    counts: np.ndarray  # (V^L,) int64, continuations by np.ravel_multi_index
    drafted: Counter  # depth d -> runs x steps whose tree reached depth d
    accepted: Counter  # depth d -> runs x steps that accepted a draft token at depth d
    skipped: int = 0  # runs x steps the adaptive policy decoded plain


def sample_counts(make_session, drafter, sampling: Sampling, n: int, *, rule=sample_verify, seed0=0,
                  policy=FIXED) -> Samples:
    """The continuations of ``n`` independent runs of the decoding loop (seeds seed0 .. seed0 + n - 1)
    under the drafting ``policy`` (what it learns forgotten before each run: each run is a first request)."""
    samples = Samples(np.zeros(VOCAB**NEW_TOKENS, dtype=np.int64), Counter(), Counter())
    for i in range(n):
        config = DecodeConfig(max_new_tokens=NEW_TOKENS, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, seed=seed0 + i, stop_on_eos=False)
        if hasattr(policy, "learnt"):
            policy.learnt = type(policy.learnt)()
        out = speculative_decode(make_session(), PROMPT, drafter, config, sample_rule=rule, policy=policy)
        assert len(out.token_ids) == NEW_TOKENS, out
        samples.counts[np.ravel_multi_index(tuple(out.token_ids), (VOCAB,) * NEW_TOKENS)] += 1
        samples.drafted.update(out.stats.depth_drafted)
        samples.accepted.update(out.stats.depth_accepted)
        samples.skipped += out.stats.skipped_steps
    return samples


# --- fixtures ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Everything here is tiny: one thread avoids OpenMP hand-offs that dominate on busy CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_model(test_device):
    return tiny_llama(0).to(test_device)


@pytest.fixture(scope="module")
def target(target_model):
    return PrefixLogits(target_model)


@pytest.fixture(scope="module")
def draft(target_model):
    return PrefixLogits(perturbed(target_model, seed=1, scale=0.1))


@pytest.fixture(scope="module")
def drafters(target, draft):
    return {"chain": GreedyChainDrafter(draft), "tree": TopTwoTreeDrafter(draft), "right-or-wrong": RightOrWrongDrafter(target)}


# --- the tests ---------------------------------------------------------------------------------------

def test_tiny_target_has_peaked_and_flat_conditionals(target, draft):
    """The test only has teeth if the target is far from uniform in some contexts and not in others,
    and the draft model is close to it but not equal."""
    contexts = [PROMPT + c for n in range(NEW_TOKENS) for c in itertools.product(range(VOCAB), repeat=n)]
    p = torch.stack([target(c) for c in contexts]).double().softmax(-1)  # (C, V)
    q = torch.stack([draft(c) for c in contexts]).double().softmax(-1)
    top = p.max(-1).values
    assert float(top.max()) > 0.9 and float(top.min()) < 0.3, f"max p ranges {float(top.min()):.2f}..{float(top.max()):.2f}"
    assert 0.3 < float((top > 0.6).double().mean()) < 0.8
    tv = 0.5 * (p - q).abs().sum(-1)
    agree = float((p.argmax(-1) == q.argmax(-1)).double().mean())
    assert 0.05 < float(tv.median()) < 0.5 and 0.5 < agree < 0.95, (float(tv.median()), agree)


def test_target_probs_matches_transformers_warpers(target):
    """The exact distribution uses target_probs; it is transformers' temperature/top-k/top-p."""
    from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    logits = torch.stack([target(PROMPT + c) for c in itertools.product(range(VOCAB), repeat=2)])  # (64, V)
    for s in [Sampling(1.0), Sampling(0.7, top_k=4), Sampling(1.0, top_p=0.8), Sampling(0.7, top_k=4, top_p=0.8)]:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(s.temperature)])
        if s.top_k:
            warpers.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            warpers.append(TopPLogitsWarper(s.top_p))
        expected = warpers(None, logits.double()).softmax(-1)
        ours = target_probs(logits, s.temperature, s.top_k, s.top_p)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12, msg=str(s))


def _check(law, label: str, samples: Samples, probs: np.ndarray, elapsed: float) -> tuple[float, float]:
    pvalue, tv = law.goodness_of_fit(samples.counts, probs)[:2]
    n = int(samples.counts.sum())
    depths = " ".join(f"d{d}:{samples.accepted[d]}/{samples.drafted[d]}" for d in sorted(samples.drafted))
    print(f"\n[{label}] n={n} chi2 p={pvalue:.3g} TV={tv:.4f} accepted/drafted {depths} ({elapsed:.1f} s)")
    return pvalue, tv


def _assert_exercised(samples: Samples, label: str, share: float = 0.05) -> None:
    """The runs must accept depth-2 nodes and reject depth-1 ones often (in ``share`` of the runs), or the
    test proves little."""
    n = int(samples.counts.sum())
    assert samples.accepted[2] > share * n, f"{label}: depth 2 accepted only {samples.accepted[2]} times in {n} runs"
    rejected = samples.drafted[1] - samples.accepted[1]
    assert rejected > share * n, f"{label}: depth 1 rejected only {rejected} times in {n} runs"


STUB_CASES = [
    ("chain", Sampling(1.0)),
    ("chain", Sampling(0.7, top_k=4)),
    ("chain", Sampling(0.7, top_p=0.8)),
    ("tree", Sampling(1.0)),
    ("tree", Sampling(0.7)),
    ("tree", Sampling(1.0, top_k=4)),
    ("tree", Sampling(1.0, top_p=0.8)),
    ("right-or-wrong", Sampling(1.0, top_k=4, top_p=0.8)),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,sampling", STUB_CASES, ids=[f"{k}-{s}".replace(" ", ",") for k, s in STUB_CASES])
def test_speculative_sampling_has_target_distribution(target, drafters, kind, sampling, law):
    """Every drafter and warper combination at twice the size (BIASED_N) at which both planted biased
    rules are rejected (test_biased_rule_is_detected)."""
    n = 2 * BIASED_N
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    samples = sample_counts(lambda: TableSession(target), drafters[kind], sampling, n)
    pvalue, tv = _check(law, f"{kind} {sampling}", samples, probs, time.perf_counter() - start)
    assert pvalue > ALPHA, f"{kind} drafter, {sampling}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={n})"
    _assert_exercised(samples, f"{kind} {sampling}")


def forgets_to_renormalise(probs, tokens, buffers, generator):
    """A subtler planted bug: the right walk, but the k-th child is accepted with probability r(c)
    instead of r(c) / sum(r) after earlier siblings were rejected."""
    token_at = list(tokens)
    accepted, node = [], 0
    while True:
        residual, chosen = probs[node].clone(), -1
        for child in buffers.children[node]:
            tok = token_at[child - 1]
            if float(torch.rand((), dtype=torch.float64, device=probs.device, generator=generator)) < float(residual[tok]):
                chosen = child
                break
            residual[tok] = 0.0
        if chosen < 0:
            return accepted, int(torch.multinomial(residual, 1, generator=generator))
        accepted.append(chosen)
        node = chosen


# The fast tier (`pytest -m "not slow"`): the same test at BIASED_N runs, the size at which
# test_biased_rule_is_detected shows that both planted biased rules fail it.
BIASED_N = 5_000
FAST_CASES = [("chain", Sampling(1.0)), ("tree", Sampling(1.0, top_p=0.8)), ("right-or-wrong", Sampling(0.7, top_k=4))]


@pytest.mark.parametrize("kind,sampling", FAST_CASES, ids=[f"{k}-{s}".replace(" ", ",") for k, s in FAST_CASES])
def test_speculative_sampling_has_target_distribution_at_the_size_that_rejects_biased_rules(
        target, drafters, kind, sampling, law):
    n = BIASED_N
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    samples = sample_counts(lambda: TableSession(target), drafters[kind], sampling, n, seed0=2 * 10**6)
    pvalue, tv = _check(law, f"{kind} {sampling}", samples, probs, time.perf_counter() - start)
    assert pvalue > ALPHA, f"{kind} drafter, {sampling}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={n})"
    _assert_exercised(samples, f"{kind} {sampling}")


def test_adaptive_throttle_keeps_the_target_distribution(target, drafters, law):
    """With the adaptive policy, whether a step drafts depends on what earlier steps accepted (random
    under sampling). Each step is still decided before the target sees it, so the law is the target's:
    here a step drafts after a step that accepted a draft token and decodes plain after one that did
    not (memory 0, a one-step wait), so half the runs or so take a plain second step."""
    from selfdraft.inference.costs import CostSurface
    from selfdraft.inference.policy import Adaptive

    sampling, n = Sampling(1.0), BIASED_N
    # T(1) = 1, T(4) = 1.4, drafting 0.1: a drafted step pays when it emits more than 1.5 tokens.
    cost = CostSurface.row(tuple(1.0 + 0.4 * (m - 1) / 3 for m in range(1, 5)), target="t", dtype="float32", device="cpu", context=8)
    throttle = Adaptive(cost, 0.1, cut=False, memory=0.0, slack=0.0, min_drafted=1, first_wait=1, longest_wait=1)
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    samples = sample_counts(lambda: TableSession(target), drafters["chain"], sampling, n, seed0=3 * 10**6, policy=throttle)
    pvalue, tv = _check(law, f"throttled chain {sampling}", samples, probs, time.perf_counter() - start)
    assert pvalue > ALPHA, f"throttled chain, {sampling}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={n})"
    _assert_exercised(samples, f"throttled chain {sampling}")
    assert 0.1 * n < samples.skipped < 0.9 * n, f"{samples.skipped} plain steps in {n} runs: the test proves little"


def test_hybrid_drafting_keeps_the_target_distribution(target, drafters, law):
    """The hybrid merges copying and the draft chain into one tree, the policy cuts it by a cost curve, and
    the draft model rests on steps where copying looks sure; its calibration and that choice follow what earlier
    steps accepted (random under sampling). Each tree is still fixed before the target sees the step,
    so the law is the target's."""
    from selfdraft.configs.decode import CopyConfig
    from selfdraft.inference.costs import CostSurface
    from selfdraft.inference.hybrid import CopyDrafter, HybridDrafter
    from selfdraft.inference.policy import Adaptive

    class Counting(HybridDrafter):
        merged = skipped = 0

        def propose(self, state, sequence):
            tree, state = super().propose(state, sequence)
            sources = {i for src in state.sources for i, v in enumerate(src) if v is not None}
            Counting.merged += sources == {0, 1}
            Counting.skipped += not state.model_ran
            return tree, state

    sampling, n = Sampling(1.0), BIASED_N
    cost = CostSurface.row(tuple(1.0 + 0.05 * m for m in range(8)), target="t", dtype="float32", device="cpu", context=8)
    hybrid = Counting(drafters["chain"], CopyDrafter(CopyConfig(depth=3)), cost=cost, model_seconds=0.5)
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    samples = sample_counts(lambda: TableSession(target), hybrid, sampling, n, seed0=4 * 10**6,
                            policy=Adaptive(cost, 0.0, gate=False))
    pvalue, tv = _check(law, f"hybrid {sampling}", samples, probs, time.perf_counter() - start)
    print(f"steps with both sources {Counting.merged}, steps without the draft model {Counting.skipped}")
    assert pvalue > ALPHA, f"hybrid, {sampling}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={n})"
    _assert_exercised(samples, f"hybrid {sampling}")
    assert Counting.merged > 0.05 * n and Counting.skipped > 0.05 * n, "the hybrid's merge and skip were not exercised"


@pytest.mark.parametrize("bug", ["min(1,p/q)", "no-renormalisation"])
def test_biased_rule_is_detected(target, drafters, bug, law):
    """The same test rejects biased rules, with a quarter of the samples the correct rule gets:
    min(1, p/q) over deterministic top-2 children (docs/exactness.md's warning), and a walk that forgets
    to renormalise the residual."""
    sampling, n = Sampling(1.0), BIASED_N
    drafter = drafters["tree"]
    rule = make_wrong_rule(drafter) if bug == "min(1,p/q)" else forgets_to_renormalise
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    samples = sample_counts(lambda: TableSession(target), drafter, sampling, n, rule=rule)
    pvalue, tv = _check(law, f"BIASED {bug} tree {sampling}", samples, probs, time.perf_counter() - start)
    assert pvalue < REJECT, f"the biased rule {bug} passed: chi-square p-value {pvalue:.3g} >= {REJECT} (TV {tv:.4f}, n={n})"


@pytest.mark.slow
def test_real_session_has_target_distribution(target_model, target, drafters, law):
    """The same check through CausalLMSession: KV cache, 4D tree mask, compaction after each step."""
    sampling, n = Sampling(1.0), 4_000
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    samples = sample_counts(lambda: CausalLMSession(target_model), drafters["tree"], sampling, n, seed0=10**6)
    pvalue, tv = _check(law, f"CausalLMSession tree {sampling}", samples, probs, time.perf_counter() - start)
    assert pvalue > ALPHA, f"CausalLMSession, {sampling}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={n})"
    _assert_exercised(samples, "CausalLMSession tree")


@pytest.mark.slow
def test_each_row_of_a_batch_has_its_prompts_distribution(target_model, target, drafters, law):
    """Batched decoding (inference/batch.py): rows of two prompts of different lengths (so one is padded),
    each with its own seed, in batches of 4 through one BatchSession per batch; every row's
    continuations follow its own prompt's law (chi-square per row and per prompt)."""
    from selfdraft.inference.batch import BatchSession
    from selfdraft.inference.decode import batched_decode

    sampling, batches = Sampling(1.0), 1_000
    prompts = [PROMPT, OTHER_PROMPT, PROMPT, OTHER_PROMPT]
    laws = {p: law.exact_logits(target.host, VOCAB, p, NEW_TOKENS, sampling) for p in (PROMPT, OTHER_PROMPT)}
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, temperature=sampling.temperature, stop_on_eos=False)
    rows = [Samples(np.zeros(VOCAB**NEW_TOKENS, dtype=np.int64), Counter(), Counter()) for _ in prompts]
    start = time.perf_counter()
    for b in range(batches):
        outs = batched_decode(BatchSession(target_model), prompts, drafters["tree"], config,
                              seeds=[3 * 10**6 + 4 * b + i for i in range(len(prompts))])
        for samples, out in zip(rows, outs):
            assert len(out.token_ids) == NEW_TOKENS, out
            samples.counts[np.ravel_multi_index(tuple(out.token_ids), (VOCAB,) * NEW_TOKENS)] += 1
            samples.drafted.update(out.stats.depth_drafted)
            samples.accepted.update(out.stats.depth_accepted)
    elapsed = time.perf_counter() - start
    for i, (prompt, samples) in enumerate(zip(prompts, rows)):
        pvalue, tv = _check(law, f"batch row {i} {sampling}", samples, laws[prompt], elapsed)
        assert pvalue > ALPHA, f"row {i}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={batches})"
        _assert_exercised(samples, f"batch row {i}")
    for prompt in (PROMPT, OTHER_PROMPT):
        pooled = Samples(sum(s.counts for p, s in zip(prompts, rows) if p == prompt), Counter(), Counter())
        pvalue, tv = _check(law, f"batch rows of {prompt} {sampling}", pooled, laws[prompt], elapsed)
        assert pvalue > ALPHA, f"prompt {prompt}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f})"


def test_sample_verify_on_hand_made_tree(law, test_device):
    """Exact law of (accepted path, bonus) on a 2-level tree with a zero-mass child and a duplicate
    sibling: the walk emits token after token as the rows of p prescribe (first token ~ p[0])."""
    v = 6
    # node: 0:2 1:4 2:5 3:2(dup) | 4:1 5:3 below node 0 | 6:0 below node 1
    tree = DraftTree(torch.tensor([2, 4, 5, 2, 1, 3, 0]), torch.tensor([-1, -1, -1, -1, 0, 0, 1]))
    buffers = build_tree_buffers(tree)
    rng = np.random.default_rng(3)
    probs = torch.tensor(rng.dirichlet(np.full(v, 0.7), size=buffers.size))  # (M, V) float64
    probs[0, 5] = 0.0  # node 2 can never be accepted
    probs[0] /= probs[0].sum()
    host_probs, probs = probs, probs.to(test_device)

    exact: dict[tuple[tuple[int, ...], int], float] = {}

    def walk(pos, path, mass):
        seen = set()
        for child in buffers.children[pos]:
            tok = int(tree.tokens[child - 1])
            if tok in seen:
                continue  # a duplicate sibling is never accepted
            seen.add(tok)
            walk(child, path + (child,), mass * float(host_probs[pos, tok]))
        for bonus in range(v):
            if bonus not in seen:
                exact[(path, bonus)] = mass * float(host_probs[pos, bonus])

    walk(0, (), 1.0)
    assert abs(sum(exact.values()) - 1.0) < 1e-12
    outcomes = list(exact)
    index = {o: i for i, o in enumerate(outcomes)}
    expected = np.array([exact[o] for o in outcomes])

    n = 100_000
    generator = torch.Generator(device=test_device).manual_seed(0)
    counts = np.zeros(len(outcomes), dtype=np.int64)
    first = np.zeros(v, dtype=np.int64)
    for _ in range(n):
        accepted, bonus = sample_verify(probs, tree.tokens, buffers, generator)
        key = (tuple(accepted), bonus)
        assert key in index, f"impossible outcome {key}"
        counts[index[key]] += 1
        first[int(tree.tokens[accepted[0] - 1]) if accepted else bonus] += 1

    pvalue, tv, _ = law.goodness_of_fit(counts, expected)
    print(f"\n[sample_verify hand-made tree] n={n} (path, bonus) chi2 p={pvalue:.3g} TV={tv:.4f}", end="")
    assert pvalue > ALPHA, f"(path, bonus) law: chi-square p-value {pvalue:.3g} (TV {tv:.4f})"
    pvalue, tv, _ = law.goodness_of_fit(first, host_probs[0].numpy())
    print(f"; first token chi2 p={pvalue:.3g} TV={tv:.4f}")
    assert pvalue > ALPHA, f"first token vs p[0]: chi-square p-value {pvalue:.3g} (TV {tv:.4f})"


@pytest.mark.slow
@pytest.mark.parametrize("kind,top_k", [("dflash", 1), ("dspark", 1), ("dspark", 2)])
def test_block_drafter_session_has_target_distribution(kind, top_k, target_model, target, law):
    """A DFlash / DSpark drafter proposing a block of 3 from one forward, through CausalLMSession: its
    drafts are a deterministic chain given the state, and the sampled continuations keep the target's
    law (the rule is the one every drafter's chain goes through, which the biased-rule tests above
    show this harness rejects when wrong). DSpark's blocks are cut by a confidence schedule (its
    confidence head's values against a verify cost that grows with the draft): which prefix is
    verified depends on the drafter's state only, so the law is kept. With ``top_k`` 2 the block
    branches (a tree of 6 nodes from the same forward, each node's children biased by its own token
    through DSpark's Markov head), cut by the schedule to trees that still branch, verified by the tree
    rule (DFlash's trees are the same with one distribution per depth; its greedy trees are checked in
    tests/test_block_drafters.py)."""
    from selfdraft.configs.decode import TreeConfig
    from selfdraft.configs.run import load_run_config
    from selfdraft.heads.kinds.block.decode import BlockDrafter
    from selfdraft.train.objectives import build_objective

    # Trained a little on the target's own samples, so that it drafts what the target often says: the
    # verifier then both accepts and rejects at every depth.
    torch.manual_seed(11)
    prompts = torch.tensor([PROMPT] * 64, device=target_model.device)
    ids = target_model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=8,
                                pad_token_id=0)
    ids[ids == VOCAB - 1] = 0  # the mask token never occurs in the data
    mask = torch.zeros_like(ids)
    mask[:, len(PROMPT):] = 1
    config = load_run_config("smoke_cpu", [
        f"drafter.kind={kind}", f"drafter.block.block_size={4 if kind == 'dflash' else 3}",
        f"drafter.block.draft_vocab_size={VOCAB}", f"drafter.block.mask_token_id={VOCAB - 1}",
        "drafter.block.target_layers=[1]", "drafter.block.markov_rank=4", "drafter.block.anchors=8"])
    data = [(i.cpu().numpy(), m.cpu().numpy()) for i, m in zip(ids, mask)]
    objective = build_objective(config, target_model, data).to(target_model.device)  # as the training loop places it
    optimizer = torch.optim.Adam([q for q in objective.parameters() if q.requires_grad], lr=1e-2)
    for _ in range(60):
        loss, _ = objective(ids, torch.ones_like(ids), mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    module = objective.drafter_module().eval()
    drafter = BlockDrafter(module, target_model, TreeConfig(depth=3, top_k=top_k, max_nodes=3 * top_k))
    sampling, n = Sampling(1.0), 4_000
    probs = law.exact_logits(target.host, VOCAB, PROMPT, NEW_TOKENS, sampling)
    start = time.perf_counter()
    schedule = FIXED
    if kind == "dspark":
        from selfdraft.inference.costs import CostSurface
        from selfdraft.inference.policy import Adaptive

        class Counting(Adaptive):  # the value cut alone, counting what it verifies
            kept = Counter()
            branching = Counter()  # verified trees by whether they branch

            def run(self, rows):
                run = super().run(rows)
                verify = run.verify

                def counting(trees, seconds):
                    cut = verify(trees, seconds)
                    for tree, out in zip(trees, cut):
                        self.kept[(tree.num_nodes, out.num_nodes)] += 1
                        self.branching[len(set(out.parent_ids)) < out.num_nodes] += 1
                    return cut

                run.verify = counting
                return run

        per_token = 0.008 if top_k == 1 else 0.0005  # a tree's branches are verified where tokens cost little
        schedule = Counting(CostSurface.row(tuple(0.01 + per_token * m for m in range(1, 3 * top_k + 3)), target="t",
                                            dtype="float32", device="cpu", context=8), 0.0, gate=False)
    branched = Counter()  # proposals by whether they branch
    propose = drafter.propose

    def counting_propose(state, sequence):
        tree, state = propose(state, sequence)
        branched[len(set(tree.parent_ids)) < tree.num_nodes] += 1
        return tree, state

    drafter.propose = counting_propose
    samples = sample_counts(lambda: CausalLMSession(target_model, hidden_layers=drafter.hidden_layers), drafter, sampling, n,
                            seed0=2 * 10**6, policy=schedule)
    pvalue, tv = _check(law, f"CausalLMSession {kind} top_k={top_k} {sampling}", samples, probs, time.perf_counter() - start)
    assert pvalue > ALPHA, f"{kind}, {sampling}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f}, n={n})"
    assert samples.accepted[1] > 0.05 * n and samples.drafted[1] - samples.accepted[1] > 0.05 * n, \
        f"{kind}: depth 1 accepted {samples.accepted[1]} of {samples.drafted[1]} drafts in {n} runs: the test proves little"
    wanted = branched[True] > 0.5 * branched.total() if top_k > 1 else not branched[True]
    assert wanted, f"{kind}, top_k={top_k}: proposals by whether they branch {dict(branched)}"
    if schedule is not FIXED:
        steps = sum(schedule.kept.values())
        cut = sum(count for (before, after), count in schedule.kept.items() if after < before)
        lengths = {after for (_, after) in schedule.kept}
        print(f"   schedule: (proposed, verified) -> steps {dict(schedule.kept)}")
        assert 0.1 * steps < cut < 0.9 * steps and len(lengths) >= 2, \
            f"the schedule cut {cut} of {steps} blocks, to lengths {sorted(lengths)}: the test proves little about cut blocks"
        if top_k > 1:
            assert schedule.branching[True] > 0.1 * steps, f"verified trees by whether they branch: {dict(schedule.branching)}"


# --- other layer kinds: a sliding window shorter than the text, and recurrent layers -----------------

def tiny_family(family: str, seed: int, perturb: tuple[int, float] | None = None):
    """A tiny target of vocabulary 8 with other layer kinds than Llama's (heads/target_layers.py):
    ``mistral-window-3``, Mistral whose sliding window (3) is shorter than prompt + answer (7), and
    ``qwen3_next``, gated linear attention (a recurrent state) beside a full-attention layer. Built as
    ``tiny_llama`` is (large init, doubled LM head); ``perturb=(seed, scale)`` adds scale x another
    init to every non-norm weight, for a draft model close to it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    kinds = {
        "mistral-window-3": ("mistral", dict(sliding_window=3)),
        "qwen3_next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"], num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                          linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                          linear_value_head_dim=8)),
    }
    model_type, extra = kinds[family]
    config = AutoConfig.for_model(model_type, **common, **extra)

    def build(s):
        torch.manual_seed(s)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)
        return model

    model = build(seed)
    if perturb is not None:
        other = build(perturb[0])
        with torch.no_grad():
            for (name, fresh), (_, base) in zip(other.named_parameters(), model.named_parameters()):
                fresh.copy_(base if "norm" in name else base + perturb[1] * fresh)
        model = other
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral-window-3", "qwen3_next"])
def test_other_layer_kinds_keep_the_target_distribution(family, law, test_device):
    """The real sessions on a window shorter than the text (the tree's mask applies it) and on a recurrent
    target (chains only, states rolled back through transformers' recorded history): batch 1, and rows of
    two prompts of different lengths in one BatchSession (left padding before a recurrent state; each row
    rolled back by its own count). The law is the model's own full forward, windows and states included."""
    from selfdraft.inference.batch import BatchSession
    from selfdraft.inference.decode import batched_decode

    model = tiny_family(family, 0).to(test_device)
    target = PrefixLogits(model)
    drafter = TopTwoTreeDrafter(PrefixLogits(tiny_family(family, 0, perturb=(1, 0.1)).to(test_device)))
    sampling = Sampling(1.0)
    laws = {p: law.exact_logits(target.host, VOCAB, p, NEW_TOKENS, sampling) for p in (PROMPT, OTHER_PROMPT)}
    start = time.perf_counter()
    samples = sample_counts(lambda: CausalLMSession(model), drafter, sampling, 3_000, seed0=5 * 10**6)
    pvalue, tv = _check(law, f"{family} CausalLMSession {sampling}", samples, laws[PROMPT], time.perf_counter() - start)
    assert pvalue > ALPHA, f"{family}, batch 1: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f})"
    _assert_exercised(samples, f"{family} batch 1", share=0.03)  # a recurrent target verifies the tree's first path

    prompts, batches = [PROMPT, OTHER_PROMPT], 1_500
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, temperature=sampling.temperature, stop_on_eos=False)
    rows = [Samples(np.zeros(VOCAB**NEW_TOKENS, dtype=np.int64), Counter(), Counter()) for _ in prompts]
    start = time.perf_counter()
    for b in range(batches):
        outs = batched_decode(BatchSession(model), prompts, drafter, config, seeds=[6 * 10**6 + 2 * b + i for i in range(2)])
        for samples, out in zip(rows, outs):
            samples.counts[np.ravel_multi_index(tuple(out.token_ids), (VOCAB,) * NEW_TOKENS)] += 1
            samples.drafted.update(out.stats.depth_drafted)
            samples.accepted.update(out.stats.depth_accepted)
    for prompt, samples in zip(prompts, rows):
        pvalue, tv = _check(law, f"{family} batch rows of {prompt}", samples, laws[prompt], time.perf_counter() - start)
        assert pvalue > ALPHA, f"{family}, batched rows of {prompt}: chi-square p-value {pvalue:.3g} <= {ALPHA} (TV {tv:.4f})"
        _assert_exercised(samples, f"{family} batch rows of {prompt}", share=0.03)
