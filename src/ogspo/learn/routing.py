"""Pre-drafting routing baseline (docs/DESIGN.md §7): a classifier picks one of a few templates per cycle
*before* drafting, and the cycle drafts that template fully (no stop decisions during drafting).

**Templates.** A short config list of sub-structures of the records template T (`[]` = autoregressive,
chains, a small tree). For every record cycle c and template k, replay gives A_ck (full-depth drafting
of S_k) and t_ck (latency model), so the net gain of routing c to k is G_ck = A_ck - lambda t_ck.

**Features** (order `ROUTER_FEATURES`, version `ROUTER_FEATURES_VERSION`), all known before drafting:

| # | name | meaning |
|---|---|---|
| 0 | log_context | log(1 + committed context length) |
| 1 | recent_accept | EMA (alpha `EMA_ALPHA`, start 0) of tokens committed per earlier cycle of the request (`RecentAccept`) |
| 2 | last_commit | tokens committed by the previous cycle (0 at a request's first cycle) |
| 3 | last_drafted | 1 when the previous cycle drafted a tree (0 after an autoregressive cycle or at the first) |
| 4 | last_full | 1 when the previous cycle drafted and every drafted level was accepted (commit = depth + 1) |
| 5 | first_cycle | 1 at a request's first cycle |

Online they come from the growth of the committed context between cycles (`RouterState`, over
`RecentAccept`) and the depth the previous cycle drafted. Offline they depend on the router's own
earlier choices (an autoregressive cycle commits 1 token, which lowers the EMA), so features are
computed by *simulating* the router over each request's record cycles in order (`simulate_router`),
with the commits replay gives for the chosen templates: the same numbers the engine would feed it if
the request's cycles recurred. Training rounds alternate: features under the current behaviour
(round 0: the best single template), fit, re-simulate.

**Classifier.** Standardised features -> MLP (`hidden` units, ReLU; 0 = multinomial logistic
regression) -> one score per template; the router picks the argmax. Fitted (torch, full batch Adam)
by maximising the expected normalised net gain sum_k softmax(z)_k G_ck. lambda follows Dinkelbach:
start at the best single template's throughput, refit at lambda = J(router), keep the best round on the
training requests. Saved as JSON (weights, normalisation, templates, feature names, version); inference
is numpy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records
from ogspo.artifacts.router import ROUTER_FEATURES, Router, template_name
from ogspo.artifacts.settings import settings
from ogspo.engine.tree import Structure
from ogspo.learn.policy import split_requests
from ogspo.methods.features import EMA_ALPHA
from ogspo.methods.routing import router_features
from ogspo.offline.replay import replay, replay_cycles, structure_mask

# ---------------------------------------------------------------- features


# ---------------------------------------------------------------- the router (numpy inference)


# ---------------------------------------------------------------- runtime policy


# ---------------------------------------------------------------- offline data


@dataclass
class RoutingData:
    """Record cycles in request order with every template's replayed outcome."""

    templates: list[Structure]
    accepted: np.ndarray  # [C, K] A_ck (full-depth drafting of template k)
    seconds: np.ndarray  # [C, K] t_ck
    context_lengths: np.ndarray  # [C]
    requests: np.ndarray  # [C] request id (object)
    cycles: np.ndarray  # [C] cycle index within the request (rows sorted by request, then cycle)

    def subset(self, rows: np.ndarray) -> "RoutingData":
        rows = np.sort(rows)
        return RoutingData(self.templates, self.accepted[rows], self.seconds[rows], self.context_lengths[rows],
                           self.requests[rows], self.cycles[rows])


def check_templates(templates: list, T: Structure) -> list[Structure]:
    """Structures of the config's template list, each inside the records template T (one-line errors)."""
    if not isinstance(templates, list) or len(templates) < 2:
        raise ValueError("baselines.routing.templates must list at least 2 templates (lists of rank paths; [] = autoregressive)")
    out: list[Structure] = []
    for i, t in enumerate(templates):
        if not isinstance(t, list) or not all(isinstance(p, list) and all(isinstance(r, int) for r in p) for p in t):
            raise ValueError(f"baselines.routing.templates[{i}] is not a list of rank paths, e.g. [[0], [1], [0, 0]]")
        try:
            S = Structure(t)
        except ValueError as exc:
            raise ValueError(f"baselines.routing.templates[{i}]: {exc}") from None
        outside = [list(p) for p in sorted(S.paths) if p not in T]
        if outside:
            raise ValueError(f"baselines.routing.templates[{i}]: node {outside[0]} is not in the records template "
                             f"(depth {T.max_depth}, {len(T)} nodes); templates must be sub-structures of it")
        if any(S.paths == o.paths for o in out):
            raise ValueError(f"baselines.routing.templates[{i}] repeats an earlier template")
        out.append(S)
    return out


