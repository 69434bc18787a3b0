"""offline.chain: the chain-with-threshold oracle that chooses llama.cpp's --spec-draft-n-max / -p-min."""

import math

import numpy as np
import polars as pl
import pytest

from ogspo.artifacts.records import Records, template_index
from ogspo.engine.tree import Structure
from ogspo.offline.chain import ChainCosts, ChainCycles, chain_cycles, choose_chain, fit_chain_costs, replay_chain, subset

TEMPLATE = Structure([[0], [1], [0, 0], [0, 1], [0, 0, 0]])


def records(cases):
    """cases: (request_id, [q of chain depth 1..3], accepted template path as rank paths)."""
    index = template_index(TEMPLATE)
    nodes, cycles = [], []
    for c, (rid, qs, path) in enumerate(cases):
        cum = 0.0
        for k, q in enumerate(qs, start=1):
            cum += math.log(q)
            nodes.append({"request_id": rid, "cycle": c, "tnode": index[(0,) * k], "rank_path": ".".join(["0"] * k),
                          "logq": math.log(q), "cum_logq": cum})
        for off in ((1,), (0, 1)):  # off the chain
            nodes.append({"request_id": rid, "cycle": c, "tnode": index[off], "rank_path": ".".join(map(str, off)),
                          "logq": math.log(0.05), "cum_logq": math.log(0.05)})
        cycles.append({"request_id": rid, "cycle": c, "context_length": 100,
                       "accepted_tnodes": [index[tuple(p)] for p in path]})
    return Records(nodes=pl.DataFrame(nodes), cycles=pl.DataFrame(cycles), meta={}, template=TEMPLATE)


def test_chain_cycles_reads_the_rank0_chain_and_stops_counting_off_it():
    rec = records([("a/1", [0.9, 0.8, 0.7], [[0], [0, 0], [0, 0, 0]]),
                   ("a/1", [0.6, 0.5, 0.4], [[0], [0, 1]]),  # leaves the chain at depth 2
                   ("b/2", [0.3, 0.2, 0.1], [[1]]),  # accepted a sibling: no chain node
                   ("b/2", [0.5, 0.5, 0.5], [])])
    cyc = chain_cycles(rec)
    assert cyc.depth == 3
    np.testing.assert_allclose(cyc.q[0], [0.9, 0.8, 0.7])
    assert cyc.accepted.tolist() == [3, 1, 0, 0]
    assert cyc.groups.tolist() == ["a", "a", "b", "b"]
    assert subset(cyc, "b").accepted.tolist() == [0, 0]
    with pytest.raises(ValueError, match="no records cycles of 'c'"):
        subset(cyc, "c")


def test_replay_counts_drafted_tokens_head_passes_and_commits_as_llama_cpp_does():
    cyc = ChainCycles(q=np.array([[0.9, 0.8, 0.3], [0.2, 0.9, 0.9]]), accepted=np.array([2, 0]), groups=np.array(["w", "w"]))
    costs = ChainCosts(verify=np.array([10.0, 11.0, 12.0, 13.0]), level=1.0, other=0.5, ar=10.0)
    # N=3, P=0.5: cycle 0 drafts 2 (depth 3 below P, computed: 3 passes), commits 3; cycle 1 drafts 0 (1 pass), commits 1
    j, drafted, acc = replay_chain(cyc, costs, 3, 0.5)
    t0 = 12.0 + (3 + 1) * 1.0 + 0.5
    t1 = 10.0 + (1 + 1) * 1.0 + 0.5
    assert j == pytest.approx((3 + 1) / (t0 + t1))
    assert drafted == pytest.approx(1.0) and acc == pytest.approx(2 / 2)
    # N=1, P=0: one token each, stopped by N (1 pass): commits 2 and 1
    j, drafted, acc = replay_chain(cyc, costs, 1, 0.0)
    assert j == pytest.approx(3 / (2 * (11.0 + 2 * 1.0 + 0.5)))
    assert (drafted, acc) == (1.0, 0.5)
    with pytest.raises(ValueError, match="outside the records' chain depth"):
        replay_chain(cyc, costs, 4, 0.0)


def test_choice_is_off_when_verification_is_dear_and_finds_the_planted_threshold():
    rng = np.random.default_rng(0)
    C, K = 400, 6
    q = rng.uniform(0, 1, (C, K))
    match = q > 0.5  # the head is right exactly where it is confident
    accepted = np.where(match.all(1), K, np.argmin(match, axis=1))
    cyc = ChainCycles(q=q, accepted=accepted, groups=np.array(["w"] * C))
    flat = ChainCosts(verify=np.full(K + 1, 10.0), level=0.2, other=0.1, ar=10.0)
    choice = choose_chain(cyc, flat)
    assert not choice.off and choice.n_max == K and choice.p_min == pytest.approx(0.5)
    assert choice.acceptance == pytest.approx(1.0) and choice.tokens_per_second > choice.ar_tokens_per_second
    dear = ChainCosts(verify=10.0 * (1 + np.arange(K + 1)), level=2.0, other=1.0, ar=10.0)
    off = choose_chain(cyc, dear)
    assert off.off and off.tokens_per_second == pytest.approx(0.1)


def test_fit_chain_costs_recovers_planted_costs():
    verify = np.array([10.0, 10.5, 11.0, 11.5, 12.0, 12.5])
    level, other = 0.8, 0.3
    runs = [(n, verify[n] + (n + 1) * level + other) for n in (1, 4)]
    costs = fit_chain_costs(verify, runs, ar=10.2)
    assert costs.level == pytest.approx(level) and costs.other == pytest.approx(other) and costs.ar == 10.2
    with pytest.raises(ValueError, match="two chain lengths"):
        fit_chain_costs(verify, [(2, 14.0), (2, 14.1)], ar=10.0)
