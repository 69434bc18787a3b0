"""Verification: speculative sampling keeps the target distribution; replay and nesting hold."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ogspo.engine.tree import DraftTree, Structure, node_rank_paths
from ogspo.engine.verify import CycleRandom, Verdict, target_probs, verify_greedy, verify_stochastic

VOCAB = 8


def small_tree() -> DraftTree:
    """root -> children tokens (2, 5, 1); node 1 (token 2) -> children (4, 2)."""
    t = DraftTree.from_root(0)
    a = t.add_children(parents=np.zeros(3, dtype=np.int64), tokens=np.array([2, 5, 1]), ranks=np.arange(3),
                       logq=np.log([0.5, 0.3, 0.1]), entropy=np.zeros(3))
    t.add_children(parents=np.array([a[0], a[0]]), tokens=np.array([4, 2]), ranks=np.arange(2),
                   logq=np.log([0.6, 0.2]), entropy=np.zeros(2))
    return t


def logits_for(tree: DraftTree, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(tree), VOCAB, generator=g, dtype=torch.float64) * 1.5


def biased_verify(tree, logits, rand, *, temperature, top_p=1.0) -> Verdict:
    """A deliberately wrong verifier: a rejected sibling's token stays in the bonus distribution."""
    p = target_probs(logits[:1], temperature=temperature)[0]
    matches = np.zeros(len(tree), dtype=bool)
    for child in np.nonzero(tree.parents == 0)[0]:
        if rand.accept[0, int(tree.ranks[child])] < float(p[int(tree.tokens[child])]):
            return Verdict(path=[0, int(child)], bonus=-1, matches=matches)
    idx = int(torch.searchsorted(p.cumsum(0), torch.tensor([rand.bonus[0]], dtype=p.dtype)).clamp(max=VOCAB - 1))
    return Verdict(path=[0], bonus=idx, matches=matches)


def first_tokens(verify, n: int, temperature: float, top_p: float = 1.0) -> np.ndarray:
    tree = small_tree()
    logits = logits_for(tree)
    out = np.zeros(n, dtype=np.int64)
    for s in range(n):
        v = verify(tree, logits, CycleRandom.from_seed(10_000 + s), temperature=temperature, top_p=top_p)
        out[s] = tree.tokens[v.path[1]] if len(v.path) > 1 else v.bonus
    return out


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the target's support"
    return chisquare(counts[support], probs[support] / probs[support].sum() * len(samples)).pvalue


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_first_token_follows_target_distribution(temperature, top_p):
    tree = small_tree()
    p = target_probs(logits_for(tree)[:1], temperature=temperature, top_p=top_p)[0].numpy()
    samples = first_tokens(verify_stochastic, 12_000, temperature, top_p)
    assert chi2_pvalue(samples, p) > 1e-3


def test_biased_verifier_is_caught():
    tree = small_tree()
    p = target_probs(logits_for(tree)[:1], temperature=1.0)[0].numpy()
    samples = first_tokens(biased_verify, 12_000, 1.0)
    assert chi2_pvalue(samples, p) < 1e-6


def test_second_token_given_first_follows_target():
    tree = small_tree()
    logits = logits_for(tree)
    logits[0, 2] += 2.0  # make the root's first child (token 2) likely
    p2 = target_probs(logits[1:2], temperature=1.0)[0].numpy()  # the target at node 1 (token 2)
    seconds = []
    for s in range(8_000):
        v = verify_stochastic(tree, logits, CycleRandom.from_seed(s), temperature=1.0)
        if len(v.path) > 1 and v.path[1] == 1:
            seconds.append(tree.tokens[v.path[2]] if len(v.path) > 2 else v.bonus)
    assert len(seconds) > 1000
    assert chi2_pvalue(np.array(seconds), p2) > 1e-3


def test_greedy_verdict():
    tree = small_tree()
    logits = torch.full((len(tree), VOCAB), -5.0, dtype=torch.float64)
    logits[0, 2] = 1.0  # root argmax: token 2 -> node 1
    logits[1, 2] = 1.0  # node 1 argmax: token 2 -> node 5
    logits[5, 6] = 1.0  # bonus after node 5
    v = verify_greedy(tree, logits)
    assert v.path == [0, 1, 5] and v.bonus == 6
    assert v.matches.tolist() == [False, True, False, False, False, True]


def test_replay_and_nesting_under_sub_structures():
    """Same seed, same path; under S_{<=d} the path is the longest prefix of the full path inside it."""
    rng = np.random.default_rng(0)
    full = Structure.full([3, 2, 2])
    paths = sorted(full.paths, key=lambda p: (len(p), p))
    tree = DraftTree.from_root(0)
    index = {(): 0}
    for p in paths:  # random distinct sibling tokens, breadth-first
        (i,) = tree.add_children(parents=np.array([index[p[:-1]]]), tokens=np.array([0]), ranks=np.array([p[-1]]),
                                 logq=np.zeros(1), entropy=np.zeros(1))
        index[p] = int(i)
    for parent in range(len(tree)):
        kids = np.nonzero(tree.parents == parent)[0]
        tree.tokens[kids] = rng.choice(VOCAB, size=len(kids), replace=False)
    rank_paths = node_rank_paths(tree.parents, tree.ranks)
    subs = [Structure([(0,), (0, 0)]), Structure([(0,), (1,), (1, 0), (0, 0), (0, 1)]), full.up_to(1), full]
    for seed in range(300):
        logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        rand = CycleRandom.from_seed(seed)
        v_full = verify_stochastic(tree, logits, rand, temperature=1.0)
        assert verify_stochastic(tree, logits, rand, temperature=1.0).path == v_full.path
        full_rank_path = [rank_paths[i] for i in v_full.path[1:]]
        for s in subs:
            sub, keep = tree.subset(np.array([0] + [index[p] for p in s.paths]))
            v = verify_stochastic(sub, logits[keep], rand, temperature=1.0)
            got = [rank_paths[keep[i]] for i in v.path[1:]]
            expected = []
            for rp in full_rank_path:
                if rp not in s:
                    break
                expected.append(rp)
            assert got == expected
