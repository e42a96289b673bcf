"""Greedy acceptance walked on the host (`accept_greedy_host`, what a CPU target runs) chooses what the device's
tensor ops choose (`accept_greedy`): the same path, length and bonus on random trees with repeated tokens, invalid
nodes and several rows; a malformed tree is refused as the engine refuses it; a table it cannot walk is left to
the device's ops."""

from __future__ import annotations

import pytest
import torch

from infer.tree import MALFORMED, DraftTree, malformed_rows
from infer.verify import accept_greedy, accept_greedy_host


def _random_tree(generator: torch.Generator, rows: int, nodes: int, vocab: int) -> DraftTree:
    parents = torch.full((rows, nodes), -1, dtype=torch.long)
    for node in range(1, nodes):
        parents[:, node] = torch.randint(0, node, (rows,), generator=generator)
    tokens = torch.randint(0, vocab, (rows, nodes), generator=generator)  # a small vocabulary: siblings repeat
    valid = torch.ones(rows, nodes, dtype=torch.bool)
    # invalidate whole subtrees (as pruning does), so the tree stays well formed
    dropped = torch.rand(rows, nodes, generator=generator) < 0.2
    dropped[:, 0] = False
    for node in range(1, nodes):
        valid[:, node] = ~dropped[:, node] & valid.gather(1, parents[:, node:node + 1])[:, 0]
    return DraftTree(tokens=tokens, parents=parents, valid=valid)


@pytest.mark.parametrize("seed", range(40))
def test_the_host_walk_chooses_what_the_device_ops_choose(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, nodes, vocab = 1 + seed % 3, 2 + seed % 23, 3
    tree = _random_tree(generator, rows, nodes, vocab)
    logits = torch.randn(rows, nodes, vocab, generator=generator)
    depth, ancestors = tree.structure()
    want = accept_greedy(tree, logits, ancestors, depth)
    got, paths, tokens = accept_greedy_host(tree, logits)
    assert torch.equal(got.length, want.length) and torch.equal(got.bonus, want.bonus)
    for row in range(rows):
        n = int(want.length[row])
        assert paths[row] == want.path[row, :n].tolist()
        assert tokens[row] == tree.tokens[row, want.path[row, 1:n]].tolist() + [int(want.bonus[row])]


def test_a_malformed_tree_is_refused():
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, 1]]),
                     valid=torch.tensor([[True, False, True]]))  # node 2 valid below invalid node 1
    assert malformed_rows(tree.structure()[1], tree.valid).all()
    with pytest.raises(ValueError, match=MALFORMED):
        accept_greedy_host(tree, torch.randn(1, 3, 9))


def test_a_table_it_cannot_walk_is_left_to_the_device_ops():
    later_parent = DraftTree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 2, 0]]),
                             valid=torch.ones(1, 3, dtype=torch.bool))
    no_parent = DraftTree(tokens=torch.tensor([[5, 6]]), parents=torch.tensor([[-1, -1]]),
                          valid=torch.ones(1, 2, dtype=torch.bool))
    assert accept_greedy_host(later_parent, torch.randn(1, 3, 9)) is None
    assert accept_greedy_host(no_parent, torch.randn(1, 2, 9)) is None


def test_a_cpu_target_walks_on_the_host_and_stays_greedy_exact():
    from conftest import tiny_model
    from test_infer import prompts

    from infer import SelfSpecModel

    target = tiny_model("llama")
    ids = torch.tensor(prompts(1))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    model = SelfSpecModel(target, "ngram")
    assert model.plan.host_acceptance
    assert torch.equal(model.generate(ids, max_new_tokens=24), expected)
