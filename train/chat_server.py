"""A client for OpenAI-compatible chat-completions servers (vLLM, SGLang, llama.cpp's server), for
``selfdraft distill --server``: many requests in flight at once, retries on transient failures, and
clear errors for the rest.

Only the standard library's HTTP client: ``POST {url}/v1/chat/completions`` with ``model``,
``messages``, ``max_tokens``, ``temperature``, ``top_p`` and ``seed``; the answer is
``choices[0].message.content``. ``GET {url}/v1/models`` checks the server before any work starts
and names the served model when none is given.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from selfdraft.errors import SelfdraftError

TRANSIENT_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
"""HTTP statuses worth another try (overload, restarts, gateways); any other error status is final."""


@dataclass(frozen=True)
class ServerConfig:
    url: str
    """Base URL of the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)."""
    model: str | None = None
    """The served model's name; None: the only one the server lists."""
    concurrency: int = 16
    """Requests in flight at once."""
    timeout: float = 600.0
    """Seconds one request may take."""
    retries: int = 5
    """Further tries of a request after a transient failure (connection refused or reset, timeout,
    429 or 5xx), with exponential backoff from ``backoff`` seconds."""
    backoff: float = 1.0

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise SelfdraftError(f"--server must be an http:// or https:// URL, got {self.url!r}")
        if self.concurrency < 1 or self.retries < 0 or self.timeout <= 0 or self.backoff < 0:
            raise SelfdraftError("server concurrency must be >= 1, retries >= 0, timeout > 0 and backoff >= 0")

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


class _Transient(Exception):
    """A failure that another try may not meet."""


class ChatServer:
    """Answers chat histories through an OpenAI-compatible server."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.model, self.context = self._served_model()

    # --- HTTP ----------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        """One request and its JSON answer; _Transient for what another try may fix, SelfdraftError
        for the rest."""
        url = self.config.base + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", errors="replace")[:500]
            if err.code in TRANSIENT_STATUS:
                raise _Transient(f"HTTP {err.code} from {url}: {detail}") from err
            raise SelfdraftError(f"the server answered HTTP {err.code} to {method} {url}: {detail}") from err
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            raise _Transient(f"{url}: {getattr(err, 'reason', err)}") from err
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SelfdraftError(f"{method} {url} returned something that is not JSON ({err}): {raw[:200]!r}; "
                                 "is --server the base URL of an OpenAI-compatible server?") from err

    def _with_retries(self, method: str, path: str, body: dict | None = None) -> Any:
        delay = self.config.backoff
        for attempt in range(self.config.retries + 1):
            try:
                return self._request(method, path, body)
            except _Transient as err:
                if attempt == self.config.retries:
                    raise SelfdraftError(
                        f"the server at {self.config.base} failed {attempt + 1} times ({err}); is it running and "
                        "reachable? (e.g. `vllm serve MODEL_FOLDER`, then --server http://HOST:8000)") from None
                time.sleep(delay * (1 + 0.25 * random.random()))  # jitter: many threads retry at once
                delay *= 2
        raise AssertionError("unreachable")

    # --- the API -------------------------------------------------------------------------------------

    def _served_model(self) -> tuple[str, int | None]:
        """The served model's name and its context in tokens (prompt and answer together), where the
        listing says it: vLLM's and SGLang's ``/v1/models`` give ``max_model_len`` (the server's
        ``--max-model-len`` / ``--context-length``); None where it does not (llama.cpp's server)."""
        listing = self._with_retries("GET", "/v1/models")
        try:
            models = {str(m["id"]): m for m in listing["data"]}
        except (TypeError, KeyError) as err:
            raise SelfdraftError(f"{self.config.base}/v1/models is not an OpenAI model list: {str(listing)[:200]}") from err
        names = list(models)
        if self.config.model is not None:
            if self.config.model not in names:
                raise SelfdraftError(f"the server serves {names}, not {self.config.model!r}; fix --server-model")
            name = self.config.model
        elif len(names) != 1:
            raise SelfdraftError(f"the server serves {len(names)} models ({names}): name one with --server-model")
        else:
            name = names[0]
        context = models[name].get("max_model_len") if isinstance(models[name], dict) else None
        return name, int(context) if isinstance(context, (int, float)) and context > 0 else None

    def answer(self, messages: Sequence[dict], *, max_tokens: int, temperature: float, seed: int | None) -> str:
        """The server's answer to one chat history (greedy at temperature 0)."""
        body = {"model": self.model, "messages": list(messages), "max_tokens": int(max_tokens),
                "temperature": float(temperature), "top_p": 1.0, "n": 1, "stream": False}
        if seed is not None:
            body["seed"] = int(seed)
        reply = self._with_retries("POST", "/v1/chat/completions", body)
        try:
            content = reply["choices"][0]["message"]["content"]
        except (TypeError, KeyError, IndexError) as err:
            raise SelfdraftError(f"{self.config.base}/v1/chat/completions returned no choices[0].message.content: "
                                 f"{str(reply)[:300]}") from err
        if not isinstance(content, str):
            raise SelfdraftError(f"the server's answer is {type(content).__name__}, not text: {str(reply)[:300]}")
        return content

    def answer_all(self, histories: Sequence[Sequence[dict]], *, max_tokens: int, temperature: float,
                   seeds: Sequence[int | None]) -> list[str]:
        """Answers to many histories, ``concurrency`` requests in flight; the first error stops the rest."""
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            futures = [pool.submit(self.answer, h, max_tokens=max_tokens, temperature=temperature, seed=s)
                       for h, s in zip(histories, seeds)]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
