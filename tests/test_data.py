"""Training data: reading sources, the assistant-only loss mask on the real chat template, the split."""

import dataclasses
import json

import pytest

from selfdraft.configs.schema import DataConfig
from selfdraft.errors import SelfdraftError
from selfdraft.train import data
from selfdraft.train.data import ReadStats, build_datasets, iter_conversations, render

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?\nJust the number."},
    {"role": "assistant", "content": " 4\n\n(four)"},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer alone (conftest: no weights loaded)."""
    return smollm2_tokenizer


@pytest.mark.embedded
def test_the_tokenizer_read_from_the_gguf_is_the_converted_targets(smollm2_tokenizer, tmp_path):
    """The tokenizer-only fixture reads the GGUF's tokenizer where no converted folder exists yet: that is
    the converted target's own tokenizer (vocabulary, special tokens, chat template)."""
    from transformers import AutoTokenizer

    from selfdraft.heads.target import BUILTIN_TARGETS, _builtin_sources, load_target_tokenizer, tokenizer_fingerprint

    (gguf,) = _builtin_sources(BUILTIN_TARGETS["smollm2-135m"])
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path)
    from_gguf = AutoTokenizer.from_pretrained(tmp_path)
    converted, identity = load_target_tokenizer("smollm2-135m")
    assert tokenizer_fingerprint(from_gguf) == tokenizer_fingerprint(smollm2_tokenizer) == identity.tokenizer_hash
    assert from_gguf.chat_template == converted.chat_template == smollm2_tokenizer.chat_template


def sharegpt_record(i, n_turns=2):
    turns = [{"from": "human" if t % 2 == 0 else "gpt", "value": f"turn {t} of conversation {i}"}
             for t in range(n_turns)]
    return {"id": f"c{i}", "conversations": turns}


def messages_record(i):
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": f"answer {i}"}]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mask_spans(ids, mask):
    """Runs of consecutive masked token ids."""
    spans, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


# ---------------------------------------------------------------- the loss mask, token by token


