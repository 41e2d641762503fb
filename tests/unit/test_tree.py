import torch

from agentspec.tree import ancestor_matrix, depths, tree_attention_mask, tree_position_ids

PARENTS = (-1, -1, 0, 0, 1, 4)  # 0 -> {2, 3}; 1 -> 4 -> 5


def test_depths():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3]


def test_ancestor_matrix():
    m = ancestor_matrix(PARENTS)
    assert m[5].nonzero()[0].tolist() == [1, 4, 5]
    assert m[3].nonzero()[0].tolist() == [0, 3]
    assert m[0].nonzero()[0].tolist() == [0]


def test_mask_shape_and_visibility():
    mask = tree_attention_mask(PARENTS, past_len=3, device="cpu")
    assert mask.shape == (1, 1, 7, 10) and mask.dtype == torch.bool
    rows = mask[0, 0]
    assert rows[0].tolist() == [True] * 4 + [False] * 6  # the root sees only the past and itself
    assert rows[6].tolist() == [True] * 4 + [False, True, False, False, True, True]  # node 5


def test_positions():
    assert tree_position_ids(PARENTS, 10, "cpu").tolist() == [[10, 11, 11, 12, 12, 12, 13]]


def test_chain_mask_is_causal():
    mask = tree_attention_mask((-1, 0, 1), past_len=2, device="cpu")[0, 0]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(mask[:, 2:], causal)


def test_node_support_counts_the_continuations_through_each_node():
    from agentspec.tree import merge_chains, node_support

    conts = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 9], [5]]
    ids, parents, _ = merge_chains([(c, "x") for c in conts], max_nodes=64)
    support = dict(zip(zip(parents, ids, strict=True), node_support(ids, parents, conts), strict=True))
    assert support == {(-1, 1): 3, (0, 2): 3, (1, 3): 2, (1, 4): 1, (2, 9): 1, (-1, 5): 1}
    # Cut by a node budget: the kept nodes keep their counts; a node no continuation reaches
    # (none here) would count as its own one.
    ids, parents, _ = merge_chains([(c, "x") for c in conts], max_nodes=3)
    assert node_support(ids, parents, conts) == (3, 3, 2)
    assert node_support((7,), (-1,), []) == (1,)
