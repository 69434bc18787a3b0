"""Alternating OGSPO rounds with same-trace correction (docs/DESIGN.md §5; stage: `stages.ogspo_rounds`).

Start from the oracle's structure S_0 (`solve/oracle_T{t}.json`). Round r:

1. **Policy update** (S_r fixed): fit the policy head on the records' states and net gains, exactly as
   `ogspo.learn.policy.train_policy` does; its *surrogate* J(S_r, pi_r) = sum A / sum t over every record
   cycle (replay + latency model), next to the posterior bound for S_r and the oracle bound.
2. **Same-trace check.** The candidate (exported to ONNX, run with onnxruntime as the engine's stop
   hook) is executed for real on a sample of record cycles: the first `rounds.prompts_per_workload`
   requests of every records folder, their cycles within the first `rounds.max_new_tokens` generated
   tokens. Each cycle is re-run with `SpeculativeEngine.cycle_from` from the recorded context and root
   with the recorded request seed and cycle index, i.e. the same random numbers (the records' request
   ids map to the workload prompts, tokenised as `collect-records` does). At every decision the hook
   takes, with probability `rounds.epsilon`, a uniformly random legal action (continue / stop) instead
   of the policy's; each decision is logged with its propensity
   (1 - eps) [action = policy's] + eps / 2. The state's `recent_accept` feature is the offline one of
   that record cycle (a lone `cycle_from` has no request history), so at eps = 0 the executed decisions
   are the offline ones and any gap is the record + latency model's error, not a state shift.
   Per executed cycle, realised committed tokens and measured cycle seconds are compared with the
   replay's A_c(S, d) and the latency model's t_c(S, d) at the depth d it actually stopped at.
3. **Correction (control variate).** corrected J(pi_r) = surrogate J(S_r, pi_r) + (J_realised - J_predicted)
   of the executed (eps-greedy pi_r) cycles, both sum A / sum t over the same cycles: the surrogate on
   all records plus the model error measured on this policy's own executions. (A self-normalised
   inverse-propensity estimate of the greedy candidate's realised J from the logged decisions,
   `ipw_J`, is reported next to it as a diagnostic; it is not used to decide.)
   The candidate is accepted only when its corrected J exceeds the incumbent's by more than the
   relative `rounds.tolerance` (the first candidate has no incumbent and is accepted). So the
   incumbent's corrected J never decreases across accepted rounds (checked). A rejected candidate ends
   the rounds: the next structure update would start from the same incumbent and repeat itself.
4. **Structure update** (incumbent policy fixed): per record cycle the incumbent's stop depth under
   S_r (a deterministic policy: P_c(stop at d) is one-hot), then `solve_structure` (Dinkelbach + SCIP)
   gives S_{r+1}; the next round re-fits the policy for it. The rounds end when a candidate is rejected,
   the structure update keeps S (or empties it), or after `rounds.max_rounds` rounds.

Outputs (`write_rounds`): `rounds.parquet` (one row per round), `same_trace.parquet` (one row per
executed cycle, its decisions as list columns), `rounds.png`, `rounds.json`, and the incumbent's
`policy.pt` (`ogspo.learn.policy.save_head`) + `structure.json`. An empty oracle structure (autoregressive
decoding is best) writes zero rounds, that fact, an empty structure and no head (`export_policy` then
writes an autoregressive policy folder).

Stop depth 0 (verifying the root alone, `solve.min_depth: 0`) is not a policy action: the policy's first
decision comes after level 1, and the structure update puts no probability on depth 0.
"""

from __future__ import annotations

import math
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import Records
from ogspo.artifacts.settings import settings
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import TreeDrafter
from ogspo.engine.policies import CycleContext, StaticTree
from ogspo.engine.target import TreeLM
from ogspo.engine.tree import DraftTree, Structure
from ogspo.learn.export import export_policy
from ogspo.learn.policy import (
    PolicyData,
    PolicyHead,
    combine_data,
    evaluate_policy,
    offline_states,
    policy_depths,
    train_policy,
)
from ogspo.learn.ship import ShipDecision
from ogspo.methods.features import FEATURE_NAMES, History, state_features
from ogspo.methods.ogspo import OnnxPolicy
from ogspo.offline.replay import replay, replay_cycles
from ogspo.offline.solve import combine_cycles, solve_structure

RECENT, LAST = FEATURE_NAMES.index("recent_accept"), FEATURE_NAMES.index("last_accept")