@pytest.mark.embedded
def test_loss_mask_covers_exactly_assistant_content_and_end_of_turn(tokenizer):
    ids, mask = render(tokenizer, TWO_TURNS, max_length=4096)
    assert ids == tokenizer.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spans = mask_spans(ids, mask)
    assert [tokenizer.decode(s) for s in spans] == [
        "Hello! How can I help?<|im_end|>", " 4\n\n(four)<|im_end|>"]
    for span in spans:
        assert span[-1] == im_end and im_end not in span[:-1]
    # Token by token: every unmasked token is system, user, a header or a separator.
    unmasked = tokenizer.decode([t for t, bit in zip(ids, mask) if not bit])
    assert unmasked == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                        "<|im_start|>assistant\n\n<|im_start|>user\nWhat is 2+2?\nJust the number.<|im_end|>\n"
                        "<|im_start|>assistant\n\n")
    # The masked tokens are the assistant contents tokenised alone (no merge across a boundary).
    for span, message in zip(spans, [TWO_TURNS[2], TWO_TURNS[4]]):
        alone = tokenizer(message["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        assert span == alone


@pytest.mark.embedded
def test_default_system_prompt_and_leading_assistant_turn_are_not_trained(tokenizer):
    messages = [{"role": "assistant", "content": "...continued from before."},
                {"role": "user", "content": "Thanks. And then?"},
                {"role": "assistant", "content": "Then it ends."}]
    ids, mask = render(tokenizer, messages, max_length=4096)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert "SmolLM" in tokenizer.decode(ids)  # the template inserted its default system prompt
    assert [tokenizer.decode(s) for s in mask_spans(ids, mask)] == ["Then it ends.<|im_end|>"]


@pytest.mark.embedded
def test_truncation_keeps_the_mask_aligned(tokenizer):
    full_ids, full_mask = render(tokenizer, TWO_TURNS, max_length=4096)
    for max_length in (1, 5, 20, 23, 24, 30, len(full_ids) - 1, len(full_ids), len(full_ids) + 10):
        ids, mask = render(tokenizer, TWO_TURNS, max_length=max_length)
        assert ids == full_ids[:max_length] and mask == full_mask[:max_length]


@pytest.mark.embedded
def test_template_that_is_not_prefix_consistent_is_refused(tokenizer):
    import copy

    counting = copy.deepcopy(tokenizer)  # a template whose first line depends on the whole conversation
    counting.chat_template = ("{{ messages | length }} turns\n{% for m in messages %}<|im_start|>{{ m.role }}\n"
                              "{{ m.content }}<|im_end|>\n{% endfor %}"
                              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(SelfdraftError, match="not prefix-consistent"):
        render(counting, TWO_TURNS, max_length=4096)


# ---------------------------------------------------------------- the embedded ShareGPT file


def test_embedded_sharegpt_streams_the_first_conversations_quickly():
    stats = ReadStats()
    conversations = list(iter_conversations(DataConfig(max_conversations=50), stats))
    assert len(conversations) == stats.conversations == 50
    assert not stats.truncated_tail  # stopped long before the cut-off end
    first = conversations[0]
    assert first[0]["role"] == "user" and first[0]["content"].startswith("Summarize the main ideas of Jeff Walker")
    assert first[1]["role"] == "assistant"
    for conversation in conversations:
        assert {m["role"] for m in conversation} <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conversation)
        assert any(m["role"] == "assistant" for m in conversation)


def test_embedded_sharegpt_recovers_every_complete_record():
    stats = ReadStats()
    count = sum(1 for _ in iter_conversations(DataConfig(), stats))  # ~0.7 s for the 125 MB file
    assert stats.records == 17671 and stats.truncated_tail
    assert count == stats.conversations == stats.records - stats.skipped_no_assistant


# ---------------------------------------------------------------- files and folders


def test_jsonl_messages_file(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [messages_record(i) for i in range(3)])
    conversations = list(iter_conversations(DataConfig(source=str(path))))
    assert conversations[2] == [{"role": "user", "content": "question 2"},
                                {"role": "assistant", "content": "answer 2"}]


def test_sharegpt_json_file_maps_roles_and_drops_empty_turns(tmp_path):
    record = {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                                {"from": "chatgpt", "value": "   "}, {"from": "bard", "value": "a"},
                                {"from": "human", "value": "q2"}, {"from": "bing", "value": "a2"}]}
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([record, sharegpt_record(1)], indent=2))
    stats = ReadStats()
    first, second = iter_conversations(DataConfig(source=str(path), format="sharegpt"), stats)
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in first] == ["sys", "q", "a", "q2", "a2"]
    assert second[1] == {"role": "assistant", "content": "turn 1 of conversation 1"}
    assert stats.empty_turns == 1


def test_reader_is_exact_across_chunk_boundaries(tmp_path, monkeypatch):
    records = [sharegpt_record(i, n_turns=2 + i % 3) for i in range(40)]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    write_jsonl(tmp_path / "b.jsonl", records)
    expected = list(iter_conversations(DataConfig(source=str(tmp_path / "a.json"))))
    monkeypatch.setattr(data, "_CHUNK_CHARS", 7)
    for name in ("a.json", "b.jsonl"):
        assert list(iter_conversations(DataConfig(source=str(tmp_path / name)))) == expected


def test_hf_dataset_folders_load(tmp_path):
    import datasets

    datasets.Dataset.from_list([sharegpt_record(i) for i in range(4)]).save_to_disk(tmp_path / "sg")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([messages_record(i) for i in range(3)])}
                         ).save_to_disk(tmp_path / "msgs")
    sharegpt = list(iter_conversations(DataConfig(source=str(tmp_path / "sg"))))
    messages = list(iter_conversations(DataConfig(source=str(tmp_path / "msgs"), max_conversations=2)))
    assert len(sharegpt) == 4 and sharegpt[3][0] == {"role": "user", "content": "turn 0 of conversation 3"}
    assert messages == [messages_record(i)["messages"] for i in range(2)]


