"""GTO's objective: the Draft Tree Reward, group advantages and the clipped surrogate, against hand
computations."""

import math

import numpy as np
import pytest
import torch

from ogspo.drafter.gto import branch_values, clipped_surrogate, group_advantages, tree_reward


def test_draft_tree_reward_equals_a_hand_computation():
    # root -> a (0.5) -> c (0.4), root -> b (0.3), a -> d (0.2)
    parents = np.array([-1, 0, 0, 1, 1])
    p = np.array([1.0, 0.5, 0.3, 0.4, 0.2])
    leaves, L = branch_values(parents, p)
    assert leaves.tolist() == [2, 3, 4]
    np.testing.assert_allclose(L, [0.3, 0.5 + 0.5 * 0.4, 0.5 + 0.5 * 0.2])
    want = math.log(math.exp(0.3) + math.exp(0.7) + math.exp(0.6))
    assert tree_reward(parents, p) == pytest.approx(want)
    assert tree_reward(parents, p, eta=50.0) == pytest.approx(0.7, abs=1e-3)  # eta -> inf: the best branch
    assert tree_reward(np.array([-1]), np.array([1.0])) == 0.0


def test_draft_tree_reward_is_invariant_to_sibling_order():
    parents = np.array([-1, 0, 0, 1, 1, 2])
    p = np.array([1.0, 0.6, 0.3, 0.5, 0.1, 0.9])
    # the same tree with the root's children and node 1's children listed the other way round
    swapped_parents = np.array([-1, 0, 0, 1, 2, 2])  # 1 <- old 2, 2 <- old 1; 3 <- old 5, 4 <- old 4, 5 <- old 3
    swapped_p = np.array([1.0, 0.3, 0.6, 0.9, 0.1, 0.5])
    assert tree_reward(parents, p) == pytest.approx(tree_reward(swapped_parents, swapped_p))


def test_group_advantages_and_clipped_loss_match_a_worked_example():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    reference = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    A = group_advantages(rewards, reference, delta=1e-2)
    std = math.sqrt(((np.array([0.5, 1.5, 2.5, 3.5]) - 2.0) ** 2).mean())  # population std 1.118
    np.testing.assert_allclose(A.numpy()[0], (np.array([0.5, 1.5, 2.5, 3.5]) - 2.0) / (std + 1e-2), rtol=1e-6)
    # ratios: exp(0.6 / 2) = 1.35 (clipped to 1.2), exp(-0.4 / 1) = 0.67 (clipped to 0.8), 1, exp(0.1 / 1)
    logp = torch.tensor([[0.6, -0.4, 0.0, 0.1]], requires_grad=True)
    lengths = torch.tensor([[2.0, 1.0, 0.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0, -0.5]])
    loss = clipped_surrogate(logp, torch.zeros(1, 4), lengths, adv, eps=0.2)
    s = np.exp([0.3, -0.4, 0.0, 0.1])
    terms = [min(s[0] * 1.0, 1.2 * 1.0), min(s[1] * -1.0, 0.8 * -1.0), min(s[2] * 2.0, 1.0 * 2.0),
             min(s[3] * -0.5, min(max(s[3], 0.8), 1.2) * -0.5)]
    assert loss.item() == pytest.approx(-np.mean(terms))
    loss.backward()
    # clipped terms give no gradient (a ratio above 1 + eps with A > 0, below 1 - eps with A < 0); the rest do
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0
    assert logp.grad[0, 2] == pytest.approx(-2.0 / 4) and logp.grad[0, 3] == pytest.approx(0.5 * s[3] / 4)