def rounds_settings(config: dict | None) -> dict:
    cfg = settings("rounds", config)
    if float(cfg["keep_margin"]) < 0:
        raise ValueError(f"rounds.keep_margin must be >= 0, got {cfg['keep_margin']}")
    if not 0 <= float(cfg["epsilon"]) <= 1:
        raise ValueError(f"rounds.epsilon must be in [0, 1], got {cfg['epsilon']}")
    if int(cfg["max_rounds"]) < 1 or int(cfg["prompts_per_workload"]) < 1 or int(cfg["max_new_tokens"]) < 1:
        raise ValueError("rounds.max_rounds, rounds.prompts_per_workload and rounds.max_new_tokens must be >= 1")
    return cfg


# ---------------------------------------------------------------- same-trace executions


@dataclass
class Decision:
    level: int
    policy_stop: bool  # what the policy said
    stop: bool  # the action taken
    explored: bool  # taken at random (probability epsilon)
    propensity: float  # probability of `stop` under the eps-greedy behaviour policy


def propensity(*, stop: bool, policy_stop: bool, epsilon: float) -> float:
    """P(action) under eps-greedy over the two legal actions (continue, stop)."""
    return (1.0 - epsilon) * float(stop == policy_stop) + epsilon / 2.0


class ExploringStop:
    """Stop hook of same-trace executions: the policy's decision on the online state, replaced with
    probability epsilon by a uniformly random legal action; every decision is logged."""

    def __init__(self, *, decide: Callable[[np.ndarray], bool], epsilon: float):
        self.decide, self.epsilon = decide, float(epsilon)
        self.history = History()
        self.rng = np.random.default_rng(0)
        self.log: list[Decision] = []

    def start_cycle(self, *, history: History, rng: np.random.Generator) -> None:
        """Before each `cycle_from`: the record's `History` (a lone cycle has no request history) and the
        cycle's exploration randomness."""
        self.history, self.rng = history, rng
        self.log = []

    def __call__(self, tree: DraftTree, level: int, ctx: CycleContext) -> bool:
        f = state_features(tree, level, context_length=ctx.context_length, history=self.history)
        policy_stop = bool(self.decide(f))
        explored = bool(self.rng.random() < self.epsilon)
        coin = bool(self.rng.random() < 0.5)
        stop = coin if explored else policy_stop
        p = propensity(stop=stop, policy_stop=policy_stop, epsilon=self.epsilon)
        self.log.append(Decision(level, policy_stop, stop, explored, p))
        return stop


@dataclass
class SameTraceSetup:
    """What same-trace executions run on: the engine's target and drafter, and the records' prompts."""

    target: TreeLM
    drafter: TreeDrafter
    prompts: dict[str, list[int]]  # request id -> prompt tokens


def sample_requests(records: Records, n: int) -> list[str]:
    """The first `n` request ids of a records folder (sorted: deterministic)."""
    return sorted(set(records.cycles["request_id"].to_list()))[:n]


SAME_TRACE_SCHEMA = {
    "request_id": pl.String, "cycle": pl.Int32, "depth": pl.Int32, "realised_accepted": pl.Int32,
    "realised_seconds": pl.Float64, "predicted_accepted": pl.Int32, "predicted_seconds": pl.Float64,
    "tokens_agree": pl.Boolean, "levels": pl.List(pl.Int32), "policy_stop": pl.List(pl.Boolean),
    "stop": pl.List(pl.Boolean), "explored": pl.List(pl.Boolean), "propensity": pl.List(pl.Float64),
}


