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


# ---------------------------------------------------------------- the GTO training step (tiny Llama)

from engine_helpers import make_head, tiny_model  # noqa: E402

from ogspo.drafter.data import annotate_text  # noqa: E402
from ogspo.drafter.head import EagleHead  # noqa: E402
from ogspo.drafter.runtime import EagleDrafter  # noqa: E402
from ogspo.drafter.train import chunk_index, make_batch, target_to_draft, ttt_loss  # noqa: E402
from ogspo.drafter.train_gto import GroupScorer, draft_at, gto_loss, gto_step, path_logprobs  # noqa: E402
from ogspo.engine.policies import DynamicTree  # noqa: E402
from ogspo.engine.target import build_tree_lm  # noqa: E402

GTO_CFG = dict(group=4, tree=[10, 3, 3], context=16, eta=1.0, eps=0.2, delta=0.1)


def _gto_setup(seed=0):
    target = tiny_model(seed, layers=4).float()  # feature layers 0, 1, 2: below the last
    head = make_head(target, seed=seed)
    g = torch.Generator().manual_seed(seed)
    texts = [torch.randint(3, 64, (40,), generator=g).tolist() for _ in range(4)]
    lm = build_tree_lm(target, max_len=256, feature_layers=head.cfg.feature_layers)
    seqs = annotate_text(lm, texts, top_k=4, rows=16)
    lm = build_tree_lm(target, max_len=256)
    scorer = GroupScorer(lm, DynamicTree(total_tokens=10, depth=3, top_k=3), GTO_CFG["context"], GTO_CFG["eta"])
    return target, head, seqs, scorer


def test_one_target_forward_scores_every_tree_of_a_group_as_its_own_root_path_would():
    """p of each node (from the spine-and-trees forward) = the target's probability after the node's
    root path, and S is the longest greedily accepted root path."""
    target, head, seqs, scorer = _gto_setup()
    seq, s, m = seqs[0], 5, 4
    scored = scorer.score([EagleDrafter(head, max_len=64)], seq, s, m)
    x = seq.tokens.tolist()
    for i in range(m):
        (st,) = scored[i]
        t = st.tree
        assert len(t) > 1 and t.tokens[0] == x[s + i + 1]
        for v in range(1, len(t)):
            path, a = [], t.parents[v]
            while a > 0:
                path.append(int(t.tokens[a]))
                a = t.parents[a]
            ids = torch.tensor([x[: s + i + 2] + path[::-1]])
            with torch.no_grad():
                probs = torch.softmax(target(ids).logits[0, -1].float(), -1)
            assert st.p[v] == pytest.approx(float(probs[t.tokens[v]]), abs=1e-4)
        # greedy acceptance of S, node by node, and nothing longer is accepted
        ctx = x[: s + i + 2]
        for tok in st.path:
            with torch.no_grad():
                assert int(target(torch.tensor([ctx])).logits[0, -1].argmax()) == tok
            ctx = ctx + [int(tok)]
        assert st.reward == pytest.approx(tree_reward(t.parents, st.p))


def test_path_logprobs_equal_the_drafters_own_logq_along_the_path():
    _, head, seqs, scorer = _gto_setup()
    drafter = EagleDrafter(head, max_len=64)
    t2d = target_to_draft(head.d2t, head.cfg.vocab)
    items, want = [], []
    for r in (3, 20, 30):
        tree = draft_at(drafter, scorer.policy, seqs[1], r, GTO_CFG["context"])
        v = int(np.argmax(tree.depths))  # a deepest node: its root path as S
        path = []
        lq = 0.0
        while v > 0:
            path.append(int(tree.tokens[v]))
            lq += tree.logq[v]
            v = int(tree.parents[v])
        items.append((1, r, np.array(path[::-1])))
        want.append(lq)
    items.append((1, 10, np.zeros(0, dtype=np.int64)))  # an empty S has log-probability 0
    want.append(0.0)
    (got,) = path_logprobs([head], seqs, items, GTO_CFG["context"], t2d)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4)


def _trained_reference(target, head, seqs, steps=40):
    """The tiny head after a few token-loss steps (the train_drafter head of these tests)."""
    t2d = target_to_draft(head.d2t, head.cfg.vocab)
    batch = make_batch(seqs, chunk_index(seqs, 64), t2d, 64, torch.device("cpu"))
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    head.train()
    for _ in range(steps):
        loss, _, _ = ttt_loss(head, batch, 3, 0.7)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval(), batch, t2d


def _copy_head(head):
    twin = EagleHead(head.cfg, embed=head.embed, lm_rows=head.lm_rows, d2t=head.d2t)
    twin.load_state_dict(head.state_dict())
    return twin


