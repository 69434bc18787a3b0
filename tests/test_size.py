"""The size decision (docs/DESIGN.md §5): replay of top-V verification equals a real re-run of the
cycle, the extended oracle equals brute force, and the decode-time rule chooses what the offline one does."""

import itertools

import numpy as np
import pytest
from test_records import PROMPTS, SUBS, _collect, _model, _setup

from ogspo.artifacts.records import load_records
from ogspo.artifacts.size_rule import SizeRule, read_size_rule, write_size_rule
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.policies import Draft, StaticTree
from ogspo.engine.tree import confidence_order
from ogspo.methods.ogspo import select_size, top_confidence_nodes
from ogspo.offline.size import (
    extended_bound,
    fit_size_rule,
    isotonic,
    rule_sizes,
    size_data,
    size_tables,
)


class TopV(StaticTree):
    """Draft S, verify its top-V nodes by confidence (V fixed, or chosen by a size rule)."""

    def __init__(self, S, V=None, rule=None):
        super().__init__(S)
        self.V, self.rule = V, rule

    def draft(self, drafter, root, ctx, *, stop_hook=None) -> Draft:
        d = super().draft(drafter, root, ctx, stop_hook=stop_hook)
        keep = (select_size(self.rule, d.drafted, ctx.context_length) if self.rule is not None
                else top_confidence_nodes(d.drafted, self.V))
        return Draft(drafted=d.drafted, verified=keep, level_seconds=d.level_seconds)


def _rerun(engine, rec):
    """Every recorded cycle re-run for real from its context with its random numbers: [(stats, committed)]."""
    out, done_by = [], {}
    for row in rec.cycles.iter_rows(named=True):
        prompt = PROMPTS[int(row["request_id"][1:])]
        done = done_by.setdefault(row["request_id"], [row["root_token"]])
        out.append(engine.cycle_from(prompt + done[:-1], done[-1], request_seed=row["request_seed"], index=row["cycle"]))
        done += row["committed"]
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_size_replay_equals_a_real_rerun_of_the_cycle(tmp_path, temperature):
    """For sub-structures S, stop depths d and every V = 0..|S_<=d|, the committed length of the real
    cycle that verifies the top-V drafted nodes equals A_c(d, V) from the records."""
    _collect(tmp_path / "r", temperature=temperature, shard_size=3)
    rec = load_records(tmp_path / "r")
    target, drafter = _setup()
    lat = _model()
    checked = 0
    for S in SUBS[1:3]:
        data = size_data(rec, S)
        A, _, legal = size_tables(data, lat)
        for d in (1, S.max_depth):
            n_d = len(S.up_to(d))
            for V in range(n_d + 1):
                engine = SpeculativeEngine(target=target, policy=TopV(S.up_to(d), V), drafter=drafter, temperature=temperature)
                for c, (stats, committed) in enumerate(_rerun(engine, rec)):
                    assert legal[c, d - 1, V]
                    assert stats.accepted == A[c, d - 1, V], (S, d, V, c)
                    assert committed[: stats.accepted - 1] == rec.cycles["committed"][c].to_list()[: stats.accepted - 1]
                    checked += 1
    assert checked > 100 and not legal[:, 0, len(SUBS[2].up_to(1)) + 1:].any()


def test_decode_time_rule_chooses_what_the_offline_rule_does(tmp_path):
    _collect(tmp_path / "r", temperature=0.0, shard_size=3)
    rec = load_records(tmp_path / "r")
    S = SUBS[2]
    data = size_data(rec, S)
    lat = _model(fixed=0.01)
    depths = np.full(data.cum.shape[0], S.max_depth)
    rule = fit_size_rule(data=data, depths=depths, latency=lat, lam=0.5)
    write_size_rule(rule, tmp_path / "size.json")
    rule = read_size_rule(tmp_path / "size.json")
    want = rule_sizes(rule, data, depths)
    assert len(set(want.tolist())) > 1  # the check covers different sizes
    A, _, _ = size_tables(data, lat)
    target, drafter = _setup()
    engine = SpeculativeEngine(target=target, policy=TopV(S, rule=rule), drafter=drafter, temperature=0.0)
    for c, (stats, _) in enumerate(_rerun(engine, rec)):
        assert stats.tree_size == want[c]
        assert stats.accepted == A[c, S.max_depth - 1, want[c]]


def test_extended_oracle_equals_brute_force():
    rng = np.random.default_rng(3)
    C, D, W = 4, 2, 3
    A = 1 + rng.integers(0, 3, size=(C, D, W)).astype(float)
    t = 0.5 + rng.random((C, D, W))
    legal = np.ones((C, D, W), dtype=bool)
    legal[:, 0, 2] = False  # depth 1 has 1 node: V <= 1
    choice, J = extended_bound(A, t, legal)
    options = [(d, v) for d in range(D) for v in range(W) if legal[0, d, v]]
    best = max(sum(A[c, d, v] for c, (d, v) in enumerate(combo)) / sum(t[c, d, v] for c, (d, v) in enumerate(combo))
               for combo in itertools.product(options, repeat=C))
    assert J == pytest.approx(best)
    rows = np.arange(C)
    assert A[rows, choice[:, 0] - 1, choice[:, 1]].sum() / t[rows, choice[:, 0] - 1, choice[:, 1]].sum() == pytest.approx(best)


def test_confidence_order_prefixes_are_closed_trees():
    rng = np.random.default_rng(0)
    parents = np.array([-1, 0, 0, 0, 1, 1, 2, 4, 4])
    depths = np.array([0, 1, 1, 1, 2, 2, 2, 3, 3])
    for _ in range(50):
        logq = np.log(rng.dirichlet(np.ones(3), size=9).max(1)) * rng.random()
        logq[0] = 0
        # siblings drafted best first (non-increasing logq by rank)
        for p in set(parents[1:].tolist()):
            kids = np.nonzero(parents == p)[0]
            logq[kids] = np.sort(logq[kids])[::-1]
        cum = logq.copy()
        for i in range(1, 9):
            cum[i] += cum[parents[i]]
        order = confidence_order(cum, depths)
        for V in range(9):
            chosen = {0, *order[:V].tolist()}
            assert all(parents[v] in chosen for v in chosen if v)
            for v in chosen - {0}:  # left-closed: earlier siblings are in
                kids = np.nonzero(parents == parents[v])[0]
                assert set(kids[kids < v].tolist()) <= chosen


def test_size_rule_gains_and_isotonic():
    assert isotonic(np.array([0.1, 0.3, 0.2, 0.5]), np.ones(4)).tolist() == pytest.approx([0.1, 0.25, 0.25, 0.5])
    rule = SizeRule(lam=1.0, edges=[-1.0], probs=[0.1, 0.9], verify_intercept=[1.0, 1.2, 1.4, 2.5],
                    verify_slope=[0.0] * 4, meta={})
    # gains: V=0: 1 - 1.0; V=1: 1.9 - 1.2; V=2: 2.8 - 1.4; V=3: 2.9 - 2.5
    assert rule.gains(np.array([-0.1, -0.5, -3.0]), 0).tolist() == pytest.approx([0.0, 0.7, 1.4, 0.4])
    assert rule.choose(np.array([-0.1, -0.5, -3.0]), 0) == 2