def same_trace(
    *,
    setup: SameTraceSetup,
    records: Records,
    data: PolicyData,
    decide: Callable[[np.ndarray], bool],
    latency: LatencyModel,
    epsilon: float,
    seed: int,
    request_ids: list[str],
    max_new_tokens: int,
) -> pl.DataFrame:
    """Re-run the record cycles of `request_ids` (those within `max_new_tokens` generated tokens) for real
    under `data.structure` with the eps-greedy policy as stop hook; one row per cycle (`SAME_TRACE_SCHEMA`).

    `data` = `offline_states(records, data.structure)` (row c = records.cycles row c). One function on
    purpose (~80 lines): the stop hook, the cycle loop and the row it writes share the per-cycle state
    (decisions, propensities, the record row being replayed)."""
    S = data.structure
    temperature = float(records.meta["temperature"])
    hook = ExploringStop(decide=decide, epsilon=epsilon)
    engine = SpeculativeEngine(target=setup.target, policy=StaticTree(S, name="ogspo"), drafter=setup.drafter,
                               temperature=temperature, stop_hook=hook)
    ctab = records.cycles
    rows: dict[str, list] = {k: [] for k in SAME_TRACE_SCHEMA}
    executed: list[int] = []
    depths: list[int] = []
    realised: list[list[int]] = []
    wanted = set(request_ids)
    seq: dict[str, list[int]] = {}
    prompt_len: dict[str, int] = {}
    order = np.lexsort((ctab["cycle"].to_numpy(), np.asarray(ctab["request_id"].to_list(), dtype=object)))
    for c in order:
        row = ctab.row(int(c), named=True)
        rid = row["request_id"]
        if rid not in wanted:
            continue
        if rid not in seq:
            if rid not in setup.prompts:
                raise ValueError(f"same-trace: no prompt for record request '{rid}'")
            prompt = list(setup.prompts[rid])
            if row["cycle"] != 1 or len(prompt) != row["context_length"]:
                raise ValueError(f"same-trace: prompt of '{rid}' ({len(prompt)} tokens) does not match its records "
                                 f"(context {row['context_length']} at cycle {row['cycle']}); wrong workloads or tokenizer?")
            seq[rid], prompt_len[rid] = prompt + [row["root_token"]], len(prompt)
        context, root = seq[rid][:-1], seq[rid][-1]
        seq[rid] = seq[rid] + list(row["committed"])
        if len(context) - prompt_len[rid] >= max_new_tokens:
            continue
        if root != row["root_token"] or len(context) != row["context_length"]:
            raise ValueError(f"same-trace: records of '{rid}' are not consecutive cycles (cycle {row['cycle']})")
        rng = np.random.default_rng([seed & (2**32 - 1), zlib.crc32(rid.encode()), int(row["cycle"])])
        hook.start_cycle(history=History(float(data.features[c, 0, RECENT]), float(data.features[c, 0, LAST])), rng=rng)
        stats, committed = engine.cycle_from(context, root, request_seed=int(row["request_seed"]), index=int(row["cycle"]),
                                             prompt_length=prompt_len[rid])
        executed.append(int(c))
        depths.append(stats.depth)
        realised.append(committed)
        rows["request_id"].append(rid)
        rows["cycle"].append(row["cycle"])
        rows["depth"].append(stats.depth)
        rows["realised_accepted"].append(stats.accepted)
        rows["realised_seconds"].append(stats.cycle_seconds)
        rows["levels"].append([d.level for d in hook.log])
        rows["policy_stop"].append([d.policy_stop for d in hook.log])
        rows["stop"].append([d.stop for d in hook.log])
        rows["explored"].append([d.explored for d in hook.log])
        rows["propensity"].append([d.propensity for d in hook.log])
    if not executed:
        raise ValueError(f"same-trace: no record cycles of requests {sorted(wanted)} in {records.meta.get('n_prompts')} prompts")
    cycles = replay_cycles(records)
    d_all = np.ones((1, len(ctab)), dtype=np.int64)
    d_all[0, executed] = depths
    rep = replay(cycles=cycles, structures=[S], depths=d_all, model=latency)
    A = rep.accepted[0, executed]
    rows["predicted_accepted"] = A.astype(int).tolist()
    rows["predicted_seconds"] = rep.seconds[0, executed].tolist()
    rec_committed = ctab["committed"].to_list()
    keep_bonus = temperature == 0  # at T > 0 the bonus is drawn from a residual that depends on the tree
    agree = []
    for c, a, got in zip(executed, A, realised):
        want = list(rec_committed[c][: int(a)])
        agree.append(len(got) == int(a) and (got == want if keep_bonus else got[:-1] == want[:-1]))
    rows["tokens_agree"] = agree
    return pl.DataFrame(rows, schema=SAME_TRACE_SCHEMA)


@dataclass
class SameTraceSummary:
    n_cycles: int
    n_decisions: int
    n_explored: int
    realised_J: float  # sum realised committed / sum measured cycle seconds
    predicted_J: float  # the same cycles and stop depths, from records + latency model
    ipw_J: float  # self-normalised inverse-propensity estimate of the greedy policy's realised J (diagnostic)
    token_agreement: float  # share of cycles whose committed tokens equal the replay's

    @property
    def correction(self) -> float:
        return self.realised_J - self.predicted_J


