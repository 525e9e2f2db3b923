"""Tree buffers, tree attention and KV compaction against brute force (each path run alone).

The model runs on ``SELFDRAFT_TEST_DEVICE`` (the ``test_device`` fixture, default cpu); trees and their
buffers are host-side structure on any device.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfdraft.heads.target_layers import TargetLayers
from selfdraft.inference.session import CausalLMSession
from selfdraft.inference.tree import DraftTree, build_tree_buffers
from selfdraft.inference.verify import greedy_verify

# Node i's parent in a small hand-drawn tree:
#   root -> 0 -> 2 -> 5
#        |    -> 3
#        -> 1 -> 4
PARENTS = [-1, -1, 0, 0, 1, 2]


def tiny_llama(device, seed=0, vocab=61, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval().to(device)


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0]


def test_buffers_of_a_hand_drawn_tree():
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor(PARENTS))
    b = build_tree_buffers(tree)
    assert b.size == 7 and b.max_depth == 3
    assert b.depths == (0, 1, 1, 2, 2, 2, 3)
    assert b.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert b.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    # Position 6 (node 5) sees root, node 0 (pos 1), node 2 (pos 3) and itself.
    assert torch.nonzero(b.ancestors[6]).flatten().tolist() == [0, 1, 3, 6]
    assert b.ancestors.tril().equal(b.ancestors) and b.ancestors.device.type == "cpu"
    assert b.paths == ((0, 1, 4), (0, 2, 5), (0, 1, 3, 6))  # leaves in position order
    assert not b.is_chain
    assert build_tree_buffers(DraftTree.chain([3, 4, 5])).is_chain
    assert build_tree_buffers(DraftTree.empty()).paths == ((0,),)
    assert tree.token_ids == (10, 11, 12, 13, 14, 15) and tree.parent_ids == tuple(PARENTS)


def test_from_paths_merges_prefixes_and_prune_keeps_a_tree():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [5], [1, 6]])
    assert tree.tokens.tolist() == [1, 5, 2, 6, 3, 4]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2, 2]
    pruned = tree.prune(max_depth=2, max_nodes=3)
    assert pruned.tokens.tolist() == [1, 5, 2] and pruned.parents.tolist() == [-1, -1, 0]
    assert tree.prune(max_depth=0, max_nodes=5).num_nodes == 0
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    assert DraftTree.from_lists([1, 2], [-1, 0]).tokens.tolist() == [1, 2]
    with pytest.raises(ValueError, match="host-side"):
        DraftTree(torch.tensor([1], device="meta"), torch.tensor([-1], device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_is_additive_float_on_the_device(test_device, dtype):
    """The verify forward's mask (heads/target_layers.py, full attention): 5 cached tokens, then the root
    and a 3-node tree whose second node is a sibling of the first."""
    b = build_tree_buffers(DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0])))
    layers = TargetLayers(family="toy", rules=(("", "full", 0),), keyed=False, recurrent=False, trees=True,
                          backend="sdpa")
    ancestors = b.ancestors.to(test_device)
    visible = torch.cat([ancestors.new_ones(4, 5), ancestors], dim=1)[None]  # (1, 4, 9)
    queries = (5 + torch.tensor(b.depths, device=test_device))[None]
    keys = torch.cat([torch.arange(5, device=test_device)[None], queries], dim=1)
    mask = layers.masks(visible, queries, keys, dtype)
    assert mask.shape == (1, 1, 4, 9) and mask.dtype == dtype and mask.device.type == test_device.type
    mask = mask.cpu()
    assert (mask[0, 0, :, :5] == 0).all()
    assert mask[0, 0, 3, 5 + 2] == torch.finfo(dtype).min  # node 2 (pos 3) does not see node 1 (pos 2)
    assert mask[0, 0, 3, 5 + 1] == 0


PROMPT = [5, 9, 2, 33, 7, 1, 40, 12]


def verify_a_tree(parents, device):
    """Prefill PROMPT minus its last token, then verify that token as the root of a tree with the
    given parents (tokens 20, 21, ...). Returns (model, session, tokens, buffers, step output)."""
    model = tiny_llama(device)
    tokens = torch.arange(20, 20 + len(parents))
    tree = DraftTree(tokens, torch.tensor(parents))
    b = build_tree_buffers(tree)
    session = CausalLMSession(model)
    session.prefill(PROMPT[:-1])
    return model, session, tokens, b, session.verify(PROMPT[-1], tree, b)


@pytest.mark.parametrize(
    "parents",
    [PARENTS, [-1, 0, 1, 2], [-1, -1, -1, 0, 0, 1, 3, 3, 6], [-1]],
    ids=["hand", "chain", "wide", "single"],
)
def test_tree_logits_equal_each_path_alone(parents, test_device):
    model, session, tokens, b, out = verify_a_tree(parents, test_device)
    for pos in range(b.size):
        path = torch.nonzero(b.ancestors[pos]).flatten().tolist()
        ids = PROMPT + [int(tokens[p - 1]) for p in path[1:]]
        ref = full_logits(model, ids)[-1]
        torch.testing.assert_close(out.logits[pos], ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("accepted", [[], [1], [1, 3, 6], [2, 5], [1, 4]])
def test_compaction_leaves_the_cache_of_the_accepted_path(accepted, test_device):
    model, session, tokens, b, _ = verify_a_tree(PARENTS, test_device)
    session.commit([0] + accepted)
    kept = PROMPT + [int(tokens[p - 1]) for p in accepted]
    assert session.length == len(kept)

    alone = CausalLMSession(model)
    alone.prefill(kept)
    for mine, ref in zip(session.cache.layers, alone.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=2e-5, rtol=1e-5)
    # And decoding goes on as if the path had been fed alone.
    nxt = session.verify(3, DraftTree.chain([4, 8]), build_tree_buffers(DraftTree.chain([4, 8])))
    torch.testing.assert_close(nxt.logits, full_logits(model, kept + [3, 4, 8])[-3:], atol=2e-5, rtol=1e-5)


def scripted_logits(argmax_per_position, device, vocab=10):
    logits = torch.zeros(len(argmax_per_position), vocab, device=device)
    logits[torch.arange(len(argmax_per_position), device=device), torch.tensor(argmax_per_position, device=device)] = 1.0
    return logits


def test_greedy_verify_on_scripted_targets(test_device):
    def scripted(argmax_per_position):
        return scripted_logits(argmax_per_position, test_device)

    chain = DraftTree.chain([1, 2, 3, 4, 5])
    b = build_tree_buffers(chain)
    # Target always agrees: every draft token accepted, bonus is the argmax after the last.
    assert greedy_verify(scripted([1, 2, 3, 4, 5, 6]), chain.tokens, b) == ([1, 2, 3, 4, 5], 6)
    # Never agrees: nothing accepted, bonus is the root's argmax.
    assert greedy_verify(scripted([9, 2, 3, 4, 5, 6]), chain.tokens, b) == ([], 9)
    # Accepts 2 of 5.
    assert greedy_verify(scripted([1, 2, 0, 4, 5, 6]), chain.tokens, b) == ([1, 2], 0)
    # A tree: the matching branch is the second child of the root.
    tree = DraftTree(torch.tensor([1, 7, 2, 3, 8, 9]), torch.tensor(PARENTS))
    tb = build_tree_buffers(tree)
    #            root node0 node1 node2 node3 node4 node5
    assert greedy_verify(scripted([7, 0, 8, 0, 0, 5, 0]), tree.tokens, tb) == ([2, 5], 5)
    assert greedy_verify(scripted([1, 3, 0, 0, 6, 0, 0]), tree.tokens, tb) == ([1, 4], 6)
    # Duplicate siblings: the longer matching path wins, whichever duplicate it hangs below.
    dup = DraftTree.from_lists([1, 1, 2], [-1, -1, 1])
    assert greedy_verify(scripted([1, 5, 2, 4]), dup.token_ids, build_tree_buffers(dup)) == ([2, 3], 4)