def routing_data(*, records: Records, templates: list[Structure], latency: LatencyModel) -> RoutingData:
    cyc = replay_cycles(records)
    for S in templates:
        structure_mask(S, cyc.template)  # raises on a node outside the template
    res = replay(cycles=cyc, structures=templates, depths=np.array([S.max_depth for S in templates]), model=latency)
    rid = np.asarray(records.cycles["request_id"].to_list(), dtype=object)
    cidx = records.cycles["cycle"].to_numpy().astype(np.int64)
    order = np.lexsort((cidx, rid))
    return RoutingData(templates, res.accepted.T[order].astype(np.float64), res.seconds.T[order], cyc.context_lengths[order],
                       rid[order], cidx[order])


def combine_routing(parts: list[RoutingData]) -> RoutingData:
    if not parts:
        raise ValueError("no records given")
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    data = RoutingData(parts[0].templates, cat("accepted"), cat("seconds"), cat("context_lengths"), cat("requests"),
                       cat("cycles"))
    order = np.lexsort((data.cycles, data.requests))
    return data.subset(order)


def simulate_router(data: RoutingData, choose: Callable[[np.ndarray], int]) -> tuple[np.ndarray, np.ndarray]:
    """Features and choices of a router run over each request's cycles in order. -> ([C, F], [C])"""
    C = len(data.requests)
    depths = [S.max_depth for S in data.templates]
    X = np.zeros((C, len(ROUTER_FEATURES)))
    choice = np.zeros(C, dtype=np.int64)
    ema, commit, last_depth, prev = 0.0, 0, None, None
    for c in range(C):
        if data.requests[c] != prev:
            ema, commit, last_depth, prev = 0.0, 0, None, data.requests[c]
        elif last_depth is not None:
            ema = (1 - EMA_ALPHA) * ema + EMA_ALPHA * commit
        X[c] = router_features(context_length=float(data.context_lengths[c]), recent_accept=ema, last_commit=commit,
                               last_depth=last_depth)
        k = int(choose(X[c]))
        choice[c] = k
        commit, last_depth = int(data.accepted[c, k]), depths[k]
    return X, choice


def routed_throughput(data: RoutingData, choice: np.ndarray) -> float:
    rows = np.arange(len(choice))
    return float(data.accepted[rows, choice].sum() / data.seconds[rows, choice].sum())


def fixed_throughputs(data: RoutingData) -> np.ndarray:
    """J of routing every cycle to template k. [K]"""
    return data.accepted.sum(0) / data.seconds.sum(0)


def per_cycle_bound(data: RoutingData, tol: float = 1e-12) -> float:
    """Best template per cycle in hindsight (Dinkelbach): an upper bound for any router over these templates."""
    A, t = data.accepted, data.seconds
    rows = np.arange(len(A))
    lam = float(fixed_throughputs(data).max())
    while True:
        k = np.argmax(A - lam * t, axis=1)
        new = float(A[rows, k].sum() / t[rows, k].sum())
        if new <= lam * (1 + tol):
            return max(new, lam)
        lam = new


# ---------------------------------------------------------------- training