def summarize_same_trace(frame: pl.DataFrame) -> SameTraceSummary:
    A, t = frame["realised_accepted"].to_numpy().astype(float), frame["realised_seconds"].to_numpy()
    Ap, tp = frame["predicted_accepted"].to_numpy().astype(float), frame["predicted_seconds"].to_numpy()
    w = np.array([
        math.prod(float(s == p) / q for s, p, q in zip(stop, pol, prop))
        for stop, pol, prop in zip(frame["stop"].to_list(), frame["policy_stop"].to_list(), frame["propensity"].to_list())
    ])
    explored = frame["explored"].to_list()
    return SameTraceSummary(
        n_cycles=frame.height, n_decisions=sum(len(e) for e in explored), n_explored=sum(sum(e) for e in explored),
        realised_J=float(A.sum() / t.sum()), predicted_J=float(Ap.sum() / tp.sum()),
        ipw_J=float((w * A).sum() / (w * t).sum()) if w.sum() > 0 else float("nan"),
        token_agreement=float(frame["tokens_agree"].mean()),
    )


# ---------------------------------------------------------------- rounds


def improves(candidate: float, incumbent: float | None, tolerance: float) -> bool:
    """Accept a candidate whose corrected J beats the incumbent's by more than a relative `tolerance`."""
    return incumbent is None or candidate > incumbent * (1.0 + tolerance)


@dataclass
class RoundRow:
    round: int
    structure_size: int
    structure_depth: int
    surrogate_J: float  # J(S_r, pi_r) on all record cycles
    posterior_bound: float  # per-cycle optimal depths for S_r (bound for any policy with S_r)
    oracle_bound: float  # the oracle's J (bound over structures and policies)
    same_trace_J: float  # realised, executed eps-greedy cycles
    predicted_J: float  # records + latency model, the same cycles and depths
    corrected_J: float  # surrogate_J + same_trace_J - predicted_J
    ipw_J: float
    token_agreement: float
    accepted: bool
    incumbent_J: float  # corrected J of the incumbent after this round
    same_trace_cycles: int
    explored_decisions: int
    policy_fit_seconds: float
    same_trace_seconds: float
    structure_solve_seconds: float = float("nan")  # structure update after this round (NaN: none)
    structure_update_J: float = float("nan")  # its objective (incumbent's depths held fixed)


@dataclass
class RoundsResult:
    rows: list[RoundRow]
    structure: Structure  # the incumbent's (empty: autoregressive)
    head: PolicyHead | None
    lam: float | None
    incumbent_round: int | None
    stop_reason: str
    oracle_throughput: float | None
    same_trace: pl.DataFrame  # every round's executed cycles (`SAME_TRACE_SCHEMA` + round)
    structures: list[list[list[int]]] = field(default_factory=list)  # S_r per round
    settings: dict = field(default_factory=dict)
    ship: ShipDecision | None = None  # the keep/drop rule's decision (`learn.ship`), set by the rounds stage

    @property
    def autoregressive(self) -> bool:
        return len(self.structure) == 0


def check_monotone(rows: list[RoundRow]) -> None:
    """The incumbent's corrected J never decreases across accepted rounds (an invariant of `improves`)."""
    js = [r.corrected_J for r in rows if r.accepted]
    if any(b < a for a, b in zip(js, js[1:])):
        raise RuntimeError(f"OGSPO rounds: accepted corrected J decreased ({js}): acceptance bug")


