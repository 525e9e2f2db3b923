"""The CLI and the Python API: fields, and bad input as one clear line (no traceback soup)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.errors import SelfdraftError
from selfdraft.inference.api import generate

FIELDS = {
    "text", "token_ids", "new_tokens", "target_forwards", "acceptance_length", "accept_histogram",
    "seconds", "tokens_per_second", "depth_acceptance", "draft_seconds", "stop_reason", "drafted_steps", "skipped_steps",
}


def cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "selfdraft", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.embedded
def test_generate_json_has_every_field(embedded_fp32):
    proc = cli(
        "generate", "--target", "smollm2-135m", "--drafter", "prompt-lookup", "--chat",
        "--prompt", "List the numbers from 1 to 20, separated by commas.", "--max-new-tokens", "40", "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert FIELDS <= set(out), FIELDS - set(out)
    assert out["new_tokens"] == len(out["token_ids"]) <= 40
    assert out["acceptance_length"] == pytest.approx(out["new_tokens"] / out["target_forwards"])
    assert sum(int(k) * v for k, v in out["accept_histogram"].items()) == out["new_tokens"]
    # Same tokens as the Python API (greedy is deterministic).
    api = generate(embedded_fp32, "List the numbers from 1 to 20, separated by commas.", chat=True,
                   drafter="prompt-lookup", max_new_tokens=40)
    assert api.token_ids == out["token_ids"] and api.text == out["text"]


@pytest.mark.slow
@pytest.mark.embedded
def test_generate_text_then_summary():
    proc = cli("generate", "--prompt", "def fib(n):", "--max-new-tokens", "8", "--temperature", "0.7", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "acceptance length" in proc.stderr and "tokens/s" in proc.stderr


def test_unknown_target_lists_the_builtins():
    assert_clean_error(cli("generate", "--target", "no-such-model", "--prompt", "hi"), "smollm2-135m", "qwen2.5-coder-0.5b")


@pytest.mark.slow
@pytest.mark.embedded  # `generate` without --target loads the embedded target before it checks --top-p
def test_bad_numbers_are_clear_errors():
    assert_clean_error(cli("generate", "--prompt", "hi", "--max-new-tokens", "0"), "max-new-tokens", ">= 1")
    assert_clean_error(cli("generate", "--prompt", "hi", "--top-p", "1.5"), "top_p")
    assert_clean_error(cli("generate", "--prompt", "hi", "--drafter", "medusa-from-nowhere"), "unknown drafter", "prompt-lookup")
    with pytest.raises(SelfdraftError, match="max_new_tokens"):
        generate(None, input_ids=[1, 2], max_new_tokens=0)


@pytest.mark.slow
@pytest.mark.embedded
def test_mismatched_draft_tokenizer_is_refused(embedded_fp32, tmp_path):
    tok = embedded_fp32.tokenizer.__class__.from_pretrained(embedded_fp32.model.name_or_path)
    tok.add_tokens(["<an-extra-token>"])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc = cli("generate", "--drafter", f"draft-model:{tmp_path}", "--prompt", "hi", "--max-new-tokens", "4")
    assert_clean_error(proc, "tokenizer")
    with pytest.raises(SelfdraftError, match="tokenizer"):
        generate(embedded_fp32, "hi", drafter=f"draft-model:{tmp_path}", max_new_tokens=4)


@pytest.mark.slow
@pytest.mark.embedded
def test_prompt_longer_than_the_context(smollm2_tokenizer, tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)).save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    proc = cli("generate", "--target", str(tmp_path), "--prompt", "word " * 40, "--max-new-tokens", "4")
    assert_clean_error(proc, "context holds 16")


@pytest.mark.slow
@pytest.mark.embedded
def test_export_to_vllm_from_the_cli(embedded_fp32, tmp_path):
    from selfdraft.heads.kinds.medusa.formats import import_vllm_medusa
    from selfdraft.heads.io import DrafterRecord, save_drafter
    from selfdraft.heads.kinds.medusa.module import MedusaHeads

    heads = MedusaHeads(576, 49152, num_heads=2, num_layers=1)
    native = save_drafter(tmp_path / "native", heads, DrafterRecord("medusa", heads.dims, embedded_fp32.identity))
    proc = cli("export", str(native), "--format", "vllm", "--out", str(tmp_path / "vllm"))
    assert proc.returncode == 0, proc.stderr
    back, shared = import_vllm_medusa(tmp_path / "vllm")
    assert torch.equal(shared, embedded_fp32.model.get_output_embeddings().weight)
    hidden = torch.randn(3, 576)
    assert torch.equal(back(hidden, embedded_fp32.model.lm_head), heads(hidden, embedded_fp32.model.lm_head))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA says")
def test_device_cuda_without_cuda_is_a_clear_error_in_every_command(tmp_path):
    for args in (["generate", "--prompt", "hi"], ["bench", "--methods", "prompt-lookup", "--out", str(tmp_path / "b")],
                 ["quickstart", "--out", str(tmp_path / "q")]):
        proc = cli(*args, "--device", "cuda", timeout=120)
        assert_clean_error(proc, "CUDA is not available here")
        assert not (tmp_path / "q" / "run").exists()


def test_the_help_lists_the_kinds_and_formats_the_registry_holds(capsys):
    """`export --help` and `generate --help` list every registered kind (and what each writes) from the
    registry, a kind registered at run time included; `selfdraft --version` imports no kind."""
    import dataclasses

    from selfdraft.cli import main
    from selfdraft.heads.kinds import get_kind, register, registered, unregister

    toy = dataclasses.replace(get_kind("eagle3"), name="toy-kind")
    register(toy)
    try:
        for command in (["export", "--help"], ["generate", "--help"]):
            with pytest.raises(SystemExit):
                main(command)
            out = capsys.readouterr().out
            assert all(name in out for name in registered()) and "toy-kind" in out, out
        with pytest.raises(SystemExit):
            main(["export", "--help"])
        assert "  toy-kind: native, " + ", ".join(w.format for w in toy.writers) in capsys.readouterr().out
    finally:
        unregister("toy-kind")
    code = ("import sys; from selfdraft.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "assert 'selfdraft.heads.kinds' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).returncode == 0
