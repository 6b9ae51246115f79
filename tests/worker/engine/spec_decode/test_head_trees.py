"""Draft trees and the draft vocabulary of the head proposers (spec_decode/head_trees.py)."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from worker.engine.executor.layers.attention.tree import tree_path
from worker.engine.spec_decode.head_trees import DraftLMHead, best_nodes, product_tree, reindex
from worker.engine.spec_decode.heads.storage import load_draft_vocab, save_draft_vocab


def _path_scores(tokens, parents, table):
    """Each node's path as tokens and its summed log-probability under ``table[depth][token]``."""
    result = {}
    for node in range(len(tokens)):
        path = tree_path(parents, node)
        result[tuple(tokens[n] for n in path)] = sum(table[d][tokens[n]] for d, n in enumerate(path))
    return result


def test_product_tree_keeps_the_likeliest_paths_of_the_cartesian_product():
    torch.manual_seed(0)
    num_heads, width, num_nodes = 3, 3, 7
    logprobs = torch.log_softmax(torch.randn(num_heads, 20), dim=-1)
    values, ids = logprobs.topk(width, dim=-1)
    tokens, parents = product_tree(values, ids, num_nodes)
    assert len(tokens) == num_nodes
    assert all(-1 <= p < i for i, p in enumerate(parents))
    table = {d: dict(zip(ids[d].tolist(), values[d].tolist())) for d in range(num_heads)}
    kept = _path_scores(tokens, parents, table)
    # Every path prefix of the product, scored; the kept ones are the best num_nodes.
    every = {}
    for depth in range(1, num_heads + 1):
        for combo in itertools.product(*[ids[d].tolist() for d in range(depth)]):
            every[combo] = sum(table[d][t] for d, t in enumerate(combo))
    best = sorted(every.values(), reverse=True)[:num_nodes]
    assert sorted(kept.values(), reverse=True) == pytest.approx(best)
    # Siblings come likeliest first.
    for parent in set(parents):
        children = [i for i, p in enumerate(parents) if p == parent]
        depth = len(tree_path(parents, children[0])) - 1
        scores = [table[depth][tokens[c]] for c in children]
        assert scores == sorted(scores, reverse=True)


def test_best_nodes_keep_parents_and_order():
    tokens = [5, 6, 7, 8, 9]
    parents = [-1, -1, 0, 0, 2]
    scores = [-0.1, -2.0, -0.1, -1.0, -0.5]  # node 2 ties its parent (probability 1)
    kept = best_nodes(scores, parents, 3)
    assert kept == [0, 2, 4]
    assert reindex(kept, tokens, parents) == ([5, 7, 9], [-1, 0, 1])


def test_draft_vocab_subset_logits_and_top_k():
    vocab, hidden = 50, 8
    torch.manual_seed(1)
    weight = torch.randn(vocab, hidden)
    target = SimpleNamespace(
        config=SimpleNamespace(vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=True),
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight)),
        compute_logits=lambda x: (x @ weight.T).float(),
    )
    subset = torch.tensor([3, 7, 11, 20, 41])
    features = torch.randn(2, hidden)
    full = DraftLMHead(target, None)
    assert full.num_rows == vocab
    assert torch.equal(full.logits(features), features @ weight.T)
    lm = DraftLMHead(target, subset)
    assert lm.num_rows == 5
    logits = lm.logits(features)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[subset] = False
    assert torch.isinf(logits[:, outside]).all()
    assert torch.allclose(logits[:, subset], features @ weight[subset].T)
    values, ids = lm.top_k(features, 2)
    expected = torch.log_softmax(logits, dim=-1).topk(2, dim=-1)
    assert torch.equal(ids, expected.indices)
    assert torch.allclose(values, expected.values)


def test_draft_vocab_is_the_most_frequent_tokens(tmp_path):
    sequences = [torch.tensor([1, 1, 1, 2, 2, 9]), torch.tensor([9, 9, 9, 4])]
    save_draft_vocab(tmp_path, sequences, 2)
    assert load_draft_vocab(tmp_path).tolist() == [1, 9]
    save_draft_vocab(tmp_path, sequences, 100)  # fewer distinct tokens than asked
    assert load_draft_vocab(tmp_path).tolist() == [1, 2, 4, 9]
    assert load_draft_vocab(tmp_path / "none") is None
