import numpy as np
import pytest

from ogspo.engine.tree import (
    DraftTree,
    Structure,
    ancestor_matrix,
    children_lists,
    leaf_paths,
    node_rank_paths,
    select_top_nodes,
    tree_positions,
)

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3])
DEPTHS = np.array([0, 1, 1, 2, 2, 2, 3])
RANKS = np.array([0, 0, 1, 0, 1, 0, 0])


def test_ancestor_matrix_hand_made():
    anc = ancestor_matrix(PARENTS, DEPTHS)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    for i, row in expected.items():
        assert set(np.nonzero(anc[i])[0]) == row


def test_positions_paths_children():
    assert tree_positions(DEPTHS, 10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert node_rank_paths(PARENTS, RANKS) == [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert leaf_paths(PARENTS) == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert children_lists(PARENTS, RANKS)[1] == [3, 4]


def test_add_children_and_subset():
    t = DraftTree.from_root(7)
    a = t.add_children(parents=np.array([0, 0]), tokens=np.array([1, 2]), ranks=np.array([0, 1]),
                       logq=np.log([0.6, 0.3]), entropy=np.zeros(2))
    t.add_children(parents=np.array([a[0], a[1]]), tokens=np.array([3, 4]), ranks=np.array([0, 0]),
                   logq=np.log([0.5, 0.5]), entropy=np.zeros(2))
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    np.testing.assert_allclose(t.cum_logq[3], np.log(0.3))
    sub, keep = t.subset(np.array([0, 1, 3]))
    assert sub.tokens.tolist() == [7, 1, 3] and sub.parents.tolist() == [-1, 0, 1] and keep.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="ancestor-closed"):
        t.subset(np.array([0, 3]))


def test_structure_validation_and_nesting():
    s = Structure([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    assert s.level_sizes() == [2, 2, 1]
    assert s.n_children[()] == 2 and s.n_children[(0,)] == 2
    assert len(s.up_to(2)) == 4
    with pytest.raises(ValueError, match="ancestor-closed"):
        Structure([(0,), (1, 0)])
    with pytest.raises(ValueError, match="left-closed"):
        Structure([(0,), (2,)])
    assert len(Structure.full([3, 2])) == 9
    assert Structure.chain(3).to_list() == [[0], [0, 0], [0, 0, 0]]


def test_select_top_nodes_is_ancestor_closed():
    cum = np.array([0.0, -0.1, -1.0, -0.2, -3.0, -0.3, -0.25])
    keep = select_top_nodes(PARENTS, DEPTHS, cum, 3)
    assert keep.tolist() == [0, 1, 3, 6]
    keep = select_top_nodes(PARENTS, DEPTHS, cum, 4)
    assert set(keep.tolist()) == {0, 1, 3, 6, 2}
