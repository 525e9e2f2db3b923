"""Decode prompts in vLLM and report its speculative-decoding counters: a script for vLLM's own venv.

This file runs under the Python of a separate venv that holds vLLM (``scripts/setup_vllm.sh`` makes
``.venv-vllm``; vLLM brings its own torch and transformers, so it cannot share selfdraft's venv). It
imports only vLLM and the standard library, never selfdraft. ``selfdraft.inference.vllm_engine``
starts it as ``PYTHON vllm_worker.py REQUEST.json RESULT.json``.

The request (JSON): ``target`` (a model folder), ``speculative_config`` (vLLM's dict, or null for
plain decoding), ``prompts`` (lists of token ids), ``max_new_tokens``, ``dtype``, ``max_model_len``,
``temperatures`` and ``seeds`` (one per prompt, or null: greedy), ``warmup`` (prompts decoded first,
greedily, and not reported), ``executor`` (vLLM's ``distributed_executor_backend``, or null: its default;
``uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the environment runs the engine in this process).

``concurrency`` (optional, > 1): the prompts go to the engine in groups of that many, all of a group in one
``generate`` call (vLLM schedules them together, as a server does that many requests in flight); the
result then holds ``batches`` instead of ``results``: per group its ``seconds``, each prompt's ``token_ids``,
and the counters' differences over the group.

``runs`` (a list of such requests) instead decodes with one engine after another in this process
(``executor: uni``), importing vLLM once; the result's ``runs`` then holds each one's result, or its
``error`` (the traceback) where that engine failed.

The result (JSON): ``vllm_version``; per prompt ``token_ids`` (new tokens), ``seconds`` (wall time
of its ``generate`` call), and the differences of vLLM's counters around that call: ``drafts``
(verification steps that carried draft tokens), ``draft_tokens``, ``accepted_tokens`` and
``accepted_per_position``. vLLM's mean acceptance length is ``1 + accepted_tokens / drafts``.

Counters are read with ``LLM.get_metrics()`` (names as in vLLM 0.32.0, ``vllm/v1/metrics/reader.py``
and ``vllm/v1/spec_decode/metrics.py``), so the engine is started with ``disable_log_stats=False``.
"""

from __future__ import annotations

import json
import sys
import time

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm) -> dict:
    """The current totals of vLLM's speculative-decoding counters (zeros before the first draft)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {name: 0 for name in COUNTERS.values()}
    out["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == PER_POSITION:
            values = list(metric.values)
            have = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(have + [0] * len(values), values + [0] * len(have))][
                : max(len(have), len(values))]
    return out


def difference(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS.values()}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    b = b + [0] * (len(a) - len(b))
    out["accepted_per_position"] = [x - y for x, y in zip(a, b)]
    return out


def decode(request: dict) -> dict:
    """One engine: build it from ``request``, decode its prompts, report per prompt."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=request["target"], dtype=request.get("dtype", "float32"),
                  max_model_len=request.get("max_model_len", 1024), enforce_eager=True,
                  disable_log_stats=False, seed=0, trust_remote_code=False)
    if request.get("executor"):
        kwargs["distributed_executor_backend"] = request["executor"]
    if request.get("speculative_config"):
        kwargs["speculative_config"] = request["speculative_config"]
    llm = LLM(**kwargs)
    try:
        prompts = request["prompts"]
        temperatures = request.get("temperatures") or [0.0] * len(prompts)
        seeds = request.get("seeds") or [None] * len(prompts)
        max_tokens = int(request["max_new_tokens"])
        for ids in request.get("warmup") or []:
            llm.generate([TokensPrompt(prompt_token_ids=list(ids))], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                         use_tqdm=False)
        concurrency = int(request.get("concurrency") or 1)
        if concurrency > 1:
            batches = []
            for start in range(0, len(prompts), concurrency):
                group = range(start, min(start + concurrency, len(prompts)))
                params = [SamplingParams(max_tokens=max_tokens, temperature=float(temperatures[i]), seed=seeds[i])
                          for i in group]
                before = read_counters(llm)
                t0 = time.perf_counter()
                outputs = llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in group], params,
                                       use_tqdm=False)
                seconds = time.perf_counter() - t0
                batches.append({"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                                **difference(read_counters(llm), before)})
            return {"batches": batches}
        results = []
        for ids, temperature, seed in zip(prompts, temperatures, seeds):
            params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), seed=seed)
            before = read_counters(llm)
            start = time.perf_counter()
            (output,) = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            counts = difference(read_counters(llm), before)
            results.append({"token_ids": list(output.outputs[0].token_ids), "seconds": seconds, **counts})
        return {"results": results}
    finally:
        del llm
        release()


def release() -> None:
    """Free the engine just deleted so that the next one starts clean in this process (vLLM's own tests
    do this between engines: ``vllm/distributed/parallel_state.py`` ``cleanup_dist_env_and_memory``, 0.32.0)."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main(request_path: str, result_path: str) -> None:
    import traceback

    import vllm

    request = json.loads(open(request_path, encoding="utf-8").read())
    out = {"vllm_version": vllm.__version__}
    if "runs" in request:  # several engines, one after another, in this process: vLLM imported once
        out["runs"] = []
        for run in request["runs"]:
            try:
                out["runs"].append(decode(run))
            except Exception:  # reported for this engine; the next ones still run
                traceback.print_exc()
                out["runs"].append({"error": traceback.format_exc(limit=-8)})
    else:
        out.update(decode(request))
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: keep the work under this guard
    main(sys.argv[1], sys.argv[2])
