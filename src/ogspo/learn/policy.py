"""OGSPO policy update (docs/DESIGN.md §5): a stop policy evaluated *during* drafting, learned from records.

**State features.** After drafting level d of a cycle under a structure S, `state_features` turns what
drafting has revealed so far into a fixed vector (order = `FEATURE_NAMES`, version `FEATURES_VERSION`).
It is one pure function of a `DraftTree`, used online (the engine's stop hook gets the tree drafted so
far) and offline (`offline_states` rebuilds, from the record rows of the nodes of S, the tree that
`StaticTree(S)` would have drafted and calls the same function), so both see the same numbers.

| # | name | meaning (level-d nodes = the nodes drafted at level d) |
|---|---|---|
| 0 | level | d |
| 1 | log_nodes | log(1 + drafted nodes of depth <= d) |
| 2 | log_width | log(1 + number of level-d nodes) |
| 3 | max_cum_prob | max over level-d nodes of exp(cumulative drafter log-prob) |
| 4 | mean_cum_prob | mean of the same |
| 5 | sum_cum_prob | sum of the same (drafter's estimate of reaching depth d) |
| 6 | top1_cum_logq | cumulative log-prob of the deepest rank-0 chain node at depth <= d (floored at -30) |
| 7 | mean_entropy | mean drafter entropy at the parents of the level-d nodes |
| 8 | max_prob | max drafter prob of a level-d token given its parent |
| 9 | log_context | log(1 + committed context length) |
| 10 | recent_accept | EMA (alpha `EMA_ALPHA`, start 0) of tokens committed per earlier cycle of the request |
| 11 | top2_cum_prob | sum of the two largest cumulative probabilities at level d (LTD's top-k draft scores) |
| 12 | top4_cum_prob | sum of the four largest |
| 13 | next_gain | sum over level-d nodes of cumulative prob x own conditional prob (`learn.threshold`'s marginal gain) |
| 14 | last_accept | tokens the request's previous cycle committed (0 on its first) |

`next_gain` is the drafter's estimate of the tokens level d + 1 would add, if each node's best child were
as likely as the node itself was given its parent.

`recent_accept` and `last_accept` (the request's `History`) online are measured as the growth of the
committed context between consecutive cycles (`RecentAccept`); offline they come from A_c'(S, D_S) of
the request's earlier record cycles c' (what S would have committed without an early stop). A running
policy that stops early commits at most that, so online values are censored versions of the offline
ones (a mild, known train/deploy shift).

**Net gains and training.** With S fixed and lambda the current throughput estimate,
G_c(d) = A_c(S, d) - lambda t_c(S, d) (tokens; replay + latency model). The *policy head* (small MLP
over standardised features, one output) predicts the advantage of continuing over stopping now and
is fitted by backward induction / fitted Q iteration: V_c(D) = G_c(D); V_c(d) = G_c(d) if the current
head stops at d, else V_c(d+1); regression target at level d < D: V_c(d+1) - G_c(d). Sweeps refit on
all levels (warm start) until the deepest decisions have propagated up. lambda follows Dinkelbach:
start at the best fixed depth's throughput, retrain at lambda = J(pi), keep the best policy.
Decision rule: stop when the predicted advantage <= 0 (depth D always stops).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ogspo.artifacts.io import atomic_write
from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records, path_str
from ogspo.artifacts.settings import settings
from ogspo.engine.tree import DraftTree, Structure
from ogspo.methods.features import EMA_ALPHA, FEATURE_NAMES, FEATURES_VERSION, N_FEATURES, History, state_features
from ogspo.offline.replay import replay, replay_cycles

# ---------------------------------------------------------------- features


# ---------------------------------------------------------------- offline states and gains


@dataclass
class PolicyData:
    """Per cycle c and level d = 1..D (index d-1) of structure S: features and replayed A, t."""

    structure: Structure
    features: np.ndarray  # [C, D, F] float32
    accepted: np.ndarray  # [C, D] A_c(S, d)
    seconds: np.ndarray  # [C, D] t_c(S, d)
    requests: np.ndarray  # [C] request id per cycle (str)

    @property
    def depth(self) -> int:
        return self.features.shape[1]

    def subset(self, rows: np.ndarray) -> "PolicyData":
        return PolicyData(self.structure, self.features[rows], self.accepted[rows], self.seconds[rows], self.requests[rows])


def _history_per_request(requests: np.ndarray, cycles: np.ndarray, values: np.ndarray) -> list[History]:
    """Per cycle the `History` of its request's earlier cycles: the EMA of `values` over them and the
    previous one's value (both 0 on a request's first cycle), computed as `RecentAccept` does online."""
    out = [History()] * len(values)
    order = np.lexsort((cycles, requests))
    ema, last, prev = 0.0, 0.0, None
    for i in order:
        if requests[i] != prev:
            ema, last, prev = 0.0, 0.0, requests[i]
        out[i] = History(ema, last)
        last = float(values[i])
        ema = (1 - EMA_ALPHA) * ema + EMA_ALPHA * last
    return out


def offline_states(*, records: Records, structure: Structure, latency: LatencyModel) -> PolicyData:
    """States and replayed outcomes of every record cycle under `structure` (a sub-structure of T)."""
    S, T = structure, records.template
    D = S.max_depth
    if D < 1:
        raise ValueError("the policy's structure has no nodes")
    missing = [list(p) for p in S.paths if p not in T]
    if missing:
        raise ValueError(f"structure node {missing[0]} is not in the records template")
    cyc = replay_cycles(records)
    res = replay(cycles=cyc, structures=[S] * D, depths=np.arange(1, D + 1), model=latency)
    accepted, seconds = res.accepted.T.astype(np.float64), res.seconds.T  # [C, D]
    ctab = records.cycles
    rid = np.asarray(ctab["request_id"].to_list(), dtype=object)
    cidx = ctab["cycle"].to_numpy()
    hist = _history_per_request(rid, cidx, accepted[:, D - 1])  # [C]

    keep = {path_str(p) for p in S.paths}
    nodes = records.nodes.filter(records.nodes["rank_path"].is_in(list(keep))).sort(["request_id", "cycle", "node"])
    n_rid = np.asarray(nodes["request_id"].to_list(), dtype=object)
    n_cyc = nodes["cycle"].to_numpy()
    cols = {k: nodes[k].to_numpy() for k in ("node", "parent", "depth", "token", "logq", "entropy")}
    ranks = np.array([int(p.rsplit(".", 1)[-1]) for p in nodes["rank_path"].to_list()], dtype=np.int64)
    # slice of node rows per (request, cycle)
    key_change = np.ones(len(n_cyc), dtype=bool)
    key_change[1:] = (n_rid[1:] != n_rid[:-1]) | (n_cyc[1:] != n_cyc[:-1])
    starts = np.nonzero(key_change)[0]
    bounds = dict(zip(zip(n_rid[starts], n_cyc[starts]), zip(starts, np.append(starts[1:], len(n_cyc)))))

    C = len(rid)
    feats = np.zeros((C, D, N_FEATURES), dtype=np.float32)
    ctx = ctab["context_length"].to_numpy()
    root = ctab["root_token"].to_numpy()
    for c in range(C):
        a, b = bounds.get((rid[c], int(cidx[c])), (0, 0))
        tree = _record_tree(int(root[c]), {k: v[a:b] for k, v in cols.items()}, ranks[a:b])
        reach = int(tree.depths.max())
        for d in range(1, D + 1):
            lv = min(d, reach)  # a drafter that ran out of candidates: repeat the last state
            if lv == 0:
                continue
            feats[c, d - 1] = state_features(tree, lv, context_length=int(ctx[c]), history=hist[c])
    return PolicyData(S, feats, accepted, seconds, rid)


def _record_tree(root: int, rows: dict[str, np.ndarray], ranks: np.ndarray) -> DraftTree:
    """The breadth-first tree StaticTree(S) drafts, rebuilt from a cycle's record rows of S's nodes."""
    n = len(ranks) + 1
    remap = np.full(int(rows["node"].max(initial=0)) + 1, -1, dtype=np.int64)
    remap[0] = 0
    remap[rows["node"]] = np.arange(1, n)
    return DraftTree(
        tokens=np.concatenate([[root], rows["token"]]).astype(np.int64),
        parents=np.concatenate([[-1], remap[rows["parent"]]]).astype(np.int64),
        depths=np.concatenate([[0], rows["depth"]]).astype(np.int64),
        ranks=np.concatenate([[0], ranks]).astype(np.int64),
        logq=np.concatenate([[0.0], rows["logq"]]).astype(np.float64),
        entropy=np.concatenate([[0.0], rows["entropy"]]).astype(np.float64),
    )


# ---------------------------------------------------------------- head and training


class PolicyHead(torch.nn.Module):
    """features [B, F] -> advantage of continuing over stopping now [B] (stop when <= 0)."""

    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("scale", torch.ones(n_features))
        self.net = torch.nn.Sequential(
            torch.nn.Linear(n_features, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = (features - self.mean) / self.scale  # [B, F]
        return self.net(x).squeeze(-1)  # [B]

    @torch.no_grad()
    def advantage(self, features: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.asarray(features, dtype=np.float32).reshape(-1, self.mean.shape[0]))  # [B, F]
        return self(x).numpy()  # [B]


def stop_depths(advantage: np.ndarray) -> np.ndarray:
    """First level whose advantage is <= 0 (1-based), else the last level. advantage [C, D] -> [C]."""
    C, D = advantage.shape
    stop = advantage <= 0  # [C, D]
    stop[:, D - 1] = True
    return stop.argmax(axis=1) + 1


def policy_depths(head: PolicyHead, data: PolicyData) -> np.ndarray:
    C, D, F = data.features.shape
    adv = head.advantage(data.features.reshape(C * D, F)).reshape(C, D)  # [C, D]
    return stop_depths(adv)


def _realised_values(gains: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """V_c(d) under the head's decisions, bottom-up. gains/adv [C, D] -> [C, D]."""
    V = gains.copy()
    for d in range(gains.shape[1] - 2, -1, -1):
        V[:, d] = np.where(adv[:, d] <= 0, gains[:, d], V[:, d + 1])
    return V


