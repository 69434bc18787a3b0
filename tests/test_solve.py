"""OGSPO solver: Dinkelbach == brute force == Charnes-Cooper on tiny templates; replay consistency."""

from __future__ import annotations

import json

import numpy as np
import pytest
from solve_helpers import synthetic_cycles, synthetic_latency

from ogspo.artifacts.oracle import write_oracle
from ogspo.engine.tree import Structure
from ogspo.offline import solve
from ogspo.offline.milp import charnes_cooper, solve_parametric

TINY = [Structure.full([2, 1, 1]), Structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]), Structure.full([3, 1])]
FAST = {"time_limit": 30, "mip_gap": 1e-9, "dinkelbach_tol": 1e-10}


@pytest.mark.parametrize("case", range(4))
def test_oracle_matches_brute_force_and_charnes_cooper(case):
    T = TINY[case % len(TINY)]
    cyc = synthetic_cycles(T, 40, seed=case, p0=0.6 + 0.1 * case, context=(50, 900))
    lat = synthetic_latency(verify_base=0.05 + 0.03 * case)
    res = solve.solve_oracle(cycles=cyc, latency=lat, template=T, config={**FAST, "context_buckets": 2})
    Structure(res.structure)  # valid
    groups = solve.group_cycles(cycles=cyc, latency=lat, context_buckets=2)
    bf, S_bf, _ = solve.brute_force_oracle(groups=groups, template=T, latency=lat)
    assert res.throughput == pytest.approx(bf, rel=1e-6)
    assert res.ratio_upper_bound >= res.throughput * (1 - 1e-9)
    # replay agrees with the reported totals
    depths = np.asarray(res.group_depths)[groups.cycle_group]
    a, t = solve.replay_totals(cycles=cyc, structure=Structure(res.structure), cycle_depths=depths, latency=lat)
    assert a / t == pytest.approx(res.throughput, rel=1e-9)
    # Charnes-Cooper single MILP
    info = solve.template_info(T)
    enc = solve.build_oracle_milp(groups=groups, info=info, latency=lat)
    cc = charnes_cooper(enc.milp, time_limit=30, mip_gap=1e-9)
    assert cc.objective == pytest.approx(bf, rel=1e-6)
    S = solve._structure_of(enc, info, cc.values)
    depths = solve._depths_of(enc, cc.values)[groups.cycle_group]
    a, t = solve.replay_totals(cycles=cyc, structure=S, cycle_depths=depths, latency=lat)
    assert a / t == pytest.approx(bf, rel=1e-6)


def test_autoregressive_steps_are_booked_at_their_own_overhead():
    """An empty structure's cycles are autoregressive steps (t_verify(1) + fixed_ar): the MILP, brute force
    and the replay agree on it, and a tree cycle's overhead far above an AR step's makes AR the oracle's choice
    where booking one t_fixed for both kinds would speculate."""
    T = TINY[0]
    cyc = synthetic_cycles(T, 40, seed=2, p0=0.45, context=(50, 900))
    same = synthetic_latency(fixed=0.06)
    cheap_ar = synthetic_latency(fixed=0.06, fixed_ar=0.0)
    res_same = solve.solve_oracle(cycles=cyc, latency=same, template=T, config=FAST)
    res_ar = solve.solve_oracle(cycles=cyc, latency=cheap_ar, template=T, config=FAST)
    assert len(res_same.structure) > 0 and res_ar.structure == []
    groups = solve.group_cycles(cycles=cyc, latency=cheap_ar, context_buckets=1)
    bf, _, _ = solve.brute_force_oracle(groups=groups, template=T, latency=cheap_ar)
    assert res_ar.throughput == pytest.approx(bf, rel=1e-6)
    ar_J = len(cyc.context_lengths) / float(np.sum(cheap_ar.t_verify(1, cyc.context_lengths)))
    assert res_ar.throughput == pytest.approx(ar_J, rel=1e-9)
    # a per-node overhead of tree cycles and the drafter's catch-up per committed token are booked exactly too
    # (MILP, brute force and replay agree: solve_oracle re-checks its solution against the replay)
    sloped = synthetic_latency(fixed=0.004, fixed_ar=0.001, fixed_slope=0.003, catchup=(0.004, 0.001))
    res = solve.solve_oracle(cycles=cyc, latency=sloped, template=T, config=FAST)
    groups = solve.group_cycles(cycles=cyc, latency=sloped, context_buckets=1)
    assert res.throughput == pytest.approx(solve.brute_force_oracle(groups=groups, template=T, latency=sloped)[0], rel=1e-6)


