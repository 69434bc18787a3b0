"""A linear fractional MILP as plain data, solved with SCIP (pyscipopt) by Dinkelbach iterations.

`FractionalMILP` holds variables, linear rows, a linear numerator and denominator. `dinkelbach`
maximises num - lambda den with SCIP (`solve_parametric`), sets lambda <- num / den of the
solution as the caller's exact evaluator measures it, and stops when lambda stops rising;
`charnes_cooper` solves the same program as one MILP (a cross-check for tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class FractionalMILP:
    """max (num . v + num_const) / (den . v + den_const) s.t. rows, v_i in [0, ub_i], binary where flagged."""

    names: list[str] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], str, float]] = field(default_factory=list)  # (coefs, "<=" | "==", rhs)
    num: dict[int, float] = field(default_factory=dict)
    den: dict[int, float] = field(default_factory=dict)
    num_const: float = 0.0
    den_const: float = 0.0
    den_lower: float = 0.0  # a positive lower bound on the denominator (Charnes-Cooper scale bound, ratio bound)
    den_upper: float = 0.0

    def var(self, name: str, *, binary: bool, ub: float = 1.0) -> int:
        self.names.append(name)
        self.binary.append(binary)
        self.ub.append(float(ub))
        return len(self.names) - 1

    def row(self, coefs: dict[int, float], sense: str, rhs: float) -> None:
        self.rows.append((coefs, sense, float(rhs)))

    def value(self, coefs: dict[int, float], const: float, vals: np.ndarray) -> float:
        return const + float(sum(c * vals[i] for i, c in coefs.items()))


def add_coef(d: dict[int, float], i: int, c: float) -> None:
    if c != 0.0:
        d[i] = d.get(i, 0.0) + float(c)


@dataclass
class MILPSolution:
    values: np.ndarray
    objective: float
    dual_bound: float
    gap: float
    status: str
    seconds: float


def _scip_model(time_limit: float, mip_gap: float, abs_gap: float | None = None, threads: int = 1):
    from pyscipopt import Model

    model = Model()
    model.hideOutput()
    model.setParam("limits/time", float(time_limit))
    model.setParam("limits/gap", float(mip_gap))
    if abs_gap is not None:
        model.setParam("limits/absgap", float(abs_gap))
    model.setParam("randomization/randomseedshift", 0)
    model.setParam("parallel/maxnthreads", int(threads))
    return model


def _add_rows(model, vars_, rows) -> None:
    from pyscipopt import quicksum

    for coefs, sense, rhs in rows:
        expr = quicksum(c * vars_[i] for i, c in coefs.items())
        model.addCons(expr <= rhs if sense == "<=" else expr == rhs)


def _finish(model, vars_, t0: float) -> MILPSolution:
    if model.getNSols() == 0:
        raise ValueError(f"SCIP found no feasible solution (status {model.getStatus()}); raise solve.time_limit")
    sol = model.getBestSol()
    vals = np.array([model.getSolVal(sol, v) for v in vars_])
    return MILPSolution(
        values=vals,
        objective=float(model.getObjVal()),
        dual_bound=float(model.getDualbound()),
        gap=float(model.getGap()),
        status=str(model.getStatus()),
        seconds=time.perf_counter() - t0,
    )


def solve_parametric(
    milp: FractionalMILP, lam: float, *, time_limit: float, mip_gap: float, start: np.ndarray | None = None
) -> MILPSolution:
    """max num - lam * den (the Dinkelbach subproblem) with SCIP."""
    from pyscipopt import quicksum

    t0 = time.perf_counter()
    # The subproblem optimum tends to 0 as lambda converges, so a relative gap never closes: stop at an
    # absolute gap worth a relative ratio error of mip_gap (ratio <= lam + gap / den_lower).
    abs_gap = mip_gap * max(lam, 1e-12) * milp.den_lower
    if not (np.isfinite(abs_gap) and abs_gap >= 0):
        raise ValueError(f"Dinkelbach subproblem at lambda {lam} with a denominator bound of {milp.den_lower}: the ratio "
                         "and the cycle times must be finite and positive (is the latency model's t_verify negative?)")
    model = _scip_model(time_limit, mip_gap, abs_gap=abs_gap)
    vars_ = [model.addVar(name=n, vtype="B" if b else "C", lb=0.0, ub=u) for n, b, u in zip(milp.names, milp.binary, milp.ub)]
    _add_rows(model, vars_, milp.rows)
    obj = dict(milp.num)
    for i, c in milp.den.items():
        add_coef(obj, i, -lam * c)
    model.setObjective(quicksum(c * vars_[i] for i, c in obj.items()) + (milp.num_const - lam * milp.den_const), "maximize")
    if start is not None:
        sol = model.createSol()
        for v, val in zip(vars_, start):
            model.setSolVal(sol, v, float(val))
        model.addSol(sol, free=True)
    model.optimize()
    return _finish(model, vars_, t0)


def charnes_cooper(milp: FractionalMILP, *, time_limit: float, mip_gap: float) -> MILPSolution:
    """The fractional program as one MILP: s = 1/den, every variable scaled by s, s * binary by big-M.

    Returns the *unscaled* values (binaries as solved, continuous = scaled / s) and objective = ratio."""
    from pyscipopt import quicksum

    if milp.den_lower <= 0:
        raise ValueError("Charnes-Cooper needs a positive lower bound on the denominator")
    s_hi = 1.0 / milp.den_lower
    s_lo = 1.0 / milp.den_upper if milp.den_upper > 0 else 0.0
    t0 = time.perf_counter()
    model = _scip_model(time_limit, mip_gap)
    s = model.addVar(name="s", vtype="C", lb=s_lo, ub=s_hi)
    hat = []
    for n, b, u in zip(milp.names, milp.binary, milp.ub):
        h = model.addVar(name=f"hat_{n}", vtype="C", lb=0.0, ub=u * s_hi)
        model.addCons(h <= u * s)
        if b:
            xb = model.addVar(name=n, vtype="B")
            model.addCons(h <= s_hi * xb)
            model.addCons(h >= s - s_hi * (1 - xb))
            hat.append((h, xb))
        else:
            hat.append((h, None))
    hv = [h for h, _ in hat]
    for coefs, sense, rhs in milp.rows:
        expr = quicksum(c * hv[i] for i, c in coefs.items()) - rhs * s
        model.addCons(expr <= 0 if sense == "<=" else expr == 0)
    model.addCons(quicksum(c * hv[i] for i, c in milp.den.items()) + milp.den_const * s == 1)
    model.setObjective(quicksum(c * hv[i] for i, c in milp.num.items()) + milp.num_const * s, "maximize")
    model.optimize()
    if model.getNSols() == 0:
        raise ValueError(f"SCIP found no feasible Charnes-Cooper solution (status {model.getStatus()})")
    sol = model.getBestSol()
    sv = model.getSolVal(sol, s)
    vals = np.array([model.getSolVal(sol, b) if b is not None else model.getSolVal(sol, h) / sv for h, b in hat])
    return MILPSolution(
        values=vals, objective=float(model.getObjVal()), dual_bound=float(model.getDualbound()),
        gap=float(model.getGap()), status=str(model.getStatus()), seconds=time.perf_counter() - t0,
    )


@dataclass
class DinkelbachTrace:
    lambdas: list[float]  # ratio after every iteration (lambdas[0] = the start)
    gaps: list[float]  # per subproblem: (dual bound - objective) / den_lower / lambda, a relative ratio gap
    statuses: list[str]
    seconds: list[float]  # SCIP seconds per subproblem
    ratio_upper_bound: float  # lambda + dual bound of the last subproblem / den_lower


def dinkelbach(
    milp: FractionalMILP,
    *,
    start: np.ndarray,
    evaluate,
    time_limit: float,
    mip_gap: float,
    tol: float,
    max_iterations: int,
) -> tuple[np.ndarray, float, DinkelbachTrace]:
    """`evaluate(values) -> (num, den)` is the exact (replay) evaluation of a solution."""
    num, den = evaluate(start)
    lam, best = num / den, start
    trace = DinkelbachTrace(lambdas=[lam], gaps=[], statuses=[], seconds=[], ratio_upper_bound=float("inf"))
    for _ in range(max_iterations):
        sol = solve_parametric(milp, lam, time_limit=time_limit, mip_gap=mip_gap, start=best)
        # gap in ratio terms (SCIP's relative gap is undefined as the subproblem optimum tends to 0)
        trace.gaps.append(max(sol.dual_bound - sol.objective, 0.0) / milp.den_lower / max(lam, 1e-12))
        trace.statuses.append(sol.status)
        trace.seconds.append(sol.seconds)
        # any ratio: num - lam den <= dual bound  =>  num/den <= lam + dual_bound / den_lower
        trace.ratio_upper_bound = lam + max(sol.dual_bound, 0.0) / milp.den_lower
        num, den = evaluate(sol.values)
        new = num / den
        improved = new > lam * (1 + tol)
        if new > lam:
            lam, best = new, sol.values
        trace.lambdas.append(lam)
        if not improved:
            break
    return best, lam, trace
