"""Self-distillation: the target regenerates the assistant turns of a conversation source.

Heads trained on the target's own answers learn the distribution they are verified against. The
user (and system) turns are kept; each assistant turn is replaced by what the target generates
after the conversation so far (with its own earlier answers as context), in batches of
conversations, turn by turn. Output: ``OUT/shard-00000.jsonl`` ... in the ``messages`` layout, one
conversation per line, plus ``OUT/distill.json`` (the settings and the target). Shards are written
atomically; a rerun with the same settings skips finished shards, so an interrupted job resumes.
Use the folder as ``data.source`` of a training run.

The answers come from transformers ``generate`` on the loaded target (batched, one process), or with
``server=`` from an OpenAI-compatible chat-completions server that serves the target (vLLM, SGLang,
llama.cpp's server; :mod:`selfdraft.train.chat_server`), many requests in flight: the same turn rules,
the same shards. Only the target's tokenizer is loaded then (:class:`TargetText`), to count prompt
tokens; the server renders the chat template (the target's own, when it serves the target's folder).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from selfdraft.configs.schema import DataConfig, to_dict
from selfdraft.errors import SelfdraftError

if TYPE_CHECKING:  # the CLI builds its parser from DistillConfig: no torch at import
    import torch

    from selfdraft.heads.target import TargetIdentity

MANIFEST = "distill.json"


@dataclass(frozen=True)
class DistillConfig:
    max_new_tokens: int = 256
    """Tokens generated per assistant turn at most."""
    max_turns: int = 1
    """Assistant turns regenerated per conversation; the conversation is cut after the last one."""
    batch_size: int = 8
    """Conversations generated together (left-padded batch)."""
    shard_size: int = 64
    """Conversations per output shard (the unit of resumption)."""
    temperature: float = 0.0
    """0: greedy answers (what greedy decoding verifies); > 0 samples them."""
    max_prompt_tokens: int = 1024
    """Conversations whose context before a turn is longer stop before that turn."""
    seed: int = 0


@dataclass(frozen=True)
class TargetText:
    """A target's tokenizer and identity without its weights, for distilling through a server
    (:func:`~selfdraft.heads.target.load_target_tokenizer` makes the pair)."""

    tokenizer: Any
    identity: TargetIdentity


Answerer = Callable[[list[list[dict]], list[int]], list[str]]
"""(chat histories, a seed per history) -> the next assistant answer of each."""


def _request_seed(seed: int, shard: int, index: int, turn: int) -> int:
    """A server request's sampling seed: fixed by the run's seed and the turn's place, so a resumed run
    asks the same questions with the same seeds."""
    return zlib.crc32(f"{seed}/{shard}/{index}/{turn}".encode()) & 0x7FFFFFFF


def _prompts(conversations: list[list[dict]], max_turns: int) -> list[list[dict]]:
    """Drop leading assistant turns (a ShareGPT continuation chunk has no question for them), then
    keep each conversation's turns up to its max_turns-th assistant answer."""
    out = []
    for messages in conversations:
        kept, answers = [], 0
        first = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
        for m in messages[first:]:
            kept.append(m)
            if m["role"] == "assistant":
                answers += 1
                if answers == max_turns:
                    break
        out.append(kept)
    return out


def _generate(target, histories: list[list[dict]], config: DistillConfig, generator: torch.Generator) -> list[str]:
    import torch

    tok = target.tokenizer
    texts = [tok.apply_chat_template(h, tokenize=False, add_generation_prompt=True) for h in histories]
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    old_side, old_pad = tok.padding_side, tok.pad_token
    tok.padding_side = "left"
    if old_pad is None:  # Llama-3.x tokenizers have no pad token: pad with EOS (the attention mask hides it)
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    try:
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    finally:
        tok.padding_side = old_side
        if old_pad is None:
            tok.pad_token = None
    kwargs = dict(do_sample=config.temperature > 0, max_new_tokens=config.max_new_tokens, pad_token_id=pad,
                  eos_token_id=list(target.eos_token_ids))
    if config.temperature > 0:
        kwargs.update(temperature=config.temperature, top_k=0, top_p=1.0)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
    with torch.inference_mode():
        out = target.model.generate(**batch, **kwargs)
    new = out[:, batch["input_ids"].shape[1]:]
    return [tok.decode(row, skip_special_tokens=True) for row in new]