def test_conversations_without_an_assistant_turn_are_skipped_and_counted(tmp_path):
    records = [messages_record(0), {"messages": [{"role": "user", "content": "alone"}]},
               {"messages": [{"role": "assistant", "content": "no prompt"}, {"role": "user", "content": "q"}]},
               messages_record(3)]
    stats = ReadStats()
    got = list(iter_conversations(DataConfig(source=str(write_jsonl(tmp_path / "m.jsonl", records))), stats))
    assert got == [messages_record(0)["messages"], messages_record(3)["messages"]]
    assert (stats.records, stats.skipped_no_assistant, stats.leading_assistant_turns) == (4, 2, 1)


# ---------------------------------------------------------------- errors


def test_malformed_record_names_file_and_index(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [messages_record(0), {"text": "no messages"}, messages_record(2)])
    with pytest.raises(SelfdraftError, match=r"bad\.jsonl: record 1: expected a 'messages' list"):
        list(iter_conversations(DataConfig(source=str(bad), format="messages")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(messages_record(0)) + "\n{\"messages\": [oops]}\n")
    with pytest.raises(SelfdraftError, match=r"broken\.jsonl: record 1 \(line 2\) is not valid JSON"):
        list(iter_conversations(DataConfig(source=str(broken))))
    not_mapping = write_jsonl(tmp_path / "list.jsonl", [messages_record(0), ["a", "b"]])
    with pytest.raises(SelfdraftError, match=r"list\.jsonl: record 1: expected a mapping"):
        list(iter_conversations(DataConfig(source=str(not_mapping))))
    number = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": 3}]}])
    with pytest.raises(SelfdraftError, match=r"record 0: turn 0 'content' must be a string"):
        list(iter_conversations(DataConfig(source=str(number))))


def test_unknown_role_is_an_error(tmp_path):
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "x"}]}
    path = tmp_path / "roles.json"
    path.write_text(json.dumps([sharegpt_record(0), record]))
    with pytest.raises(SelfdraftError, match=r"roles\.json: record 1: turn 1 has unknown role 'tool'"):
        list(iter_conversations(DataConfig(source=str(path))))
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "human", "content": "q"}]}])
    with pytest.raises(SelfdraftError, match="unknown role 'human'"):
        list(iter_conversations(DataConfig(source=str(path))))


def test_undetectable_layout_truncated_user_file_and_bad_paths(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(SelfdraftError, match="record 0 has neither"):
        list(iter_conversations(DataConfig(source=str(path))))
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps([sharegpt_record(0), sharegpt_record(1)])[:-30])
    with pytest.raises(SelfdraftError, match=r"cut\.json: record 1 .*not valid JSON"):
        list(iter_conversations(DataConfig(source=str(cut))))  # only the embedded file may be cut short
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    with pytest.raises(SelfdraftError, match="not a dataset"):
        list(iter_conversations(DataConfig(source=str(tmp_path / "folder"))))
    with pytest.raises(SelfdraftError, match="path not found"):
        list(iter_conversations(DataConfig(source=str(tmp_path / "missing.jsonl"))))