def fit_head(*, data: PolicyData, lam: float, seed: int, settings: dict, head: PolicyHead | None = None) -> PolicyHead:
    """Fitted Q iteration (backward induction) of the head at throughput estimate `lam`."""
    C, D, F = data.features.shape
    gains = data.accepted - lam * data.seconds  # [C, D] tokens
    torch.manual_seed(seed)
    if head is None:
        head = PolicyHead(F, int(settings["hidden"]))
        x = data.features[:, : max(D - 1, 1)].reshape(-1, F)
        head.mean.copy_(torch.from_numpy(x.mean(0)))
        head.scale.copy_(torch.from_numpy(np.maximum(x.std(0), 1e-3)))
    if D == 1:
        return head
    X = torch.from_numpy(data.features[:, : D - 1].reshape(-1, F))  # [C*(D-1), F]
    Xall = torch.from_numpy(data.features.reshape(-1, F))  # [C*D, F]
    opt = torch.optim.Adam(head.parameters(), lr=float(settings["lr"]), weight_decay=float(settings["weight_decay"]))
    sweeps = int(settings["sweeps"]) or D + 2
    for _ in range(sweeps):
        with torch.no_grad():
            adv = head(Xall).numpy().reshape(C, D)
        V = _realised_values(gains, adv)
        y = torch.from_numpy((V[:, 1:] - gains[:, :-1]).reshape(-1).astype(np.float32))  # [C*(D-1)]
        for _ in range(int(settings["steps_per_sweep"])):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(head(X), y)
            loss.backward()
            opt.step()
    return head.eval()