def test_oracle_milp_objective_equals_replay_at_optimum():
    T = TINY[0]
    cyc = synthetic_cycles(T, 30, seed=5)
    lat = synthetic_latency()
    info = solve.template_info(T)
    groups = solve.group_cycles(cycles=cyc, latency=lat, context_buckets=0)
    enc = solve.build_oracle_milp(groups=groups, info=info, latency=lat, min_depth=0)
    sol = solve_parametric(enc.milp, 10.0, time_limit=30, mip_gap=1e-9)
    m = enc.milp
    num, den = m.value(m.num, m.num_const, sol.values), m.value(m.den, m.den_const, sol.values)
    S = solve._structure_of(enc, info, sol.values)
    depths = solve._depths_of(enc, sol.values)[groups.cycle_group]
    a, t = solve.replay_totals(cycles=cyc, structure=S, cycle_depths=depths, latency=lat)
    assert num == pytest.approx(a, rel=1e-6) and den == pytest.approx(t, rel=1e-6)
    # a subproblem whose ratio or time bound is not finite and positive is one line, not SCIP's parameter error
    m.den_lower = -1.0
    with pytest.raises(ValueError, match="the ratio and the cycle times must be finite and positive"):
        solve_parametric(m, 10.0, time_limit=30, mip_gap=1e-9)


@pytest.mark.parametrize("case", range(3))
def test_structure_update_matches_brute_force(case):
    T = TINY[case]
    cyc = synthetic_cycles(T, 30, seed=10 + case)
    # case 2 books every overhead kind: AR steps, per-node overhead, the drafter's catch-up
    lat = synthetic_latency() if case < 2 else synthetic_latency(fixed_ar=0.001, fixed_slope=0.002, catchup=(0.005, 0.0, 0.002))
    rng = np.random.default_rng(case)
    P = rng.dirichlet(np.ones(T.max_depth + 1), size=len(cyc.context_lengths))
    res = solve.solve_structure(cycles=cyc, latency=lat, stop_probs=P, template=T, config=FAST)
    bf, _ = solve.brute_force_structure(cycles=cyc, latency=lat, stop_probs=P)
    assert res.throughput == pytest.approx(bf, rel=1e-6)
    info = solve.template_info(T)
    enc = solve.build_structure_milp(cycles=cyc, info=info, latency=lat, stop_probs=P)
    cc = charnes_cooper(enc.milp, time_limit=30, mip_gap=1e-9)
    assert cc.objective == pytest.approx(bf, rel=1e-6)


def test_closed_structures_are_valid_and_complete():
    T = Structure.full([2, 1])
    subs = solve.closed_structures(T)
    # {}, {0}, {0,00}, {0,1}, {0,1,00}, {0,1,10}, {0,1,00,10}
    assert len(subs) == 7 and len({s.paths for s in subs}) == 7


def test_bad_inputs(tmp_path):
    T = TINY[0]
    cyc = synthetic_cycles(T, 10)
    lat = synthetic_latency()
    with pytest.raises(ValueError, match="differs from the given template"):
        solve.solve_oracle(cycles=cyc, latency=lat, template=Structure.chain(2))
    with pytest.raises(ValueError, match="unknown solve settings"):
        solve.solve_oracle(cycles=cyc, latency=lat, config={"time_limt": 1})
    with pytest.raises(ValueError, match="stop_probs"):
        solve.solve_structure(cycles=cyc, latency=lat, stop_probs=np.ones((3, 2)))


def test_write_oracle(tmp_path):
    T = TINY[0]
    cyc = synthetic_cycles(T, 20)
    res = solve.solve_oracle(cycles=cyc, latency=synthetic_latency(), config=FAST)
    out = tmp_path / "o" / "oracle.json"
    write_oracle(res, out)
    data = json.loads(out.read_text())
    assert data["throughput"] == pytest.approx(res.throughput) and data["n_cycles"] == 20
    assert not list(out.parent.glob(".*tmp*"))