def distill(target, data: DataConfig, out: str | os.PathLike, config: DistillConfig = DistillConfig(),
            server=None) -> pathlib.Path:
    """Regenerate the assistant turns of ``data`` with ``target`` into shards under ``out``.

    ``target``: a loaded Target, or with ``server`` (a :class:`~selfdraft.train.chat_server.ServerConfig`)
    a :class:`TargetText` or a Target (only its tokenizer and identity are used). The server is checked
    before anything is written."""
    from tqdm.auto import tqdm

    from selfdraft.train.data import iter_conversations

    if config.batch_size < 1 or config.shard_size < 1 or config.max_turns < 1 or config.max_new_tokens < 1:
        raise SelfdraftError("distill needs batch_size, shard_size, max_turns and max_new_tokens >= 1")
    if target.tokenizer is None or getattr(target.tokenizer, "chat_template", None) is None:
        raise SelfdraftError(f"target {target.identity.name} has no chat template to render conversations with")
    manifest = {"target": target.identity.to_dict(), "data": to_dict(data), "distill": dataclasses.asdict(config)}
    if server is not None:
        from selfdraft.train.chat_server import ChatServer

        client = ChatServer(server)  # reachable, and which model, before anything is written
        manifest["server"] = {"model": client.model}
        needed = config.max_prompt_tokens + config.max_new_tokens
        if client.context is not None and client.context < needed:
            # vLLM caps max_tokens at what the context leaves, and refuses the request (HTTP 400) when
            # a prompt fills it: a job would fail at its first long conversation, after hours of work.
            raise SelfdraftError(
                f"the server serves {client.model} with a context of {client.context} tokens, fewer than the "
                f"longest prompt distill sends ({config.max_prompt_tokens} tokens, --max-prompt-tokens) plus "
                f"{config.max_new_tokens} new tokens: serve it with --max-model-len {needed} or more (SGLang: "
                "--context-length), or lower --max-prompt-tokens / --max-new-tokens")

        def answer(histories: list[list[dict]], seeds: list[int]) -> list[str]:
            return client.answer_all(histories, max_tokens=config.max_new_tokens, temperature=config.temperature,
                                     seeds=seeds if config.temperature > 0 else [None] * len(histories))
        batch_size = config.shard_size  # a turn's whole shard at once; the server's concurrency bounds it
    else:
        if not hasattr(target, "model"):
            raise SelfdraftError("distilling without a server needs the target's weights: load it with load_target")
        import torch

        generator = torch.Generator().manual_seed(config.seed)

        def answer(histories: list[list[dict]], seeds: list[int]) -> list[str]:
            return _generate(target, histories, config, generator)
        batch_size = config.batch_size
        # The target's dtype decides its greedy answers at near-ties: a resumed run must not mix them.
        manifest["target_dtype"] = str(target.model.dtype).removeprefix("torch.")

    out = pathlib.Path(out)
    if (out / MANIFEST).is_file():
        old = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        if "target_dtype" not in old:  # a manifest from a version that did not record the dtype: not known to differ
            old = {**old, **{k: manifest[k] for k in ("target_dtype",) if k in manifest}}
        if old != manifest:
            changed = sorted(k for k in set(manifest) | set(old) if old.get(k) != manifest.get(k))
            raise SelfdraftError(f"{out} holds a distillation with other settings ({', '.join(changed)} differ): "
                                 "choose another output folder")
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    conversations = iter_conversations(data)
    progress = tqdm(desc="distilling", unit="conv", total=data.max_conversations, disable=None)
    for shard_index in itertools.count():
        chunk = list(itertools.islice(conversations, config.shard_size))
        if not chunk:
            break
        path = out / f"shard-{shard_index:05d}.jsonl"
        if path.is_file():  # finished in an earlier run
            progress.update(len(chunk))
            continue
        records = _distill_chunk(target.tokenizer, chunk, config, answer, batch_size, shard_index, progress)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"messages": r}, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        os.replace(tmp, path)
    progress.close()
    if not any(out.glob("shard-*.jsonl")):
        raise SelfdraftError(f"data source {data.source!r} gave no conversation to distill")
    return out


def _distill_chunk(tokenizer, chunk, config: DistillConfig, respond: Answerer, batch_size: int, shard: int,
                   progress) -> list[list[dict]]:
    histories = _prompts(chunk, config.max_turns)
    results: list[list[dict]] = [[] for _ in histories]
    # Turn by turn: every conversation's context before its next assistant turn, batched.
    cursors = [0] * len(histories)
    while True:
        pending = []
        for i, h in enumerate(histories):
            j = cursors[i]
            while j < len(h) and h[j]["role"] != "assistant":
                results[i].append(h[j])
                j += 1
            cursors[i] = j
            if j < len(h):
                length = len(tokenizer.apply_chat_template(results[i], tokenize=True, add_generation_prompt=True,
                                                           return_dict=False))
                if length <= config.max_prompt_tokens:
                    pending.append(i)
                else:
                    cursors[i] = len(h)
        if not pending:
            break
        for b in range(0, len(pending), batch_size):
            ids = pending[b:b + batch_size]
            turn = [sum(m["role"] == "assistant" for m in results[i]) for i in ids]
            answers = respond([results[i] for i in ids], [_request_seed(config.seed, shard, i, t) for i, t in zip(ids, turn)])
            for i, answer in zip(ids, answers):
                results[i].append({"role": "assistant", "content": answer})
                cursors[i] += 1
    progress.update(len(chunk))
    return [r for r in results if any(m["role"] == "assistant" for m in r)]