def run_rounds(
    *,
    records: list[Records],
    latency: LatencyModel,
    structure: Structure,
    oracle_throughput: float | None,
    setup: Callable[[], SameTraceSetup],
    config: dict | None,
    seed: int,
) -> RoundsResult:
    """Alternate policy and structure updates from `structure` (the oracle's), with same-trace checks.

    `config` holds the `rounds`, `policy` and `solve` sections; `setup()` is called once, only when
    there is a structure to execute (it loads the model and drafter). One loop on purpose (~90 lines):
    a round's policy fit, same-trace check, acceptance test and structure update share the incumbent
    and the stop reason, which split functions would hand back and forth."""

    cfg = rounds_settings(config)
    settings = {"rounds": cfg, "policy": (config or {}).get("policy"), "solve": (config or {}).get("solve")}
    empty = pl.DataFrame(schema={"round": pl.Int32, **SAME_TRACE_SCHEMA})
    if len(structure) == 0:
        return RoundsResult(rows=[], structure=structure, head=None, lam=None, incumbent_round=None,
                            stop_reason="the oracle's structure is empty: autoregressive decoding is best on these records",
                            oracle_throughput=oracle_throughput, same_trace=empty, settings=settings)
    if not records:
        raise ValueError("no records folders given")
    eps, tol = float(cfg["epsilon"]), float(cfg["tolerance"])
    cycles = combine_cycles([replay_cycles(r) for r in records])
    samples = [sample_requests(r, int(cfg["prompts_per_workload"])) for r in records]
    st = setup()
    S = structure
    rows: list[RoundRow] = []
    frames: list[pl.DataFrame] = []
    structures: list[list[list[int]]] = []
    inc: tuple | None = None  # (round, head, S, lam, depths, corrected J)
    stop_reason = f"max_rounds ({cfg['max_rounds']}) reached"
    with tempfile.TemporaryDirectory(prefix="ogspo-rounds-") as tmp:
        for r in range(int(cfg["max_rounds"])):
            t0 = time.perf_counter()
            parts = [offline_states(records=rec, structure=S, latency=latency) for rec in records]
            data = combine_data(parts)
            fit = train_policy(data=data, seed=seed + r, config=(config or {}).get("policy"))
            depths = policy_depths(fit.head, data)
            ev = evaluate_policy(data=data, depths=depths, oracle_throughput=oracle_throughput)
            t1 = time.perf_counter()
            onnx = Path(tmp) / f"round-{r}.onnx"
            export_policy(head=fit.head, path=onnx, structure=S, lam=fit.lam)
            decide = OnnxPolicy(onnx).decide
            frame = pl.concat([
                same_trace(setup=st, records=rec, data=part, decide=decide, latency=latency, epsilon=eps,
                           seed=seed * 1000 + r, request_ids=ids, max_new_tokens=int(cfg["max_new_tokens"]))
                for rec, part, ids in zip(records, parts, samples)
            ])
            t2 = time.perf_counter()
            summ = summarize_same_trace(frame)
            corrected = ev.throughput + summ.correction
            accepted = improves(corrected, inc[5] if inc else None, tol)
            if accepted:
                inc = (r, fit.head, S, fit.lam, depths, corrected)
            row = RoundRow(
                round=r, structure_size=len(S), structure_depth=S.max_depth, surrogate_J=ev.throughput,
                posterior_bound=ev.posterior_bound,
                oracle_bound=oracle_throughput if oracle_throughput is not None else float("nan"),
                same_trace_J=summ.realised_J, predicted_J=summ.predicted_J, corrected_J=corrected, ipw_J=summ.ipw_J,
                token_agreement=summ.token_agreement, accepted=accepted, incumbent_J=inc[5], same_trace_cycles=summ.n_cycles,
                explored_decisions=summ.n_explored, policy_fit_seconds=t1 - t0, same_trace_seconds=t2 - t1,
            )
            rows.append(row)
            structures.append(S.to_list())
            frames.append(frame.with_columns(pl.lit(r, dtype=pl.Int32).alias("round")).select(["round", *SAME_TRACE_SCHEMA]))
            if not accepted:
                stop_reason = f"round {r}: corrected J {corrected:.4g} does not beat the incumbent's {inc[5]:.4g}"
                break
            if r + 1 == int(cfg["max_rounds"]):
                break
            # structure update with the incumbent policy fixed: its per-cycle stop depth under S (one-hot P)
            P = np.zeros((len(depths), cycles.template.max_depth + 1))
            P[np.arange(len(depths)), depths] = 1.0
            sres = solve_structure(cycles=cycles, latency=latency, stop_probs=P, config=(config or {}).get("solve"))
            row.structure_solve_seconds, row.structure_update_J = sres.solve_seconds, sres.throughput
            S_new = Structure(sres.structure)
            if len(S_new) == 0:
                stop_reason = f"round {r}: the structure update chose an empty structure; keeping the incumbent"
                break
            if S_new.paths == S.paths:
                stop_reason = f"round {r}: the structure update kept S (converged)"
                break
            S = S_new
    check_monotone(rows)
    r_inc, head, S_inc, lam, _, _ = inc
    return RoundsResult(
        rows=rows, structure=S_inc, head=head, lam=lam, incumbent_round=r_inc, stop_reason=stop_reason,
        oracle_throughput=oracle_throughput, same_trace=pl.concat(frames), structures=structures, settings=settings,
    )


# ---------------------------------------------------------------- outputs
