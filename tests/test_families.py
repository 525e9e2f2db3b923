"""Every causal-LM family transformers ships decodes token-identically to its own ``generate()``.

The targets are tiny random models generated from each family's config class (tests/families.py:
every model_type of transformers' causal-LM mapping, shrunk generically; windows of 16 tokens, shorter
than the 30-token prompt plus the answer). Each is decoded greedily in fp32 with prompt lookup and with
the target drafting for itself (a tree of its own top-2 continuations, so drafts are accepted and the
rejected branches rolled back), at batch 1 and as a batch of two prompts of different lengths, against
``generate()`` row by row. A family the decoder cannot serve must be refused when the session is made,
with a message naming what is missing (heads/target_layers.py), never fail in the middle of a decode;
the families users bring most often must not be refused at all.

``python tests/test_families.py [--write docs/families.md] [family ...]`` runs the same check and prints
(or writes) the table of docs/families.md.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import families  # noqa: E402  (tests/families.py, beside this file)

from selfdraft.configs.decode import DRAFT_MODEL_TREE, DecodeConfig  # noqa: E402
from selfdraft.errors import SelfdraftError  # noqa: E402
from selfdraft.heads.target_layers import TargetLayers  # noqa: E402
from selfdraft.inference.batch import BatchSession  # noqa: E402
from selfdraft.inference.decode import batched_decode  # noqa: E402
from selfdraft.inference.decode import speculative_decode  # noqa: E402
from selfdraft.inference.drafters import DraftModelDrafter, PromptLookupDrafter  # noqa: E402
from selfdraft.inference.session import CausalLMSession  # noqa: E402

NEW_TOKENS = 24
MUST_SERVE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "gemma", "gemma2",
              "gemma3_text", "gpt_oss", "phi3", "deepseek_v3", "glm4", "olmo2", "smollm3", "granite", "lfm2",
              "starcoder2", "exaone4")
"""The families users bring most often (issue 39's list): none of them may be refused."""


def prompts(vocab: int) -> list[list[int]]:
    """A 30-token prompt of a repeating pattern (prompt lookup finds matches) and a shorter one, so that a
    batch of the two is padded."""
    long = families.prompt_ids(vocab)[0].tolist()
    return [long, long[3:17]]


def reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def first_divergence(mine: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))


def check(model_type: str) -> dict:
    """One row of the family table: the layer kinds, how trees are verified, and the status (``exact``,
    ``refused: REASON`` or a failure)."""
    model = families.tiny_model(model_type)
    # A random model may emit its eos id: decode the full length (and force nothing at the end).
    model.generation_config.eos_token_id = model.generation_config.forced_eos_token_id = None
    row = {"family": model_type, "kinds": ", ".join(families.layer_kinds(model.config)),
           "backend": model.config._attn_implementation}
    try:  # as load_target does
        layers = TargetLayers.of(model)
        layers.probe(model)
    except SelfdraftError as err:
        return {**row, "verifies": "-", "status": f"refused: {err}"}
    row["verifies"] = "tree" if layers.trees else "chain"
    vocab = model.config.get_text_config(decoder=True).vocab_size
    batch = prompts(min(vocab, 512))
    refs = [reference(model, p) for p in batch]
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    drafters = {"prompt lookup": PromptLookupDrafter(),
                "self-drafting": DraftModelDrafter(model, dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=2, max_nodes=8))}
    problems, accepted = [], 0
    for name, drafter in drafters.items():
        for i, (prompt, ref) in enumerate(zip(batch, refs)):
            out = speculative_decode(CausalLMSession(model), prompt, drafter, config)
            if out.token_ids != ref:
                problems.append(f"{name}, batch 1, prompt {i}: first divergence at {first_divergence(out.token_ids, ref)}")
            if name == "self-drafting":
                accepted += NEW_TOKENS - out.stats.target_forwards
        outs = batched_decode(BatchSession(model), batch, drafter, config)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            if out.token_ids != ref:
                problems.append(f"{name}, batched, row {i}: first divergence at {first_divergence(out.token_ids, ref)}")
    if accepted <= 0:
        problems.append("self-drafting accepted no draft: rollback was not exercised")
    return {**row, "status": "exact" if not problems else "; ".join(problems), "accepted": accepted}


CASES = [f for f in families.families() if f not in families.SKIPPED]
FAST = ("mistral", "gemma2", "gpt_oss", "qwen3_next", "lfm2", "deepseek_v3")
"""One family of each layer kind that failed before: a window shorter than the text, soft-capping (eager),
attention sinks with expert routing, gated linear attention, short convolutions, latent attention."""


@pytest.mark.parametrize("model_type", FAST)
def test_each_layer_kind_decodes_exactly(model_type):
    row = check(model_type)
    assert row["status"] == "exact", f"{model_type} ({row['kinds']}; {row['verifies']}): {row['status']}"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [f for f in CASES if f not in FAST])
def test_family_decodes_exactly_or_is_refused_at_load(model_type):
    try:
        families.tiny_model(model_type)
    except Exception as err:  # the family needs a package this machine lacks (e.g. timm): nothing to decode
        pytest.skip(f"{model_type} does not build here: {families._one_line(err)}")
    row = check(model_type)
    if row["status"].startswith("refused"):
        assert model_type not in MUST_SERVE, f"{model_type} is refused: {row['status']}"
        return
    assert row["status"] == "exact", f"{model_type} ({row['kinds']}; {row['verifies']}): {row['status']}"


def table(rows: list[dict]) -> str:
    lines = ["| family | layer kinds | attention | verifies | status |", "|---|---|---|---|---|"]
    for r in rows:
        status = r["status"].replace("|", "/")
        lines.append(f"| {r['family']} | {r['kinds']} | {r.get('backend', '-')} | {r['verifies']} | {status} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    write = None
    if argv[:1] == ["--write"]:
        write, argv = pathlib.Path(argv[1]), argv[2:]
    rows = []
    for model_type in argv or CASES:
        start = time.perf_counter()
        try:
            row = check(model_type)
        except Exception as err:  # a family that does not build here, or a failure to report
            row = {"family": model_type, "kinds": "-", "verifies": "-", "status": f"error: {families._one_line(err)}"}
        rows.append(row)
        print(f"{model_type:28s} {row['verifies']:6s} {time.perf_counter() - start:5.1f}s {row['status'][:150]}", flush=True)
    if write is None:
        print(table(rows))
        return 0
    page = write.read_text()
    begin, end = "<!-- family table: begin -->", "<!-- family table: end -->"
    head, rest = page.split(begin)
    old, tail = rest.split(end)
    kept = {}  # rows of families not checked this time stay as they were
    for line in old.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        kept[cells[0]] = dict(zip(("family", "kinds", "backend", "verifies", "status"), cells))
    kept.update({r["family"]: r for r in rows})
    ordered = [kept[f] for f in sorted(kept)]
    write.write_text(head + begin + "\n" + table(ordered) + "\n" + end + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