def fit_router(*, X: np.ndarray, gains: np.ndarray, templates: list[Structure], lam: float, settings: dict, seed: int) -> Router:
    """Maximise the expected normalised net gain of a softmax over template scores. X [C, F], gains [C, K]."""
    import torch

    C, F = X.shape
    K = gains.shape[1]
    mean = X.mean(0)
    scale = np.maximum(X.std(0), 1e-3)
    g = gains - gains.mean(1, keepdims=True)
    g = g / max(float(g.std()), 1e-9)
    torch.manual_seed(seed)
    hidden = int(settings["hidden"])
    net = (torch.nn.Linear(F, K) if hidden == 0 else
           torch.nn.Sequential(torch.nn.Linear(F, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, K))).double()
    x = torch.from_numpy((X - mean) / scale)
    y = torch.from_numpy(g)
    opt = torch.optim.Adam(net.parameters(), lr=float(settings["lr"]), weight_decay=float(settings["weight_decay"]))
    for _ in range(int(settings["steps"])):
        opt.zero_grad()
        loss = -(torch.softmax(net(x), dim=1) * y).sum(1).mean()
        loss.backward()
        opt.step()
    linears = [m for m in (net if hidden else [net]) if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in linears]
    return Router(templates=templates, mean=mean, scale=scale, layers=layers, lam=float(lam))


@dataclass
class RoutingEvaluation:
    n_cycles: int
    throughput: float  # J(router), record surrogate with the router's own features
    fixed_throughputs: dict[str, float]  # J of each template alone
    best_fixed: str
    best_fixed_throughput: float
    per_cycle_bound: float  # best template per cycle in hindsight
    choices: dict[str, int]  # cycles routed to each template


def evaluate_router(data: RoutingData, router: Router) -> RoutingEvaluation:
    _, choice = simulate_router(data, lambda f: router.choose(f)[0])
    names = [template_name(S) for S in data.templates]
    fixed = fixed_throughputs(data)
    b = int(np.argmax(fixed))
    return RoutingEvaluation(
        n_cycles=len(choice), throughput=routed_throughput(data, choice),
        fixed_throughputs={n: float(j) for n, j in zip(names, fixed)}, best_fixed=names[b],
        best_fixed_throughput=float(fixed[b]), per_cycle_bound=per_cycle_bound(data),
        choices={n: int(c) for n, c in zip(names, np.bincount(choice, minlength=len(names)))},
    )


def routing_settings(config: dict | None) -> dict:
    """The `baselines.routing` section (or a config holding it) over the defaults (`artifacts.settings`)."""
    return settings("baselines.routing", config)


@dataclass
class RoutingTrainResult:
    router: Router
    lambdas: list[float]
    round_throughputs: list[float]  # training-set J per round
    train: RoutingEvaluation
    holdout: RoutingEvaluation | None
    n_train_requests: int
    n_holdout_requests: int
    seconds: float
    settings: dict


def train_router(*, data: RoutingData, seed: int, config: dict | None = None) -> RoutingTrainResult:
    """Dinkelbach rounds: simulate the behaviour router for features, fit at lambda, keep the best on train."""
    cfg = routing_settings(config)
    t0 = time.perf_counter()
    tr, ho = split_requests(data.requests, fraction=float(cfg["holdout_fraction"]), seed=seed)
    train = data.subset(tr)
    fixed = fixed_throughputs(train)
    lam = float(fixed.max())
    best_k = int(np.argmax(fixed))
    behaviour: Callable[[np.ndarray], int] = lambda f: best_k  # noqa: E731
    best: tuple[float, Router] | None = None
    lambdas, Js = [], []
    for r in range(int(cfg["rounds"])):
        X, _ = simulate_router(train, behaviour)
        router = fit_router(X=X, gains=train.accepted - lam * train.seconds, templates=data.templates, lam=lam,
                            settings=cfg, seed=seed + r)
        J = routed_throughput(train, simulate_router(train, lambda f, m=router: m.choose(f)[0])[1])
        lambdas.append(lam)
        Js.append(J)
        if best is None or J > best[0]:
            best = (J, router)
        if J <= lam * (1 + 1e-9):
            break
        lam = J
        behaviour = lambda f, m=router: m.choose(f)[0]  # noqa: E731
    router = best[1]
    return RoutingTrainResult(
        router=router, lambdas=lambdas, round_throughputs=Js, train=evaluate_router(train, router),
        holdout=evaluate_router(data.subset(ho), router) if len(ho) else None,
        n_train_requests=len(set(train.requests.tolist())), n_holdout_requests=len(set(data.requests[ho].tolist())),
        seconds=time.perf_counter() - t0, settings=cfg,
    )


# ---------------------------------------------------------------- stage: train-routing