def test_gto_term_is_zero_while_the_head_equals_its_reference():
    """At the start of fine-tuning M = M_ref: every tree equals its reference tree, so R = 0, every
    advantage is 0 and L_GTO adds no gradient (the first steps are the token loss's)."""
    target, head, seqs, scorer = _gto_setup()
    reference, _, t2d = _trained_reference(target, head, seqs)
    current = _copy_head(reference).train()
    drafters = (EagleDrafter(current, max_len=64), EagleDrafter(reference, max_len=64))
    loss, stats = gto_loss(current, reference, drafters, scorer, seqs, np.array([[0, 4], [1, 12]]), t2d, GTO_CFG)
    assert stats["reward"] == pytest.approx(stats["reference_reward"]) and stats["accepted"] > 0
    loss.backward()
    # zero up to float noise (the two trees' rows sit at different places of one target forward)
    assert abs(loss.item()) < 1e-6
    assert max(float(p.grad.abs().max()) for p in current.parameters() if p.grad is not None) < 1e-5


def test_a_step_against_the_gto_loss_favours_the_paths_that_beat_their_reference():
    """L_GTO alone: a small gradient step on it raises sum_i A_i log p(S_i), the likelihood of the
    paths whose trees beat their reference tree's reward (A_i > 0) against those that lose to it.
    A sign-flipped surrogate or advantage lowers it, and fails here."""
    from ogspo.drafter.gto import group_advantages

    target, head, seqs, scorer = _gto_setup(seed=1)
    reference, _, t2d = _trained_reference(target, head, seqs)
    current = _copy_head(reference)
    with torch.no_grad():  # off its reference, so that some trees differ from the reference's
        g = torch.Generator().manual_seed(3)
        for p in current.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    drafters = (EagleDrafter(current, max_len=64), EagleDrafter(reference, max_len=64))
    groups = np.array([[i, s] for i in range(len(seqs)) for s in range(1, 32, 4)])
    m = GTO_CFG["group"]
    rewards, ref_rewards, items = np.zeros((len(groups), m)), np.zeros((len(groups), m)), []
    for gi, (i, s) in enumerate(groups):  # the pieces gto_loss is made of
        for k, (cur, ref) in enumerate(scorer.score(list(drafters), seqs[i], int(s), m)):
            rewards[gi, k], ref_rewards[gi, k] = cur.reward, ref.reward
            items.append((int(i), int(s) + k, cur.path))
    adv = group_advantages(torch.as_tensor(rewards), torch.as_tensor(ref_rewards), delta=GTO_CFG["delta"]).flatten().float()
    assert (adv > 0).any() and (adv < 0).any()
    (before,) = path_logprobs([current], seqs, items, GTO_CFG["context"], t2d)
    current.train()
    loss, _ = gto_loss(current, reference, drafters, scorer, seqs, groups, t2d, GTO_CFG)
    current.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in current.parameters():
            if p.grad is not None:
                p.sub_(1e-3 * p.grad)
    current.eval()
    (after,) = path_logprobs([current], seqs, items, GTO_CFG["context"], t2d)
    gain = float((adv * (after.detach() - before.detach())).sum())
    assert gain > 0, gain


def test_gto_step_is_the_token_loss_plus_omega_times_the_gto_loss():
    """The stage's step: L_token alone at omega = 0 (the control run drafts no trees), and
    L_token + omega * L_GTO otherwise, on the same batch and groups."""
    target, head, seqs, scorer = _gto_setup(seed=1)
    reference, batch, t2d = _trained_reference(target, head, seqs)
    current = _copy_head(reference)
    with torch.no_grad():
        for p in current.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
    drafters = (EagleDrafter(current, max_len=64), EagleDrafter(reference, max_len=64))
    groups = np.array([[i, s] for i in range(len(seqs)) for s in (1, 13, 25)])
    train_cfg = {"ttt_steps": 3, "ttt_decay": 0.7}
    token, _, _ = ttt_loss(current, batch, 3, 0.7)
    control, stats = gto_step(current, reference, drafters, scorer, seqs, groups, batch, t2d, GTO_CFG | {"omega": 0.0}, train_cfg)
    assert float(control) == pytest.approx(float(token)) and math.isnan(stats["reward"])
    gto, _ = gto_loss(current, reference, drafters, scorer, seqs, groups, t2d, GTO_CFG)
    both, stats = gto_step(current, reference, drafters, scorer, seqs, groups, batch, t2d, GTO_CFG | {"omega": 0.5}, train_cfg)
    assert float(gto) != 0.0 and float(both) == pytest.approx(float(token) + 0.5 * float(gto), rel=1e-5)
