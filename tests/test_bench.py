"""``selfdraft bench``: every field for every row, exactness flagged loudly, clear errors, the CLI path.

Tiny random Llamas with the embedded target's tokenizer, 8 new tokens, 1-2 prompts per task.
"""

import dataclasses
import json
import re

import pytest
import torch

from selfdraft.errors import SelfdraftError
from selfdraft.inference import bench

ROW_FIELDS = {
    "task", "method", "temperature", "prompts", "new_tokens", "seconds", "tokens_per_second", "speedup",
    "acceptance_length", "engine_acceptance_length", "acceptance_histogram", "per_depth_acceptance",
    "target_forwards_per_token", "drafted_share", "drafting_time_share", "exact", "mismatches",
}
META_FIELDS = {"target", "dtype", "threads", "torch", "transformers", "machine", "date", "command"}


def _tiny_llama(tokenizer, folder, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_draft(smollm2_tokenizer, tmp_path_factory):
    """Another random Llama of the same shape and tokenizer: a draft model / assistant."""
    return _tiny_llama(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-draft"), seed=1)


def _medusa_folder(folder, identity, hidden, vocab):
    from selfdraft.heads.io import DrafterRecord, save_drafter
    from selfdraft.heads.kinds.medusa.module import MedusaHeads

    torch.manual_seed(2)
    heads = MedusaHeads(hidden, vocab, num_heads=2, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    decode = {"choices": [[0], [1], [0, 0]], "rank_accuracy": [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05]]}
    return save_drafter(folder, heads, DrafterRecord("medusa", heads.dims, identity, decode=decode))


@pytest.fixture(scope="module")
def tiny_medusa(tiny_target, tmp_path_factory):
    """Random Medusa heads exported for the tiny target."""
    from selfdraft.heads.target import load_target

    identity = load_target(str(tiny_target)).identity
    return _medusa_folder(tmp_path_factory.mktemp("medusa") / "drafter", identity, 32, identity.vocab_size)


def _flip_method() -> bench.Method:
    """A planted inexact method: our loop without a drafter, with its first token changed."""

    def build(target, argument, options):
        inner = bench.LoopRunner(target, bench._no_drafter())

        def run(ids, temperature, seed, max_new_tokens):
            g = inner(ids, temperature, seed, max_new_tokens)
            return dataclasses.replace(g, token_ids=[(g.token_ids[0] + 1) % 49152] + g.token_ids[1:])

        return run

    return bench.Method("flip", build, "changes the first token")


def test_bench_writes_every_field_and_flags_an_inexact_method(tiny_target, tiny_draft, tiny_medusa, tmp_path,
                                                              monkeypatch, capsys):
    monkeypatch.setitem(bench.METHODS, "flip", _flip_method())
    methods = ["hf-greedy", "prompt-lookup@tokens=4,max_nodes=8", f"draft-model:{tiny_draft}@depth=3,top_k=2",
               f"{tiny_medusa}@max_nodes=3,policy=fixed", "flip", "hf-prompt-lookup@tokens=3"]  # fixed: drafts every step
    out = tmp_path / "out"
    results = bench.run_bench(str(tiny_target), methods, "mt_bench,humaneval", [0], max_new_tokens=8, limit=2, out=out,
                              progress=False, command="test")
    err = capsys.readouterr().err

    assert META_FIELDS <= set(results["meta"]) and results["meta"]["dtype"] == "float32"
    assert results["meta"]["command"] == "test" and results["meta"]["machine"]["platform"]
    # mt_bench with a limit takes the categories in turn: writing first, then roleplay.
    assert results["prompts"] == {"mt_bench": ["mt_bench/81", "mt_bench/91"], "humaneval": ["HumanEval/0", "HumanEval/1"]}
    rows = results["rows"]
    assert [(r["task"], r["method"]) for r in rows] == [(t, m) for t in ("mt_bench", "humaneval") for m in ["none", *methods]]
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert r["prompts"] == 2 and 2 <= r["new_tokens"] <= 16 and r["seconds"] > 0 and r["temperature"] == 0
        assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["seconds"])
        assert r["acceptance_length"] == pytest.approx(1 / r["target_forwards_per_token"])
        # The engines' definition: tokens after the prefill's one, per verification step after the prefill.
        steps = r["target_forwards"] - r["prompts"]
        assert r["engine_acceptance_length"] == (pytest.approx((r["new_tokens"] - r["prompts"]) / steps) if steps else None)
        hist = r["acceptance_histogram"]
        if r["method"] != methods[-1]:  # transformers' prompt lookup does not say what each forward emitted
            assert sum(int(k) * v for k, v in hist.items()) == r["new_tokens"] and sum(hist.values()) == r["target_forwards"]
        base = next(b for b in rows if b["task"] == r["task"] and b["method"] == "none")
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / base["tokens_per_second"])
        if r["method"] == "flip":
            assert r["exact"] is False
            assert r["mismatches"] == [{"prompt_id": p, "first_divergence": 0} for p in results["prompts"][r["task"]]]
        else:
            assert r["exact"] is True and r["mismatches"] == [], r
    by = {(r["task"], r["method"]): r for r in rows}
    none = by["mt_bench", "none"]
    assert none["baseline"] and none["speedup"] == 1.0 and none["acceptance_length"] == 1.0
    assert none["per_depth_acceptance"] == {} and 0 <= none["drafting_time_share"] < 1
    assert by["mt_bench", methods[-1]]["drafting_time_share"] is None
    hf = by["mt_bench", "hf-greedy"]
    assert hf["acceptance_length"] == 1.0 and hf["per_depth_acceptance"] is None and hf["drafting_time_share"] == 0.0
    drafted = by["mt_bench", methods[2]]
    assert set(drafted["per_depth_acceptance"]) <= {"1", "2", "3"} and drafted["drafting_time_share"] > 0
    assert all(0 <= a <= 1 for a in drafted["per_depth_acceptance"].values())
    assert by["humaneval", methods[3]]["per_depth_acceptance"]  # the Medusa folder decoded with its rebuilt tree

    # MT-bench rows again per category (HumanEval has none); the same fields, adding up to the task's row.
    cats = results["category_rows"]
    assert {(r["task"], r["category"]) for r in cats} == {("mt_bench", "writing"), ("mt_bench", "roleplay")}
    for r in cats:
        assert ROW_FIELDS <= set(r) and r["prompts"] == 1
        base = next(b for b in cats if b["category"] == r["category"] and b["method"] == "none")
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / base["tokens_per_second"])
        assert r["exact"] is (r["method"] != "flip")
    for m in ["none", *methods]:
        assert sum(r["new_tokens"] for r in cats if r["method"] == m) == by["mt_bench", m]["new_tokens"]

    warnings = re.findall(r"^selfdraft: warning: (\S+) is not token-identical to none on task (\S+) at temperature 0: 2 of 2 "
                          r"prompts differ", err, flags=re.M)
    assert warnings == [("flip", "mt_bench"), ("flip", "humaneval")], err
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    report = (out / "report.md").read_text()
    assert "**WARNING: `flip` is not token-identical to `none`" in report
    assert report.count("| method | tok/s | speedup | tau | engine tau | forwards/token | steps drafted | drafting share | exact |") == 2
    assert "Per-depth acceptance" in report and "`none` (baseline)" in report
    assert report.count("Speedup over the baseline by category") == 1 and "| method | writing (1) | roleplay (1) |" in report
    for name in bench.PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 1000
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_temperature_one_rows_have_no_exactness_and_greedy_only_methods_are_skipped(tiny_target, tiny_draft, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hello.", "id": "hi"}\n\n{"prompt": "def add(a, b):", "chat": false}\n')
    methods = ["hf-greedy", "hf-sample", "hf-prompt-lookup@tokens=3", "prompt-lookup",
               f"hf-assisted:{tiny_draft}@tokens=3"]
    results = bench.run_bench(str(tiny_target), methods, [str(prompts)], "1", max_new_tokens=8, limit=2,
                              out=tmp_path / "out", plots=False, progress=False)
    rows = results["rows"]
    assert [r["method"] for r in rows] == ["none", "hf-sample", "prompt-lookup", methods[-1]]
    assert results["prompts"] == {str(prompts): ["hi", "prompts/3"]}
    for r in rows:
        assert ROW_FIELDS <= set(r) and r["temperature"] == 1.0 and r["exact"] is None and r["mismatches"] == []
    assert rows[-1]["acceptance_length"] >= 1  # assisted generation's target forwards are counted
    assert [(s["method"], s["temperature"]) for s in results["skipped"]] == [("hf-greedy", 1.0), (methods[2], 1.0)]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Not run at this temperature: `hf-greedy` (hf-greedy runs at temperature 0 only)" in report
    assert not (tmp_path / "out" / "speedup.png").exists()
    # Each prompt has one seed, used by every method: a run reproduces its sampled tokens.
    from selfdraft.heads.target import load_target

    target, ids = load_target(str(tiny_target)), [1, 2, 3]
    for name in ("hf-sample", "prompt-lookup"):
        run = bench.METHODS[name].build(target, None, {})
        assert run(ids, 1.0, 7, 8).token_ids == run(ids, 1.0, 7, 8).token_ids != run(ids, 1.0, 8, 8).token_ids


def test_bad_input_is_a_clear_error(tiny_target, tmp_path):
    from selfdraft.heads.target import TargetIdentity

    def bad(methods="none", tasks="humaneval", match=""):
        with pytest.raises(SelfdraftError, match=match):
            bench.run_bench(str(tiny_target), methods, tasks, max_new_tokens=4, limit=1, out=tmp_path / "x",
                            plots=False, progress=False)

    bad(tasks="mt_bnech", match=r"unknown task 'mt_bnech'; valid tasks: mt_bench, mt_bench:writing, .*humaneval")
    bad(tasks="mt_bench:poetry", match=r"unknown task 'mt_bench:poetry'.*mt_bench:humanities")
    bad(methods="medusa-from-nowhere", match=r"unknown method 'medusa-from-nowhere'; valid methods: none, prompt-lookup, "
        r"copy, hybrid:SPEC, draft-model:SPEC, hf-greedy, hf-sample, hf-prompt-lookup, hf-assisted:SPEC, vllm:FOLDER, or a drafter folder")
    bad(methods="prompt-lookup@tokns=3", match=r"unknown option 'tokns'; valid options of prompt-lookup: tokens, max_ngram")
    bad(methods="prompt-lookup@tokens=zero", match=r"option tokens='zero'")
    bad(methods="prompt-lookup@tokens=0", match=r"tokens='0': must be an integer >= 1")
    bad(methods="hf-greedy@tokens=3", match="takes no options")
    bad(methods="prompt-lookup@", match="no options after '@'")
    bad(methods="none,prompt-lookup,prompt-lookup", match="listed twice: prompt-lookup")
    bad(methods="hf-assisted", match="needs an argument: hf-assisted:SPEC")
    bad(methods=str(tiny_target), match="not a drafter folder.*draft-model:")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    bad(tasks=str(empty), match=f"prompts file {empty} holds no prompts")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    bad(tasks=str(broken), match=f"{broken}, line 2: \"prompt\" must be a non-empty string")
    broken.write_text('{"prompt": "ok"}\nnot json\n')
    bad(tasks=str(broken), match=f"{broken}, line 2 is not valid JSON")
    bad(tasks=str(tmp_path / "missing.jsonl"), match="does not exist")

    # A drafter exported for another target: make_drafter's own refusal, naming the differing fields.
    other = TargetIdentity("other-model", "LlamaForCausalLM", 97, 64, 2, "abc123")
    foreign = _medusa_folder(tmp_path / "foreign", other, 64, 97)
    bad(methods=str(foreign), match=r"was trained for target 'other-model'.*hidden_size: 32 here, 64 in the drafter")
    bad(methods=f"{foreign}@depth=3", match=r"unknown option 'depth'; valid options of medusa drafter folder: max_nodes")


def test_split_methods_and_round_robin():
    from selfdraft.inference.prompts import MT_BENCH_CATEGORIES, mt_bench_prompts, round_robin

    assert bench.split_methods("none,runs/x/drafter@depth=5,top_k=4,max_nodes=12,prompt-lookup@tokens=8,hf-greedy") == [
        "none", "runs/x/drafter@depth=5,top_k=4,max_nodes=12", "prompt-lookup@tokens=8", "hf-greedy"]
    picked = round_robin(mt_bench_prompts(), 8)
    assert [p.category for p in picked] == list(MT_BENCH_CATEGORIES)
    assert len(round_robin(mt_bench_prompts())) == 80
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1 and bench.first_divergence([1, 2], [1, 2, 3]) == 2


def test_the_cli_runs_the_bench_and_reports_errors_in_one_line(tiny_target, tmp_path, capsys):
    from selfdraft.cli import main

    out = tmp_path / "cli"
    code = main(["bench", "--target", str(tiny_target), "--methods", "none,prompt-lookup@tokens=4,max_nodes=8",
                 "--methods", "hf-greedy", "--tasks", "mt_bench:coding", "--max-new-tokens", "8", "--limit", "1",
                 "--threads", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "mt_bench:coding, temperature 0 (1 prompts)" in captured.out and f"report: {out / 'report.md'}" in captured.out
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["command"].startswith("selfdraft bench --target") and results["meta"]["threads"] == 1
    assert [r["method"] for r in results["rows"]] == ["none", "prompt-lookup@tokens=4,max_nodes=8", "hf-greedy"]
    assert all(r["exact"] for r in results["rows"]) and (out / "speedup.png").is_file()

    assert main(["bench", "--target", str(tiny_target), "--tasks", "nope", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfdraft: error: unknown task 'nope'") and "Traceback" not in err


class _Counting:
    """A method that counts its calls per prompt and can be told to die on one (an interrupted bench)."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.die_on_call: int | None = None

    def method(self) -> bench.Method:
        def build(target, argument, options):
            inner = bench.LoopRunner(target, bench._no_drafter())

            def run(ids, temperature, seed, max_new_tokens):
                self.calls.append(list(ids))
                if len(self.calls) == self.die_on_call:
                    raise KeyboardInterrupt
                return inner(ids, temperature, seed, max_new_tokens)

            return run

        return bench.Method("count", build, "our loop without a drafter, counted")


def test_an_interrupted_bench_resumes_from_its_journal(tiny_target, tmp_path, monkeypatch, capsys):
    counting = _Counting()
    monkeypatch.setitem(bench.METHODS, "count", counting.method())
    out = tmp_path / "resume"

    def run(limit, **kw):
        return bench.run_bench(str(tiny_target), kw.pop("methods", "count"), "humaneval", [0], kw.pop("tokens", 6),
                               limit, out, plots=False, progress=False, threads=1, command="test", **kw)

    # Killed while decoding the third prompt: the first two are journaled, results.json is not written.
    counting.die_on_call = 4  # warm-up, prompt 0, prompt 1, then prompt 2 dies
    with pytest.raises(KeyboardInterrupt):
        run(3)
    journal = (out / bench.JOURNAL).read_text().splitlines()
    assert len(journal) == 3 and json.loads(journal[0])["settings"]["max_new_tokens"] == 6
    assert [json.loads(line)["prompt_id"] for line in journal[1:]] == ["HumanEval/0", "HumanEval/1"]
    assert not (out / "results.json").exists()

    # The rerun decodes only prompt 2 (after its warm-up) and reuses the journaled generations as they were.
    counting.die_on_call, counting.calls = None, []
    first = [json.loads(line)["runs"] for line in journal[1:]]
    results = run(3)
    assert len(counting.calls) == 2 and "bench: 2 of 3 prompts are in" in capsys.readouterr().err
    assert results["meta"]["journal"]["reused"] == 2 and results["meta"]["journal"]["prompts"] == 3
    rows = {r["method"]: r for r in results["rows"]}
    assert rows["count"]["prompts"] == 3 and rows["count"]["exact"] and rows["none"]["prompts"] == 3
    seconds = sum(r["count"]["seconds"] for r in first) + json.loads(
        (out / bench.JOURNAL).read_text().splitlines()[3])["runs"]["count"]["seconds"]
    assert rows["count"]["seconds"] == pytest.approx(seconds)

    # A larger limit adds prompts; the same limit again decodes nothing (no warm-up either).
    counting.calls = []
    assert run(4)["meta"]["journal"]["reused"] == 3 and len(counting.calls) == 2
    counting.calls = []
    assert run(4)["meta"]["journal"]["reused"] == 4 and counting.calls == []

    # A torn last line (killed mid-write) is dropped with a warning and that prompt decoded again.
    text = (out / bench.JOURNAL).read_text()
    (out / bench.JOURNAL).write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1] + text.splitlines()[-1][:40])
    capsys.readouterr()
    assert run(4)["meta"]["journal"]["reused"] == 3 and len(counting.calls) == 2
    assert "dropping a torn or unreadable line" in capsys.readouterr().err
    assert len((out / bench.JOURNAL).read_text().splitlines()) == 5

    # Other settings are refused by name; fresh starts over.
    with pytest.raises(SelfdraftError, match=r"other settings \(max_new_tokens differ\).*--fresh"):
        run(4, tokens=5)
    with pytest.raises(SelfdraftError, match=r"other settings \(methods \(prompt-lookup\) differ\)"):
        run(4, methods="count,prompt-lookup")
    counting.calls = []
    assert run(1, tokens=5, fresh=True)["meta"]["journal"]["reused"] == 0 and len(counting.calls) == 2
    assert len((out / bench.JOURNAL).read_text().splitlines()) == 2


def test_plot_labels_are_short_and_tell_methods_apart():
    methods = ["none", "prompt-lookup@tokens=4", "runs/eagle-smollm2/drafter@depth=3,top_k=2,max_nodes=4",
               "runs/eagle3-smollm2/drafter@depth=3,top_k=2,max_nodes=4", "hf-assisted:models/draft@tokens=5",
               "/home/me/a/x/drafter", "/home/me/b/x/drafter"]
    labels = bench.method_labels(methods)
    assert labels["none"] == "none" and labels["prompt-lookup@tokens=4"] == "prompt-lookup@tokens=4"
    assert labels["runs/eagle3-smollm2/drafter@depth=3,top_k=2,max_nodes=4"] == "eagle3-smollm2/drafter@depth=3,top_k=2,max_nodes=4"
    assert labels["hf-assisted:models/draft@tokens=5"] == "hf-assisted:models/draft@tokens=5"
    assert labels["/home/me/a/x/drafter"] == "a/x/drafter"  # two parts would not tell a/x from b/x
    assert len(set(labels.values())) == len(methods)
    same_folder = bench.method_labels(["runs/x/drafter", "./runs/x/drafter", "y/drafter"])
    assert same_folder == {"runs/x/drafter": "runs/x/drafter", "./runs/x/drafter": "./runs/x/drafter",
                           "y/drafter": "y/drafter"}


def test_vllm_rows_come_from_the_engines_own_counters(tiny_target, tmp_path, monkeypatch):
    """The vllm:FOLDER / vllm:none runner turns the worker's per-prompt result into a Generation:
    verification steps and accepted drafts from vLLM's counters, seconds measured by vLLM, one engine
    for every prompt; ``@engine=inline`` runs the engine core in the worker's process, the default as
    `vllm serve` does. (vLLM itself runs in tests/engines/test_vllm.py; here its worker is a stub.)"""
    from selfdraft.inference import vllm_engine
    from selfdraft.inference.bench.runners import VllmRunner

    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    calls = []

    def fake_run_vllm(target, prompts, max_new_tokens, *, speculative=None, **kwargs):
        calls.append((prompts, speculative, kwargs["in_process"]))
        out = []
        for ids in prompts:  # 7 new tokens: prefill 1, then steps emitting 3, 1, 2 (accepted 2, 0, 1)
            out.append({"token_ids": list(range(7)), "seconds": 0.5, "drafts": 3, "draft_tokens": 9,
                        "accepted_tokens": 3, "accepted_per_position": [2, 1, 0]} if speculative else
                       {"token_ids": list(range(7)), "seconds": 0.25, "drafts": 0, "draft_tokens": 0,
                        "accepted_tokens": 0, "accepted_per_position": []})
        return {"vllm_version": "0.32.0", "results": out}

    monkeypatch.setattr(vllm_engine, "vllm_python", lambda: tmp_path / "python")
    monkeypatch.setattr(vllm_engine, "run_vllm", fake_run_vllm)
    results = bench.run_bench(str(tiny_target), f"none,vllm:{folder},vllm:none@engine=inline", "humaneval", max_new_tokens=7,
                              limit=2, out=tmp_path / "out", plots=False, progress=False)
    assert len(calls) == 2 and all(len(prompts) == 3 for prompts, _, _ in calls)  # warm-up + 2 prompts, one engine each
    assert [in_process for _, _, in_process in calls] == [False, True]
    assert calls[0][1] == {"method": "eagle3", "model": str(folder.resolve()), "num_speculative_tokens": 3}
    rows = {r["method"]: r for r in results["rows"]}
    spec, plain = rows[f"vllm:{folder}"], rows["vllm:none@engine=inline"]
    assert spec["seconds"] == 1.0 and spec["target_forwards"] == 8 and spec["engine_acceptance_length"] == 2.0
    assert spec["per_depth_acceptance"] == {"1": 2 / 3, "2": 1 / 3, "3": 0.0} and spec["drafting_time_share"] is None
    assert plain["seconds"] == 0.5 and plain["acceptance_length"] == 1.0 and plain["engine_acceptance_length"] == 1.0
    assert results["meta"]["methods"]["vllm:none@engine=inline"]["engine_version"] == "vllm 0.32.0"
    monkeypatch.setattr(vllm_engine, "vllm_python", lambda: None)
    with pytest.raises(SelfdraftError, match="setup_vllm.sh"):
        bench.run_bench(str(tiny_target), "vllm:none", "humaneval", max_new_tokens=7, limit=1, out=tmp_path / "x",
                        plots=False, progress=False)


def test_batch_sizes_bench_reports_tokens_per_second_per_size(tiny_target, tmp_path, monkeypatch, caplog):
    """`selfdraft bench --batch-sizes`: every method at every batch size, tokens/s and speedup over `none`
    at the same size, every row checked against `none` at batch 1; hf-greedy batched (left padded) and
    vllm:FOLDER with B requests in flight (the worker a stub here: it gets the concurrency and returns one
    group per B prompts); methods that decode one prompt at a time are refused."""
    import shlex

    from selfdraft import cli
    from selfdraft.inference import vllm_engine
    from selfdraft.inference.bench.batched import run_batch_bench

    calls = []

    def fake_run_vllm(target, prompts, max_new_tokens, *, concurrency=1, **kwargs):
        calls.append(concurrency)
        tokens = [[5] * max_new_tokens for _ in prompts]
        if concurrency == 1:
            return {"vllm_version": "0.32.0", "results": [{"token_ids": t, "seconds": 0.5, "drafts": 0,
                                                           "accepted_tokens": 0} for t in tokens]}
        return {"vllm_version": "0.32.0", "batches": [{"seconds": 0.5, "token_ids": tokens[i:i + concurrency], "drafts": 0,
                                                       "accepted_tokens": 0} for i in range(0, len(tokens), concurrency)]}

    monkeypatch.setattr(vllm_engine, "vllm_python", lambda: tmp_path / "python")
    monkeypatch.setattr(vllm_engine, "run_vllm", fake_run_vllm)
    results = run_batch_bench(str(tiny_target), "prompt-lookup,hf-greedy,vllm:none", "humaneval", [1, 2], max_new_tokens=6,
                              limit=3, out=tmp_path / "b", plots=True, progress=False)
    rows = {(r["method"], r["batch"]): r for r in results["rows"]}
    assert set(rows) == {(m, b) for m in ("none", "prompt-lookup", "hf-greedy", "vllm:none") for b in (1, 2)}
    for (method, batch), r in rows.items():
        assert r["prompts"] == 3 and r["tokens_per_second"] > 0, r
        if method != "vllm:none":
            assert r["exact_rows"] == 3, r  # ours and transformers' batched greedy equal `none` alone
    assert rows[("none", 2)]["speedup"] == 1.0 and rows[("none", 1)]["acceptance_length"] == 1.0
    assert rows[("vllm:none", 2)]["seconds"] == 1.0 and calls == [1, 2]  # 3 prompts: groups of 2 and 1
    assert results["meta"]["engines"] == {"vllm:none": "vllm 0.32.0"}
    for name in ("batches.json", "batches.md", "batches.png"):
        assert (tmp_path / "b" / name).stat().st_size > 0
    assert "| prompt-lookup |" in (tmp_path / "b" / "batches.md").read_text()
    with pytest.raises(SelfdraftError, match="decode one prompt at a time"):
        run_batch_bench(str(tiny_target), "hf-prompt-lookup", "humaneval", [1], limit=1, out=tmp_path / "x", plots=False)
    with pytest.raises(SelfdraftError, match="batch sizes must be integers >= 1"):
        run_batch_bench(str(tiny_target), "none", "humaneval", [0], limit=1, out=tmp_path / "x", plots=False)
    assert cli.main(shlex.split(f"bench --target {tiny_target} --batch-sizes 1,2 --temperatures 1 --out {tmp_path / 'y'}"))
    assert "leave --temperatures at 0" in caplog.text and not (tmp_path / "y").exists()
