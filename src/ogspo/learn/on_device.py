"""What `ogspo` ships per workload, decided on the device among the few trees its records rank best
(stage `choose_on_device` writes it).

The keep/drop rule (`learn.ship`) ranks every candidate by replaying the records under the latency
model, which prices a tree to a few percent; on a 2-core CPU the trees it ranks near the top differ by
about that much (in one run the replay ranked Sequoia's 5-node tree above the one-token chain that
evaluation then measured faster, as tuned EAGLE-3: docs/BENCHMARKS.md). So the last choice is made
where the decisions pay, as tuned EAGLE-3's is (`stages.tune_eagle`):

- per workload, the candidates are the policy folder's own choice (the stop policy or a static tree),
  autoregressive decoding, and the `candidates` static trees with the highest replayed tokens/s on
  that workload's records among `learn.ship.static_candidates` (S cut at each depth, Sequoia's tree,
  the one- and two-token chains);
- they decode the first calib prompts side by side (cycle by cycle under `interleave`, mirrored
  orders), every request `max_new_tokens` long;
- each candidate's measured tokens/s is carried to the workload by its `sample_factor`: its replayed
  tokens/s on all the records' requests over that on the requests of these prompts (the device prices
  the cycles, the records' many prompts say how much they commit: three prompts decoded with the same
  seeds in every run had S<=1 5% ahead of AR where the records and evaluation put AR ahead);
- the highest corrected geometric-mean tokens/s ships; the folder's own choice stays unless another is
  faster by more than `margin` and a paired test over the prompts at `confidence` agrees (`decide`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import load_records
from ogspo.artifacts.structure import STRUCTURE_FILE, load_structure
from ogspo.engine.policies import Autoregressive, StaticTree, TreePolicy
from ogspo.engine.tree import Structure
from ogspo.learn.ship import static_candidates
from ogspo.methods.harness import engine_handles, gmean, make_method_engine, pair_seed, run_slot, slot_order, slot_seed
from ogspo.methods.ogspo import make_ogspo, workload_choice
from ogspo.methods.registry import MethodSpec
from ogspo.offline.replay import replay, replay_cycles

OWN = "own"  # the policy folder's own choice for a workload, as a candidate


@dataclass
class WorkloadChoice:
    workload: str
    own: str  # what the policy folder ships for it: "policy" or a static tree's name
    candidates: dict[str, list | None]  # name -> rank paths (None: the stop policy)
    replayed: dict[str, float]  # name -> replayed tokens/s on the workload's records (the own stop policy: absent)
    tokens_per_second: dict[str, list[float]]  # name -> measured tokens/s per calib prompt
    chosen: str  # OWN or a candidate's name
    sample_factor: dict[str, float] = field(default_factory=dict)  # name -> replayed J, all records / these prompts'

    def gmean(self, name: str) -> float:
        return gmean(self.tokens_per_second[name])


def replay_static(records_dir: Path, latency: LatencyModel, trees: Mapping[str, Structure],
                  request_ids: Collection[str] = ()) -> dict[str, tuple[float, float]]:
    """Per tree of `trees` inside the records' template (a tree that leaves it is left out): its replayed
    tokens/s under `latency` on one workload's records, on all requests and on `request_ids` alone (the
    same figure where none of them is in the records)."""
    records = load_records(Path(records_dir))
    cycles = replay_cycles(records)
    mine = records.cycles["request_id"].is_in(list(request_ids)).to_numpy()  # [C]
    mine = mine if mine.any() else np.ones_like(mine)
    inside = {n: s for n, s in trees.items() if all(p in cycles.template for p in s.paths)}
    names = list(inside)
    r = replay(cycles=cycles, structures=[inside[n] for n in names], depths=np.array([inside[n].max_depth for n in names]),
               model=latency)
    J = r.accepted.sum(axis=1) / r.seconds.sum(axis=1)  # [K]
    J_mine = r.accepted[:, mine].sum(axis=1) / r.seconds[:, mine].sum(axis=1)  # [K]
    return {n: (float(a), float(b)) for n, a, b in zip(names, J, J_mine)}


def fastest_first(J: Mapping[str, float]) -> dict[str, float]:
    """Tokens/s by name, fastest first."""
    return dict(sorted(J.items(), key=lambda x: -x[1]))


def rank_static(records_dir: Path, latency: LatencyModel, trees: Mapping[str, Structure]) -> dict[str, float]:
    """Replayed tokens/s of every tree of `trees` inside the records' template, on one workload's
    records under `latency`, fastest first (a tree that leaves the template is left out)."""
    return fastest_first({n: a for n, (a, _) in replay_static(records_dir, latency, trees).items()})


def candidate_trees(own: TreePolicy, ranked: dict[str, float], all_static: dict[str, Structure],
                    k: int) -> dict[str, list | None]:
    """The candidates of one workload: its own choice, the `k` best-replayed static trees other than it
    and autoregressive decoding, each tree once (a static own choice is not repeated under another name)."""
    out: dict[str, list | None] = {OWN: None if own.hook is not None else _paths(own)}
    seen = [] if out[OWN] is None else [out[OWN]]
    for name in [n for n in ranked if n != "ar"] + ["ar"]:
        paths = all_static[name].to_list()
        if paths in seen or (name != "ar" and len(out) > k):
            continue
        out[name] = paths
        seen.append(paths)
    return out


def _paths(p: TreePolicy) -> list:
    return [] if isinstance(p, Autoregressive) else p.structure.to_list()


def _static(paths: list, name: str) -> TreePolicy:
    return StaticTree(Structure([tuple(x) for x in paths]), name=name) if paths else Autoregressive(name=name)


def decide(throughput: Mapping[str, list[float]], margin: float, confidence: float = 0.0) -> str:
    """OWN unless the fastest candidate (geometric-mean tokens/s) beats OWN's by more than `margin` and,
    with `confidence` > 0, a paired one-sided t-test over the prompts says so: the lower `confidence`
    bound of its mean log tokens/s ratio to OWN is above log(1 + margin) (fewer than two prompts: no
    test, OWN stays). Three calib prompts of 64 tokens move a gmean by a few percent, and a rule that
    took any lead switched on ties (49.5 against 49.2 tokens/s) that evaluation then reversed."""
    g = {n: gmean(v) for n, v in throughput.items()}
    best = max(g, key=lambda n: (g[n], n == OWN))
    if best == OWN or not g[best] > g[OWN] * (1.0 + margin):
        return OWN
    if confidence <= 0:
        return best
    d = np.log(np.asarray(throughput[best], dtype=np.float64) / np.asarray(throughput[OWN], dtype=np.float64))  # [k]
    if len(d) < 2:
        return OWN
    se = float(d.std(ddof=1)) / np.sqrt(len(d))
    lower = float(d.mean()) - float(stats.t.ppf(confidence, len(d) - 1)) * se
    return best if lower > np.log1p(margin) else OWN


def measure_candidates(*, target, drafter, prompts: list[tuple[str, list[int]]], policies: Mapping[str, TreePolicy],
                       temperature: float, workload: str, max_new_tokens: int, seed: int, interleave: str
                       ) -> dict[str, list[float]]:
    """Tokens/s of every policy on every prompt, side by side in a mirrored order per pair of prompts."""
    names = list(policies)
    handles = engine_handles(target, drafter, len(names), interleave=interleave)
    engines = [make_method_engine(MethodSpec(name=n, kind="ogspo"), policies[n], target=t, drafter=d, temperature=temperature)
               for n, (t, d) in zip(names, handles)]
    tps = {n: [] for n in names}
    for index, (prompt_id, prompt) in enumerate(prompts):
        order = slot_order(len(engines), pair_seed(seed, temperature, workload, index, 0), index)
        timed = run_slot([engines[j] for j in order], prompt, interleave=interleave, max_new_tokens=max_new_tokens,
                         seed=slot_seed(seed, workload, prompt_id, 0), latency=None)
        for j, (res, _) in zip(order, timed):
            tps[names[j]].append(float(res.throughput))
    return tps


def choose_on_device(*, target, drafter, policy_dir: Path, records_dirs: Mapping[str, Path], latency: LatencyModel,
                     sequoia: Structure | None, prompts: Mapping[str, list[tuple[str, list[int]]]], temperature: float,
                     candidates: int, max_new_tokens: int, margin: float, seed: int, interleave: str,
                     confidence: float = 0.0, progress: Callable[[str], None] | None = None) -> list[WorkloadChoice]:
    """Per workload of `prompts` (each with its records folder in `records_dirs`): the candidates, their
    replayed and measured tokens/s, and the choice (see the module docstring). S is the policy folder's
    structure (where the keep/drop rule dropped the policy, the static tree it shipped instead)."""
    policy_dir = Path(policy_dir)
    S = load_structure(policy_dir / STRUCTURE_FILE)
    all_static = static_candidates(S, sequoia)
    out = []
    for workload, plist in prompts.items():
        if workload not in records_dirs:
            raise ValueError(f"choose_on_device: no records folder for workload '{workload}'")
        own = make_ogspo(policy_path=policy_dir, workload=workload, name=OWN)
        entry = workload_choice(policy_dir, workload)
        own_name = (entry or {}).get("shipped") or ("policy" if own.hook is not None
                                                     else "ar" if isinstance(own, Autoregressive) else "static")
        # the own choice replayed beside them: a static tree itself, a stop policy through the static tree it
        # replaced (its J is the keep/drop rule's; here it only stands in for the sample's correction)
        own_tree = (Structure([tuple(p) for p in (entry or {}).get("static_structure", S.to_list())]) if own.hook is not None
                    else Structure([]) if isinstance(own, Autoregressive) else own.structure)
        replayed = replay_static(records_dirs[workload], latency, all_static | {OWN: own_tree},
                                 [f"{workload}/{pid}" for pid, _ in plist])
        ranked = fastest_first({n: a for n, (a, _) in replayed.items() if n != OWN})
        own_J = {OWN: replayed[OWN][0]} if own.hook is None and OWN in replayed else {}
        cands = candidate_trees(own, ranked, all_static, candidates)
        policies = {n: own if n == OWN else _static(p, n) for n, p in cands.items()}
        tps = measure_candidates(target=target, drafter=drafter, prompts=plist, policies=policies, temperature=temperature,
                                 workload=workload, max_new_tokens=max_new_tokens, seed=seed, interleave=interleave)
        factor = {n: replayed[n][0] / replayed[n][1] if n in replayed else 1.0 for n in cands}
        choice = WorkloadChoice(workload=workload, own=own_name, candidates=cands,
                                replayed=own_J | {n: ranked[n] for n in cands if n in ranked}, tokens_per_second=tps,
                                sample_factor=factor, chosen=decide(
                                    {n: [v * factor[n] for v in tps[n]] for n in cands}, margin, confidence))
        out.append(choice)
        if progress:
            progress(f"{workload}: " + ", ".join(f"{n} {choice.gmean(n):.1f} (x{factor[n]:.3f})" for n in cands)
                     + f" tok/s -> {choice.chosen}")
    return out
