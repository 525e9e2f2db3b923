"""``selfdraft distill --server``: answers from an OpenAI-compatible chat-completions server, here a
scripted one on a local port (vLLM itself in tests/engines/test_vllm_server.py). The same shards and
resumption as the local path; transient failures retried; malformed answers, refusals and an
unreachable server are clear errors that leave nothing half-written."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from selfdraft.configs.schema import DataConfig
from selfdraft.errors import SelfdraftError
from selfdraft.train.chat_server import ServerConfig
from selfdraft.train.distill import DistillConfig, TargetText, distill


class ScriptedServer:
    """A chat-completions server whose answer names the last user turn; ``fail`` maps the POST number
    (1-based) to an (HTTP status, body) reply instead."""

    def __init__(self, model="served-smollm2", max_model_len=None):
        self.model, self.posts, self.fail, self.bodies = model, 0, {}, []
        listed = {"id": model, "object": "model"} | ({"max_model_len": max_model_len} if max_model_len else {})
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status, body):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [listed]})
                else:
                    self._reply(404, {"error": "no such path"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.posts += 1
                    number = outer.posts
                    outer.bodies.append(body)
                if number in outer.fail:
                    return self._reply(*outer.fail[number])
                question = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
                self._reply(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                      "content": f"answer to {question[:24]}"}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # A short poll interval: close() waits for it (0.5 s by default, after every test).
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def target_text(embedded_fp32):
    from selfdraft.heads.target import load_target_tokenizer

    tokenizer, identity = load_target_tokenizer("smollm2-135m")
    assert identity == embedded_fp32.identity  # the same identity as with its weights
    return TargetText(tokenizer, identity)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i}: what is {i} squared?"},
                          {"role": "assistant", "content": "old answer"},
                          {"role": "user", "content": f"and {i} cubed?"}, {"role": "assistant", "content": "old"}]}
            for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(source=str(path))


def fast(url, **kw):
    return ServerConfig(url, concurrency=3, retries=kw.pop("retries", 3), backoff=0.01, timeout=10, **kw)


def test_server_answers_land_in_resumable_shards(server, target_text, source, tmp_path):
    config = DistillConfig(max_new_tokens=16, shard_size=2, max_turns=2)
    out = distill(target_text, source, tmp_path / "d", config, server=fast(server.url))
    shards = sorted(out.glob("shard-*.jsonl"))
    assert [s.name for s in shards] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    conversations = [json.loads(line)["messages"] for s in shards for line in s.read_text().splitlines()]
    assert len(conversations) == 5
    for i, conv in enumerate(conversations):  # two turns each: the second sees the first new answer
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
        assert conv[1]["content"] == "answer to " + f"question {i}: what is {i} squared?"[:24]
        assert conv[3]["content"] == f"answer to and {i} cubed?"
    second_turns = [b for b in server.bodies if len(b["messages"]) == 3]
    assert second_turns and all(b["messages"][1]["content"].startswith("answer to") for b in second_turns)
    assert all(b["model"] == "served-smollm2" and b["max_tokens"] == 16 and b["temperature"] == 0 and "seed" not in b
               for b in server.bodies)
    manifest = json.loads((out / "distill.json").read_text())
    assert manifest["server"] == {"model": "served-smollm2"} and manifest["target"] == target_text.identity.to_dict()
    # Resume: only the missing shard's conversations are asked again (1 conversation x 2 turns).
    shards[2].unlink()
    before = server.posts
    distill(target_text, source, out, config, server=fast(server.url))
    assert server.posts - before == 2 and shards[2].is_file()
    # A local run into the same folder is another setting.
    with pytest.raises(SelfdraftError, match="server"):
        distill(target_text, source, out, config)


def test_sampled_requests_carry_seeds_that_a_rerun_repeats(server, target_text, source, tmp_path):
    config = DistillConfig(max_new_tokens=8, shard_size=5, temperature=0.7, seed=3)
    distill(target_text, source, tmp_path / "a", config, server=fast(server.url))
    first = sorted((json.dumps(b["messages"]), b["seed"]) for b in server.bodies)
    server.bodies.clear()
    distill(target_text, source, tmp_path / "b", config, server=fast(server.url))
    assert sorted((json.dumps(b["messages"]), b["seed"]) for b in server.bodies) == first
    assert len({s for _, s in first}) == len(first)


def test_transient_failures_are_retried(server, target_text, source, tmp_path):
    server.fail = {1: (503, {"error": "loading"}), 2: (429, {"error": "busy"}), 3: (502, "bad gateway")}
    out = distill(target_text, source, tmp_path / "d", DistillConfig(max_new_tokens=8, shard_size=5),
                  server=fast(server.url, retries=3))
    assert len(out.joinpath("shard-00000.jsonl").read_text().splitlines()) == 5


@pytest.mark.parametrize(("reply", "message"), [
    ((200, "<html>proxy login</html>"), "not JSON"),
    ((200, {"object": "chat.completion", "choices": []}), "no choices"),
    ((400, {"error": {"message": "maximum context length is 2048 tokens"}}), "HTTP 400"),
    ((503, {"error": "down"}), "failed 2 times"),
])
def test_bad_answers_are_clear_errors_and_leave_no_shard(server, target_text, source, tmp_path, reply, message):
    server.fail = {n: reply for n in range(1, 100)}
    out = tmp_path / "d"
    with pytest.raises(SelfdraftError, match=message):
        distill(target_text, source, out, DistillConfig(max_new_tokens=8, shard_size=5), server=fast(server.url, retries=1))
    assert not list(out.glob("shard-*")), "nothing half-written"


def test_a_server_context_too_short_for_prompt_and_answer_is_refused_before_any_request(target_text, source, tmp_path):
    # vLLM lists its --max-model-len; one of 1024 took 21 minutes of a real job to meet a 1024-token prompt
    # (HTTP 400, "max_tokens must be at least 1"). Refused up front now, with the flag that fixes it.
    srv = ScriptedServer(max_model_len=1024)
    try:
        with pytest.raises(SelfdraftError, match="context of 1024 tokens.*--max-model-len 1280"):
            distill(target_text, source, tmp_path / "d", DistillConfig(max_new_tokens=256), server=fast(srv.url))
        assert srv.posts == 0 and not (tmp_path / "d").exists()
        out = distill(target_text, source, tmp_path / "ok", DistillConfig(max_new_tokens=256, max_prompt_tokens=768),
                      server=fast(srv.url))
        assert len((out / "shard-00000.jsonl").read_text().splitlines()) == 5
    finally:
        srv.close()


def test_unreachable_server_writes_nothing(target_text, source, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SelfdraftError, match="is it running"):
        distill(target_text, source, tmp_path / "d", DistillConfig(), server=fast(f"http://127.0.0.1:{port}", retries=1))
    assert not (tmp_path / "d").exists()
    with pytest.raises(SelfdraftError, match="serves \\['served-smollm2'\\], not 'other'"):
        srv = ScriptedServer()
        try:
            distill(target_text, source, tmp_path / "d", DistillConfig(), server=fast(srv.url, model="other"))
        finally:
            srv.close()
    with pytest.raises(SelfdraftError, match="http"):
        ServerConfig("localhost:8000")


@pytest.mark.slow
def test_cli_distill_through_a_server(server, embedded_fp32, source, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "selfdraft", "distill", "--server", server.url + "/v1", "--source",
                           source.source, "--out", str(out), "--max-new-tokens", "8", "--concurrency", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((out / "shard-00000.jsonl").read_text().splitlines()) == 5
    proc = subprocess.run([sys.executable, "-m", "selfdraft", "distill", "--server", "http://127.0.0.1:9", "--retries", "0",
                           "--source", source.source, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "is it running" in proc.stderr, proc.stderr