@pytest.mark.embedded
def test_empty_sources_are_errors(tokenizer, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert list(iter_conversations(DataConfig(source=str(empty)))) == []
    with pytest.raises(SelfdraftError, match=r"empty\.jsonl.*no usable conversation: 0 records read"):
        build_datasets(DataConfig(source=str(empty)), tokenizer)
    (tmp_path / "empty.json").write_text("[ ]")
    with pytest.raises(SelfdraftError, match="0 records read"):
        build_datasets(DataConfig(source=str(tmp_path / "empty.json")), tokenizer)
    only_users = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(SelfdraftError, match="3 records read, 3 without an assistant turn"):
        build_datasets(DataConfig(source=str(only_users)), tokenizer)


# ---------------------------------------------------------------- build_datasets


@pytest.mark.embedded
def test_build_datasets_split_is_deterministic_and_complete(tokenizer, tmp_path):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [messages_record(i) for i in range(20)] + [long_prompt])
    config = DataConfig(source=str(path), max_length=64, eval_fraction=0.2, seed=3)
    train, evaluation = build_datasets(config, tokenizer)
    assert set(train.column_names) == set(evaluation.column_names) == {"input_ids", "loss_mask", "length"}
    assert (len(train), len(evaluation)) == (16, 4)  # the long prompt leaves no assistant token in 64
    for row in list(train) + list(evaluation):
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["length"] <= 64
        assert any(row["loss_mask"])
    rendered = {tuple(render(tokenizer, messages_record(i)["messages"], 64)[0]) for i in range(20)}
    assert {tuple(r) for r in list(train["input_ids"]) + list(evaluation["input_ids"])} == rendered

    again_train, again_eval = build_datasets(config, tokenizer)
    assert list(again_train["input_ids"]) == list(train["input_ids"])
    assert list(again_eval["input_ids"]) == list(evaluation["input_ids"])
    pooled_train, pooled_eval = build_datasets(config, tokenizer, processes=2)  # rendered by 2 worker processes
    assert list(pooled_train["input_ids"]) == list(train["input_ids"])
    assert list(pooled_eval["loss_mask"]) == list(evaluation["loss_mask"])
    reseeded = [build_datasets(dataclasses.replace(config, seed=seed), tokenizer)[1]["input_ids"] for seed in (4, 5)]
    reseeded = [list(ids) for ids in reseeded]
    assert any(ids != list(evaluation["input_ids"]) for ids in reseeded)  # the seed matters

    tiny = DataConfig(source=str(path), max_length=64, eval_fraction=0.0, max_conversations=2)
    assert [len(d) for d in build_datasets(tiny, tokenizer)] == [1, 1]  # at least one eval example
    one = DataConfig(source=str(path), max_length=64, max_conversations=1)
    assert [len(d) for d in build_datasets(one, tokenizer)] == [1, 0]


def test_conversations_for_counts_the_ones_rendering_drops(tokenizer, tmp_path):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    records = [messages_record(0), long_prompt, messages_record(1), long_prompt, long_prompt, messages_record(2)]
    config = DataConfig(source=str(write_jsonl(tmp_path / "d.jsonl", records)), max_length=64, eval_fraction=0.0,
                        max_conversations=1)  # the config's own limit is not the question asked
    assert [data.conversations_for(config, tokenizer, n) for n in (0, 1, 2, 3)] == [0, 1, 3, 6]
    assert data.conversations_for(config, tokenizer, 4) is None  # the source has only 3
    for usable in (1, 2, 3):  # asking for that many renders exactly `usable` conversations
        asked = dataclasses.replace(config, max_conversations=data.conversations_for(config, tokenizer, usable))
        assert sum(len(split) for split in build_datasets(asked, tokenizer)) == usable


@pytest.mark.embedded
def test_eval_source_is_the_held_out_split_whatever_the_training_data(tokenizer, tmp_path):
    """With data.eval_source every conversation of the source trains, and runs over different amounts
    (or kinds) of training data are scored on the same held-out conversations."""
    source = write_jsonl(tmp_path / "train.jsonl", [messages_record(i) for i in range(12)])
    held = write_jsonl(tmp_path / "held.jsonl", [sharegpt_record(100 + i) for i in range(3)])
    splits = [build_datasets(DataConfig(source=str(source), max_length=64, max_conversations=m,
                                        eval_source=str(held)), tokenizer) for m in (5, 12)]
    expected = [render(tokenizer, messages_record(i)["messages"], 64)[0] for i in range(12)]
    for (train, evaluation), m in zip(splits, (5, 12)):
        assert [list(r) for r in train["input_ids"]] == expected[:m]  # all of it, in source order
        assert len(evaluation) == 3
    assert list(splits[0][1]["input_ids"]) == list(splits[1][1]["input_ids"])
    with pytest.raises(SelfdraftError, match="no usable conversation"):
        build_datasets(DataConfig(source=str(source), eval_source=str(write_jsonl(tmp_path / "e.jsonl", []))), tokenizer)
