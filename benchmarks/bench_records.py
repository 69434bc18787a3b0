"""Benchmark: posterior records on SmolLM2 — replay vs reality, and replay speed.

    .venv/bin/python benchmarks/bench_records.py [--model results/.test-cache/smollm2] [--write]

1. Collect records with a template T on a few prompts (early-exit drafter, T=0 and T=1), then for
   a few sub-structures S and stop depths d re-run every recorded cycle for real (`cycle_from`: same
   context, root and cycle random numbers, `StaticTree(S.up_to(d))`) and count cycles whose
   committed length equals the replayed A_c(S, d) and whose accepted tokens agree.
2. Replay speed: A_c and t_c of K random sub-structures of the default 81-node template over C
   synthetic cycles, vectorised (numpy).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import REPO, cpu_model, write_section  # noqa: E402

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colours are",
]


def replay_speed(K: int = 2000, C: int = 2000, seed: int = 0) -> tuple[float, int, int]:
    from ogspo.artifacts.latency import LatencyModel
    from ogspo.artifacts.records import template_index
    from ogspo.engine.tree import Structure
    from ogspo.offline.replay import ReplayCycles, replay

    rng = np.random.default_rng(seed)
    T = Structure.full([3, 2, 2, 1, 1, 1, 1, 1])
    tl = [tuple(p) for p in T.to_list()]
    tidx = template_index(T)
    paths = np.full((C, T.max_depth), len(T) + 1, dtype=np.int64)
    for c in range(C):
        p = ()
        for j in range(rng.integers(0, T.max_depth + 1)):
            kids = [q for q in tl if len(q) == len(p) + 1 and q[:-1] == p]
            p = kids[min(int(rng.geometric(0.6)) - 1, len(kids) - 1)]
            paths[c, j] = tidx[p]
    structs = []
    for _ in range(K):
        keep = set()
        for p in tl:
            if (len(p) == 1 or p[:-1] in keep) and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in keep) and rng.random() < 0.7:
                keep.add(p)
        structs.append(Structure(keep or {(0,)}))
    m = LatencyModel(
        sizes=[1, 16, 64, 128], contexts=[128, 768], verify_table=[[0.04, 0.05], [0.1, 0.12], [0.18, 0.2], [0.3, 0.33]],
        verify_intercept=[0.04, 0.1, 0.18, 0.3], verify_slope=[1e-5] * 4, slope_mode="global",
        draft_widths=[1, 16], draft_table=[0.01, 0.03], fixed=0.002, fixed_ar=0.002, fixed_slope=0.0, catchup=[],
    )
    cyc = ReplayCycles(template=T, paths=paths, context_lengths=rng.integers(50, 800, C).astype(float),
                       node_depth=np.array([0] + [len(p) for p in tl] + [T.max_depth + 1]))
    depths = rng.integers(1, T.max_depth + 1, K)
    t0 = time.perf_counter()
    replay(cycles=cyc, structures=structs, depths=depths, model=m)
    return time.perf_counter() - t0, K, C


def main() -> None:
    from ogspo.artifacts.records import load_records
    from ogspo.engine.decode import SpeculativeEngine
    from ogspo.engine.model import load_target
    from ogspo.engine.policies import StaticTree
    from ogspo.engine.tree import Structure
    from ogspo.methods.registry import make_drafter, make_target
    from ogspo.offline.replay import replay, replay_cycles
    from ogspo.stages.collect_records import collect_records

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=REPO / "results/.test-cache/smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    model, tok = load_target(args.model)
    target = make_target(model, max_len=1024)
    drafter = make_drafter("early-exit", target_model=model, max_len=1024)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    T = Structure.full([3, 2, 1, 1])
    subs = [("T", T), ("chain3", Structure.chain(3)), ("[2,1,1]", Structure.full([2, 1, 1]))]
    lines = []
    t_all = time.perf_counter()
    for temp in (0.0, 1.0):
        with tempfile.TemporaryDirectory() as d:
            collect_records(target=target, drafter=drafter, template=T, prompts=prompts, temperature=temp, seed=0,
                            max_new_tokens=args.max_new_tokens, out_dir=Path(d), shard_size=1, model_checksum="x",
                            drafter_id="ee")
            rec = load_records(Path(d))
        cyc = replay_cycles(rec)
        for name, S in subs:
            for depth in (1, 2, 4):
                res = replay(cycles=cyc, structures=[S], depths=np.array([depth]))
                engine = SpeculativeEngine(target=target, policy=StaticTree(S.up_to(depth)), drafter=drafter, temperature=temp)
                same = total = 0
                done: dict[str, list[int]] = {}
                for c, row in enumerate(rec.cycles.iter_rows(named=True)):
                    prompt = prompts[int(row["request_id"][1:])]
                    out = done.setdefault(row["request_id"], [row["root_token"]])
                    st, committed = engine.cycle_from(prompt + out[:-1], out[-1], request_seed=row["request_seed"],
                                                      index=row["cycle"])
                    A = int(res.accepted[0, c])
                    same += st.accepted == A and committed[: A - 1] == row["committed"][: A - 1]
                    total += 1
                    out += row["committed"]
                lines.append(f"| {temp:g} | {name} | {depth} | {same}/{total} |")
    secs, K, C = replay_speed()
    text = f"""## Posterior records: replay vs reality (`benchmarks/bench_records.py`)

{dt.date.today()}, {cpu_model()}; SmolLM2-135M-Instruct target, early-exit drafter (6 layers),
template T = full([3, 2, 1, 1]) ({len(T)} nodes), {len(prompts)} prompts x {args.max_new_tokens} new tokens.
Each recorded cycle is re-run for real from its context with `StaticTree(S.up_to(d))` and the same
cycle random numbers; "exact" = committed length equals the replayed A_c(S, d) and the accepted
tokens agree. Total {time.perf_counter() - t_all:.0f} s (machine busy with drafter training).

| T | S | d | exact cycles |
|---|---|---|---|
{chr(10).join(lines)}

Replay speed (vectorised numpy, A_c and t_c): {K} random sub-structures of the 81-node default
template x {C} cycles in {secs:.2f} s = {K * C / secs / 1e6:.1f} M (structure, cycle) pairs/s.
"""
    print(text)
    if args.write:
        write_section("bench_records", text)


if __name__ == "__main__":
    main()
