"""Packed batches (``train.pack_tokens``): several conversations share a row, positions restart, and
attention stays within each conversation. The losses, statistics and gradients are those of the same
conversations one by one; features and labels stay aligned position by position."""

import numpy as np
import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.errors import SelfdraftError
from selfdraft.train.loop import collate, make_batch, pack_rows


def _conversations(vocab: int, lengths=(40, 17, 29, 8, 33)):
    """Random token ids with a loss mask like a chat's: the first two tokens never supervised."""
    rng = np.random.default_rng(0)
    data = []
    for n in lengths:
        ids = rng.integers(3, vocab, n)
        mask = (rng.random(n) < 0.6).astype(np.int64)
        mask[:2] = 0
        data.append((ids, mask))
    return data


def test_pack_rows_and_collate_by_hand():
    assert pack_rows([5, 3, 4, 2], 0) == [[0], [1], [2], [3]]
    # First-fit decreasing into rows of 8: 5 -> row 0, 4 -> row 1, 3 -> row 0 (5+3), 2 -> row 1 (4+2).
    assert pack_rows([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    data = [(np.array([7, 8, 9, 10, 11]), np.array([0, 0, 1, 1, 1])), (np.array([20, 21, 22]), np.array([0, 0, 1])),
            (np.array([30, 31, 32, 33]), np.array([0, 0, 0, 1])), (np.array([40, 41]), np.array([0, 1]))]
    batch = collate(data, pad_id=0, device="cpu", pack_tokens=8)
    assert batch["input_ids"].tolist() == [[7, 8, 9, 10, 11, 20, 21, 22], [30, 31, 32, 33, 40, 41, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 1], [0, 0, 0, 1, 0, 1, 0, 0]]
    assert "position_ids" not in collate(data, pad_id=0, device="cpu")  # unpacked: the old layout
    with pytest.raises(SelfdraftError, match="does not fit a packed row"):
        pack_rows([9], 8)
    with pytest.raises(SelfdraftError, match="pack_tokens must be 0 .* or at least data.max_length"):
        load_run_config("smoke_cpu", ["data.max_length=128", "train.pack_tokens=100"])


@pytest.fixture(scope="module")
def small_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"
    return model


CASES = {
    "medusa": ["drafter.kind=medusa"],
    "medusa2": ["drafter.kind=medusa", "drafter.medusa.lora.rank=4", "drafter.medusa.lora.lm_loss=kl"],
    "eagle": ["drafter.kind=eagle", "drafter.eagle.feature_noise=0"],
    "eagle3": ["drafter.kind=eagle3", "drafter.eagle.draft_vocab_size=64", "drafter.eagle.ttt_steps=3"],
    "eagle3-one-step": ["drafter.kind=eagle3", "drafter.eagle.draft_vocab_size=64", "drafter.eagle.ttt_steps=1"],
}


def _run(objective, batch):
    objective.zero_grad(set_to_none=True)
    loss, stats = objective(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_packed_batch_gives_the_losses_and_gradients_of_its_conversations_one_by_one(small_model, case):
    import copy

    from selfdraft.train.objectives import build_objective

    data = _conversations(small_model.config.vocab_size)
    config = load_run_config("smoke_cpu", [*CASES[case], "drafter.medusa.position_fraction=1"])
    objective = build_objective(config, copy.deepcopy(small_model), data).train()
    packed = collate(data, 0, "cpu", pack_tokens=128)
    assert packed["input_ids"].shape[0] < len(data)  # several conversations share a row
    loss, stats, grads = _run(objective, packed)
    padded_loss, padded_stats, padded_grads = _run(objective, collate(data, 0, "cpu"))
    # The same batch as padded rows: the same mean loss and gradients (another summation order).
    torch.testing.assert_close(loss, padded_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == padded_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], padded_grads[name], rtol=1e-4, atol=1e-6)
    # One by one: the batch's summed statistics are the sums of each conversation's, and its gradient is
    # the token-weighted mean of theirs (each loss term is a mean over its positions).
    alone = [_run(objective, collate([example], 0, "cpu", pack_tokens=128)) for example in data]
    for key in stats:
        total = sum(s[key] for _, s, _ in alone)
        if key in ("head_tokens", "top1", "topk", "rank_hits", "lm_tokens"):
            assert torch.equal(stats[key], total), key  # counts: exactly
        else:
            torch.testing.assert_close(stats[key], total, rtol=1e-5, atol=1e-6)
    if case in ("eagle", "medusa2"):
        return  # mixed terms (regression + KL, heads + LM loss) have their own token counts
    tokens = torch.stack([s["head_tokens"] for _, s, _ in alone])  # (conversations, K)
    weights = tokens / tokens.sum(0).clamp(min=1)
    checked = 0
    for name, grad in grads.items():
        if name.startswith(("heads.blocks", "heads.lm_heads")):  # head k's parameters: head k's tokens only
            k = int(name.split(".")[2])
        elif case == "eagle3-one-step":  # one loss term: every parameter
            k = 0
        else:
            continue  # EAGLE-3's steps share the drafter, each with its own token count
        want = sum(weights[c, k] * alone[c][2][name] for c in range(len(data)) if name in alone[c][2])
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked or case == "eagle3"


def test_packed_features_and_labels_line_up_position_by_position(small_model):
    """Online packed features equal each conversation's own forward at its positions, and a cache laid
    out packed puts each conversation's features under its own tokens."""
    from selfdraft.train.features import target_features

    data = _conversations(small_model.config.vocab_size)
    layers = [2, 4, 7]
    alone = [target_features(small_model, torch.tensor(ids)[None], torch.ones(1, len(ids), dtype=torch.long), layers)[0]
             for ids, _ in data]

    class Cache:
        def batch(self, split, indices, length, device, dtype=None, placement=None, rows=None):
            from selfdraft.train.features import FeatureCache

            self.get = lambda split, i: alone[i]
            return FeatureCache.batch(self, split, indices, length, device, dtype, placement, rows)

    batch = make_batch(data, [3, 0, 4, 1, 2], 0, "cpu", cache=Cache(), pack_tokens=128)
    args = (small_model, batch["input_ids"], batch["attention_mask"], layers, batch["position_ids"])
    per_conversation = target_features(*args)  # the CPU default: each conversation alone
    online = target_features(*args, per_conversation=False)  # the GPU default: a forward per packed row
    starts = (batch["position_ids"] == 0) & (batch["attention_mask"] == 1)
    seen = []
    for r, t in starts.nonzero().tolist():
        ids = batch["input_ids"][r, t:]
        c = next(c for c, (x, _) in enumerate(data) if len(x) <= len(ids) and torch.equal(ids[:len(x)], torch.tensor(x)))
        n = len(data[c][0])
        seen.append(c)
        assert torch.equal(batch["loss_mask"][r, t:t + n], torch.tensor(data[c][1]))
        assert batch["position_ids"][r, t:t + n].tolist() == list(range(n))
        assert torch.equal(batch["features"][r, t:t + n], alone[c])  # the cache: exactly its own features
        assert torch.equal(per_conversation[r, t:t + n], alone[c])  # the same forwards: the same bits
        torch.testing.assert_close(online[r, t:t + n], alone[c], rtol=1e-5, atol=1e-5)  # one per row: to rounding
    assert sorted(seen) == list(range(len(data)))
    assert float(batch["features"][batch["attention_mask"] == 0].abs().sum()) == 0
    assert float(online[batch["attention_mask"] == 0].abs().sum()) == 0
    assert float(per_conversation[batch["attention_mask"] == 0].abs().sum()) == 0


def test_a_packed_run_follows_the_unpacked_one_and_logs_its_learning_curve(tiny_target, tmp_path):
    """The same data order packed: every batch's losses and gradients agree to rounding, so after a few
    Adam steps the drafter agrees closely; held-out evaluations log top-1 by depth and the acceptance
    length they predict for the run's tree, which the plot and learning-curve table show."""
    import json

    from selfdraft.train.loop import train
    from selfdraft.train.plots import learning_curve_table

    def config(out, *more):
        return load_run_config("smoke_cpu", [
            f"target.spec={tiny_target}", f"train.output_dir={out}", "data.max_conversations=24", "data.max_length=64",
            "data.eval_fraction=0.2", "train.micro_batch_size=4", "train.max_steps=4", "train.eval_every=2",
            "train.eval_batches=2", "train.log_every=1", "drafter.kind=eagle3", "drafter.eagle.draft_vocab_size=512", *more])

    plain = train(config(tmp_path / "plain"))
    packed = train(config(tmp_path / "packed", "train.pack_tokens=256"))
    a, b = plain.objective.trainable_state_dict(), packed.objective.trainable_state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)
    rows = [json.loads(line) for line in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    taus = [r["eval/predicted_tau"] for r in rows if "eval/predicted_tau" in r]
    assert len(taus) == 2 and all(1.0 <= t <= 5.0 for t in taus)  # a 4-node tree: at most 1 + 4 tokens
    assert packed.last_eval["eval/top1/head0"] == pytest.approx(plain.last_eval["eval/top1/head0"], abs=0.02)
    table = learning_curve_table(tmp_path / "packed" / "metrics.jsonl")
    assert table.count("\n") == 3 and "top-1 depth 3" in table
    assert (tmp_path / "packed" / "training.png").is_file()