# ---------------------------------------------------------------- evaluation


def _ratio(A: np.ndarray, t: np.ndarray, d: np.ndarray) -> tuple[float, float, float]:
    rows = np.arange(len(d))
    a, s = A[rows, d - 1], t[rows, d - 1]
    return float(a.sum() / s.sum()), float(a.mean()), float(s.mean())


def posterior_bound(A: np.ndarray, t: np.ndarray, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """Per-cycle posterior-optimal depths for a fixed S (exact Dinkelbach). A, t [C, D] -> ([C] depths, J)."""
    rows = np.arange(A.shape[0])
    d = np.full(A.shape[0], A.shape[1] - 1)
    lam = A[rows, d].sum() / t[rows, d].sum()
    while True:
        d = np.argmax(A - lam * t, axis=1)
        new = A[rows, d].sum() / t[rows, d].sum()
        if new <= lam * (1 + tol):
            return d + 1, float(max(new, lam))
        lam = new


@dataclass
class PolicyEvaluation:
    """Surrogate throughput J(S, pi) = sum A / sum t on records, next to fixed depths and the bound."""

    n_cycles: int
    throughput: float  # J(S, pi), tokens/s
    mean_accepted: float
    mean_seconds: float
    mean_depth: float
    stop_histogram: list[int]  # cycles stopping at depth d (index d-1)
    fixed_throughputs: list[float]  # J of stopping every cycle at d (index d-1)
    best_fixed_depth: int
    best_fixed_throughput: float
    posterior_bound: float  # per-cycle optimal depths for the same S (upper bound for any policy)
    oracle_throughput: float | None = None  # solve.py's oracle (its S, grouped depths), when given

    def to_markdown(self, title: str) -> str:
        fx = ", ".join(f"d={d}: {j:.3f}" for d, j in enumerate(self.fixed_throughputs, 1))
        lines = [
            f"#### {title} ({self.n_cycles} cycles)", "",
            "| | tokens/s | vs best fixed |", "|---|---|---|",
            f"| OGSPO policy | {self.throughput:.3f} | {self.throughput / self.best_fixed_throughput:.3f}x |",
            f"| best fixed depth ({self.best_fixed_depth}) | {self.best_fixed_throughput:.3f} | 1.000x |",
            f"| posterior bound (same S) | {self.posterior_bound:.3f} | {self.posterior_bound / self.best_fixed_throughput:.3f}x "
            "|",
        ]
        if self.oracle_throughput is not None:
            lines.append(f"| oracle (solve.py) | {self.oracle_throughput:.3f} | "
                         f"{self.oracle_throughput / self.best_fixed_throughput:.3f}x |")
        lines += ["", f"Policy: mean accepted {self.mean_accepted:.3f}, mean depth {self.mean_depth:.2f}, "
                  f"stops by depth {self.stop_histogram}. Fixed depths: {fx}."]
        return "\n".join(lines) + "\n"


def evaluate_policy(*, data: PolicyData, depths: np.ndarray, oracle_throughput: float | None = None) -> PolicyEvaluation:
    A, t = data.accepted, data.seconds
    C, D = A.shape
    J, a, s = _ratio(A, t, depths)
    fixed = [float(A[:, d].sum() / t[:, d].sum()) for d in range(D)]
    best = int(np.argmax(fixed))
    _, bound = posterior_bound(A, t)
    return PolicyEvaluation(
        n_cycles=C, throughput=J, mean_accepted=a, mean_seconds=s, mean_depth=float(depths.mean()),
        stop_histogram=np.bincount(depths - 1, minlength=D).tolist(), fixed_throughputs=fixed,
        best_fixed_depth=best + 1, best_fixed_throughput=fixed[best], posterior_bound=bound,
        oracle_throughput=oracle_throughput,
    )


# ---------------------------------------------------------------- public training entry


@dataclass
class PolicyTrainResult:
    head: PolicyHead
    structure: Structure
    lam: float  # throughput estimate the kept head was trained at
    lambdas: list[float]  # per Dinkelbach round
    round_throughputs: list[float]  # training-set J per round
    train: PolicyEvaluation
    holdout: PolicyEvaluation | None
    n_train_requests: int
    n_holdout_requests: int
    seconds: float
    settings: dict = field(default_factory=dict)


def policy_settings(config: dict | None) -> dict:
    """The `policy` section (or a config holding it) over the defaults (`artifacts.settings`)."""
    return settings("policy", config)


def split_requests(requests: np.ndarray, *, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train / held-out row indices, split by request (deterministic given the seed)."""
    names = np.array(sorted(set(requests.tolist())), dtype=object)
    n_hold = int(round(fraction * len(names))) if len(names) >= 2 else 0
    n_hold = min(n_hold, len(names) - 1)
    hold = set(np.random.default_rng(seed).permutation(names)[:n_hold].tolist())
    is_hold = np.array([r in hold for r in requests], dtype=bool)
    return np.nonzero(~is_hold)[0], np.nonzero(is_hold)[0]


def train_policy(
    *, data: PolicyData, seed: int, config: dict | None = None, oracle_throughput: float | None = None,
) -> PolicyTrainResult:
    """Dinkelbach rounds over lambda, each a backward-induction fit of the head; keep the best on train."""
    cfg = policy_settings(config)
    t0 = time.perf_counter()
    tr, ho = split_requests(data.requests, fraction=float(cfg["holdout_fraction"]), seed=seed)
    train_data = data.subset(tr)
    lam = evaluate_policy(data=train_data, depths=np.full(len(tr), 1)).best_fixed_throughput
    best: tuple[float, PolicyHead, float] | None = None
    lambdas, Js = [], []
    for r in range(int(cfg["rounds"])):
        head = fit_head(data=train_data, lam=lam, seed=seed + r, settings=cfg)
        J = evaluate_policy(data=train_data, depths=policy_depths(head, train_data)).throughput
        lambdas.append(float(lam))
        Js.append(J)
        if best is None or J > best[0]:
            best = (J, head, float(lam))
        if J <= lam * (1 + 1e-9):
            break
        lam = J
    _, head, lam_kept = best
    ev_train = evaluate_policy(data=train_data, depths=policy_depths(head, train_data), oracle_throughput=oracle_throughput)
    ev_hold = None
    if len(ho):
        hd = data.subset(ho)
        ev_hold = evaluate_policy(data=hd, depths=policy_depths(head, hd), oracle_throughput=oracle_throughput)
    return PolicyTrainResult(
        head=head, structure=data.structure, lam=lam_kept, lambdas=lambdas, round_throughputs=Js, train=ev_train,
        holdout=ev_hold, n_train_requests=len(set(data.requests[tr].tolist())),
        n_holdout_requests=len(set(data.requests[ho].tolist())), seconds=time.perf_counter() - t0, settings=cfg,
    )


HEAD_FILE = "policy.pt"


def save_head(*, head: PolicyHead, structure: Structure, lam: float, path: Path, meta: dict | None = None) -> None:
    """`head` as a torch state dict plus plain meta (structure, lambda, features) at `path` (temp + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {
        "state_dict": head.state_dict(),
        "meta": {
            "hidden": int(head.net[0].out_features), "n_features": int(head.net[0].in_features),
            "features_version": FEATURES_VERSION, "feature_names": list(FEATURE_NAMES),
            "structure": structure.to_list(), "lambda": float(lam), **(meta or {}),
        },
    }
    atomic_write(path, lambda tmp: torch.save(blob, tmp))


def load_head(path: Path) -> tuple[PolicyHead, dict]:
    """(head in eval mode, meta) from a file written by `save_head`; one-line ValueError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy head {path} does not exist")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        meta, state = blob["meta"], blob["state_dict"]
    except Exception as exc:  # noqa: BLE001 - torch raises several error types for bad files
        raise ValueError(f"policy head {path} is not a file written by save_head ({exc.__class__.__name__})") from None
    if meta.get("features_version") != FEATURES_VERSION or tuple(meta.get("feature_names", ())) != FEATURE_NAMES:
        raise ValueError(f"policy head {path} uses features version {meta.get('features_version')}; this ogspo computes "
                         f"version {FEATURES_VERSION}: retrain the policy")
    head = PolicyHead(int(meta["n_features"]), int(meta["hidden"]))
    head.load_state_dict(state)
    return head.eval(), meta


def combine_data(parts: list[PolicyData]) -> PolicyData:
    if not parts:
        raise ValueError("no records given")
    S = parts[0].structure
    return PolicyData(
        S, np.concatenate([p.features for p in parts]), np.concatenate([p.accepted for p in parts]),
        np.concatenate([p.seconds for p in parts]), np.concatenate([p.requests for p in parts]),
    )


# ---------------------------------------------------------------- stage: train-policy
