"""The report's markdown sections: the throughput table, OGSPO against the best baseline with its
intervals and what bounds it (`gain_statements`, `render_comparison`), the keep/drop decisions, the
latency model's predicted / realised check, the draft heads side by side and the limiting factors."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl

from ogspo.artifacts.latency import LatencyModel
from ogspo.artifacts.records import temperature_tag
from ogspo.methods.harness import gmean
from ogspo.methods.registry import AA_CHECK, REFERENCE, TUNED, method_label

OGSPO = "ogspo"


def ogspo_ratios(rows: list[dict], method: str = OGSPO) -> dict[str, dict[str, float]]:
    """Temperature tag -> workload -> median paired throughput ratio of `method` to eagle-tuned."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["method"] == method and r.get("vs_eagle_tuned") is not None:
            out.setdefault(temperature_tag(r["temperature"]), {})[r["workload"]] = float(r["vs_eagle_tuned"])
    return out


def _fmt(x, spec=".2f", none="-") -> str:
    return none if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def render_report(*, rows: list[dict], ratios: dict[str, dict[str, float]], lossless: dict, missing: list[str],
                  plots: list[Path], limits: list[str], tuned: dict, comparison: list[str] = (),
                  stability: Mapping[str, Mapping[str, float]] | None = None, target: Mapping | None = None) -> str:
    stability = stability or {}
    lines = ["# ogspo evaluation report", ""]
    if target:  # what ran: the evaluation's target dtype and machine
        lines += [f"Target weights in {target.get('dtype', '?')} on {target.get('machine', '?')} "
                  f"({target.get('threads', '?')} threads, matmul kernels from `{target.get('kernels', '?')}`).", ""]
    lines += [*comparison]
    temps = sorted({r["temperature"] for r in rows})
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines += ["Methods: " + "; ".join(f"`{m}` {method_label(m)}" for m in methods) + ".", ""]
    for t in temps:
        lines += [f"## Throughput, T={t:g} (median tokens/s [IQR], speedup over autoregressive)", "",
                  "| method | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
        for m in methods:
            cells = []
            for w in workloads:
                r = next((r for r in rows if r["temperature"] == t and r["workload"] == w and r["method"] == m), None)
                cells.append("-" if r is None else f"{r['throughput']:.1f} [{r['throughput_q25']:.1f}-"
                             f"{r['throughput_q75']:.1f}] {_fmt(r['speedup'])}x")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += ["", "| method | workload | tau | tree nodes/cycle | predicted tok/s | predicted/realised | oracle bound "
                  "| draft | policy | verify | prefill | other |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["temperature"] == t):
            s = r["time_split"]
            lines.append(
                f"| {r['method']} | {r['workload']} | {r['tau']:.2f} | {r['mean_tree_size']:.1f} | "
                f"{_fmt(r['predicted_throughput'], '.1f')} | {_fmt(r['predicted_over_realised'])} | "
                f"{_fmt(r['oracle_throughput'], '.1f')} | "
                + " | ".join(f"{100 * s[k]:.0f}%" for k in ("draft", "policy", "verify", "prefill", "other")) + " |")
        lines.append("")
    lines += ["## OGSPO / tuned EAGLE-3 (median of per-request throughput ratios)", ""]
    if ratios:
        lines += ["| T | " + " | ".join(workloads) + " | mean |", "|---|" + "---:|" * (len(workloads) + 1)]
        for tag, per in ratios.items():
            vals = [per.get(w) for w in workloads]
            got = [v for v in vals if v is not None]
            lines.append(f"| {tag} | " + " | ".join(_fmt(v) for v in vals) + f" | {_fmt(float(np.mean(got)) if got else None)} |")
        allv = [v for per in ratios.values() for v in per.values()]
        lines += ["", f"Mean over workloads and temperatures: **{np.mean(allv):.2f}**."]
    else:
        lines.append("Not available: the evaluation ran without `ogspo` or without `eagle-tuned`.")
    if tuned:
        lines += ["", "Tuned EAGLE-3 trees [total_tokens, depth, top_k] (rule tune_eagle, calib prompts; in brackets the "
                  "share of bootstrap resamples of the tuning prompts that pick the same tree): "
                  + "; ".join(f"{tag} "
                              + ", ".join(f"{w} {v}" + (f" [{stability[tag][w]:.0%}]" if w in stability.get(tag, {}) else "")
                                                    for w, v in per.items()) for tag, per in tuned.items())]
    near = lossless.get("near_ties", [])
    lines += [""] + render_latency(rows)
    lines += ["## Lossless check (T=0, every method against autoregressive decoding)", "",
              f"{lossless.get('checked', 0)} requests compared, {lossless.get('mismatches', 0)} real mismatches "
              f"(a mismatch stops the evaluation), {len(near)} float near-ties (top-2 logit margin < 1e-4):"]
    lines += [f"- {n['method']} on {n['workload']} prompt {n['prompt_id']} (repeat {n['repeat']}): token {n['token']}, "
              f"margin {n['margin']:.1e}" for n in near] or ["- none"]
    lines += ["", "## What limits it", ""] + [f"- {x}" for x in limits]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    if missing:
        lines += ["", "## Left out", ""] + [f"- {m}" for m in missing]
    lines += ["", "Throughput is complete-request (generated tokens / wall time, prefill included). The predicted "
              "throughput replaces each cycle's measured time by the latency model's t_draft + t_verify + t_fixed "
              "(measured prefill kept). The oracle bound is the posterior optimum on the records' calib prompts in "
              "the latency model's units (cycles only, no prefill), so it is a reference, not a paired figure. The "
              "stop policy's time is measured around the stop hook and taken out of 'other'.", ""]
    return "\n".join(lines)


def _iv(d: dict | None) -> str:
    return "-" if not d else f"{d['ratio']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


WANTED_GAIN = 1.10  # the acceptance bar: OGSPO / best baseline where the oracle bound allows it


def records_figures(*, oracle: Mapping[str, float], sequoia: Mapping[str, dict],
                    rounds: Mapping[str, pl.DataFrame]) -> dict[str, dict]:
    """Per temperature tag, the records' own figures in the latency model's units (same cycles, same
    model): autoregressive decoding and the Sequoia tree replayed (sequoia.json), the OGSPO policy's
    surrogate J (its incumbent round) and the oracle bound (solve/oracle_T*.json)."""
    out = {}
    for tag, J in oracle.items():
        sq = sequoia.get(tag)
        if sq is None or not sq.get("replayed_autoregressive"):
            continue
        fig = {"oracle": float(J), "ar": float(sq["replayed_autoregressive"])}
        if sq.get("replayed_throughput") is not None:  # None: Sequoia's tree leaves the records' template
            fig["static"] = float(sq["replayed_throughput"])
        rf = rounds.get(tag)
        if rf is not None and rf.filter(pl.col("accepted")).height:
            fig["policy"] = float(rf.filter(pl.col("accepted"))["surrogate_J"][-1])
        out[tag] = fig
    return out


def gain_statements(rows: list[dict], records: Mapping[str, dict], method: str = OGSPO) -> list[dict]:
    """Per workload and temperature: `method` against the best baseline (with its interval), and the
    oracle bound in the same units. The bound is a records figure (calib prompts, the records' context
    lengths), so it is carried over as a ratio to autoregressive decoding, which shares those effects:
    bound / best = (oracle / AR on records) / (best baseline / AR realised in the cell), and in tokens/s
    the bound is that ratio times the cell's realised AR throughput (cycles only, prefill out, as the
    oracle is). The share of the oracle's gain over the best static tree (Sequoia's) that the policy
    captures is (policy - static) / (oracle - static), on the records."""
    out = []
    cells = list(dict.fromkeys((r["workload"], r["temperature"]) for r in rows))
    for w, t in cells:
        at = {r["method"]: r for r in rows if r["workload"] == w and r["temperature"] == t}
        me, ar = at.get(method), at.get(REFERENCE)
        if me is None or ar is None or me.get("best_baseline") not in at:
            continue
        base = at[me["best_baseline"]]
        rec = records.get(temperature_tag(t))
        best_over_ar = 1.0 if base["method"] == REFERENCE else (base.get("speedup_gm") or {}).get("ratio")
        bound_over_ar = rec["oracle"] / rec["ar"] if rec else None
        share = None
        if rec and "policy" in rec and "static" in rec and rec["oracle"] > rec["static"]:
            share = (rec["policy"] - rec["static"]) / (rec["oracle"] - rec["static"])
        out.append({
            "workload": w, "temperature": t, "best_baseline": me["best_baseline"], "vs_best": me.get("vs_best"),
            "best_baseline_eval": me.get("best_baseline_eval"), "vs_best_eval": me.get("vs_best_eval"),
            "vs_ar": me.get("speedup_gm"), "cycles_throughput": me.get("cycles_throughput"),
            "oracle_over_ar_records": bound_over_ar,
            "oracle_vs_best": bound_over_ar / best_over_ar if bound_over_ar and best_over_ar else None,
            "oracle_realised_cycles_throughput": (bound_over_ar * ar["cycles_throughput"]
                                                  if bound_over_ar and ar.get("cycles_throughput") else None),
            "records": rec, "share_of_oracle_gain": share,
        })
    return out


def render_comparison(statements: list[dict], pooled: dict, method: str = OGSPO) -> list[str]:
    """OGSPO against the best baseline per cell and pooled, with the oracle bound; the A/A check."""
    lines = [f"## {method.upper()} against the best baseline (geometric mean of paired per-request ratios, "
             "95% bootstrap interval)", "",
             "The best baseline of a cell is the fastest (geometric mean) of autoregressive decoding, tuned "
             "EAGLE-3 and Sequoia's static tree, picked on the calib prompts (rule tune_eagle runs the three side by "
             "side there) and then only measured here; 'picked here' re-picks it on these requests inside every "
             "bootstrap resample, so its interval carries the winner's curse. Every method of a slot generates the "
             "same number of tokens. The oracle bound comes from the records (calib prompts, latency model, cycles only): "
             "it is carried over as its ratio to autoregressive decoding on the same records, i.e. bound / best = "
             "(oracle / AR on records) / (best / AR here), and in tokens/s = that ratio x this cell's AR (cycles "
             "only, prefill out). The share of the oracle's gain over the best static tree (Sequoia) that the "
             "policy captures is measured on the records (per temperature).", "",
             f"| T | workload | best baseline (calib) | {method} / best | best picked here | {method} / it | "
             f"{method} / ar | {method} tok/s (cycles) | "
             "oracle bound (tok/s, cycles) | bound / best | share of oracle gain over best static tree |",
             "|---:|---|---|---|---|---|---|---:|---:|---:|---:|"]
    for st in statements:
        lines.append(f"| {st['temperature']:g} | {st['workload']} | {st['best_baseline']} | {_iv(st['vs_best'])} | "
                     f"{st.get('best_baseline_eval') or '-'} | {_iv(st.get('vs_best_eval'))} | "
                     f"{_iv(st['vs_ar'])} | {_fmt(st['cycles_throughput'], '.1f')} | "
                     f"{_fmt(st['oracle_realised_cycles_throughput'], '.1f')} | {_fmt(st['oracle_vs_best'])} | "
                     f"{_fmt(st['share_of_oracle_gain'])} |")
    lines.append("")
    for key, label in (("vs_best", "best baseline (picked on calib prompts)"),
                       ("vs_best_eval", "best baseline (re-picked on these requests per resample)"),
                       ("vs_ar", "autoregressive"), ("vs_eagle_tuned", "tuned EAGLE-3"), ("vs_sequoia", "Sequoia"),
                       ("vs_static", "the static tree its stop policy replaced (`ogspo-static`, cells where a policy ships)")):
        p = pooled.get(key)
        if not p:
            continue
        per_t = "; ".join(f"T={t}: {_iv(iv)}" for t, iv in p["by_temperature"].items())
        lines.append(f"- Pooled {method} / {label}: **{_iv(p['pooled'])}** (n={p['pooled']['n']}); {per_t}.")
    for tag in dict.fromkeys(temperature_tag(st["temperature"]) for st in statements):
        rec = next((st["records"] for st in statements if temperature_tag(st["temperature"]) == tag and st["records"]), None)
        if rec:
            pol = f", policy {rec['policy']:.2f} ({rec['policy'] / rec['ar']:.3f}x)" if "policy" in rec else ""
            static = (f"best static tree (Sequoia) {rec['static']:.2f} ({rec['static'] / rec['ar']:.3f}x)" if "static" in rec
                      else "Sequoia's tree leaves the records' template (not replayed)")
            lines.append(f"- {tag} on the records (tok/s, latency model, cycles only): autoregressive {rec['ar']:.2f}, "
                         f"{static}{pol}, oracle {rec['oracle']:.2f} ({rec['oracle'] / rec['ar']:.3f}x).")
    for st in statements:
        ob = st["oracle_vs_best"]
        vb = st["vs_best"]
        if ob is None or vb is None:
            continue
        where = f"T={st['temperature']:g} {st['workload']}"
        if ob >= WANTED_GAIN:
            verdict = ("reaches" if vb["ratio"] >= WANTED_GAIN and vb["low"] > 1 else "does not reach")
            lines.append(f"- {where}: the oracle bound exceeds the best baseline ({st['best_baseline']}) by "
                         f"{100 * (ob - 1):.0f}%; {method} {verdict} {WANTED_GAIN:.2f}x with its interval above 1 "
                         f"({_iv(vb)}).")
        else:
            lines.append(f"- {where}: the oracle bound is only {ob:.2f}x the best baseline ({st['best_baseline']}), "
                         f"below {WANTED_GAIN:.2f}x: no policy over this structure and records template can gain "
                         "10% here.")
    aa = pooled.get("aa_check")
    lines += ["", "### A/A check", ""]
    if aa and aa["pooled"]:
        ok = aa["pooled"]["low"] <= 1.0 <= aa["pooled"]["high"]
        cells = "; ".join(f"{c['workload']} T={c['temperature']:g}: {_iv(c)}" for c in aa["cells"] if "ratio" in c)
        half = (aa["pooled"]["high"] - aa["pooled"]["low"]) / 2
        lines.append(f"`{AA_CHECK}` (autoregressive decoding run again, side by side with every method) / "
                     f"`{REFERENCE}`: pooled **{_iv(aa['pooled'])}** (half-width {100 * half:.1f}%), which "
                     f"{'contains' if ok else 'does NOT contain'} 1.00; per cell {cells}.")
    else:
        lines.append(f"Not run: add `{AA_CHECK}` to evaluate.methods.")
    return lines + [""]


def render_shipping(shipping: Mapping[str, dict]) -> list[str]:
    """What the ogspo method ships per temperature: the stop policy, or the static tree that beat it."""
    if not shipping:
        return []
    lines = ["### What `ogspo` ships (keep/drop rule, held-out record requests)", ""]
    for tag, sh in shipping.items():
        what = "the learned stop policy over its structure" if sh.get("keep_policy") else (
            f"the static tree {sh.get('shipped')} ({len(sh.get('structure', []))} nodes), not the stop policy")
        lines.append(f"- {tag}: {what}. {sh.get('reason', '')}")
        for w, v in (sh.get("workloads") or {}).items():
            n = "-" if v.get("structure") is None else len(v["structure"])
            so = v.get("stop_only")
            bound = "" if so is None else (
                f"; stop-only bound of S {so['bound_J']:.1f} = +{100 * so['bound_gain']:.1f}% over its best fixed depth "
                f"d={so['best_fixed_depth']} ({so['best_fixed_J']:.1f})")
            lines.append(f"  - {w}: {v['shipped']} ({n} nodes; J on its record cycles "
                         + ", ".join(f"{k} {x:.1f}" for k, x in v.get("J", {}).items()) + bound + ")")
        lines += render_stop_classes(tag, sh)  # rounds.json "ship" holds the figures at its top level
    return lines + [""]


def render_on_device(docs: Mapping[str, dict]) -> list[str]:
    """What `ogspo` ships per temperature and workload after rule choose_on_device (its device.json per
    tag): each candidate's measured tokens/s on the calib prompts beside what the records replay."""
    if not docs:
        return []
    lines = ["### What `ogspo` ships, chosen on the device", "",
             "Per workload, the policy folder's own choice, autoregressive decoding and the static trees the records "
             "replay fastest, decoded side by side on calib prompts (geometric-mean tokens/s, prefill included; x its "
             "replayed tokens/s on all the records' requests over that on these prompts'; replayed on the records in "
             "brackets, cycles only); the fastest after that factor ships, the own choice unless a paired test agrees.",
             ""]
    for tag, doc in docs.items():
        s = doc.get("settings") or {}
        lines.append(f"- {tag} ({s.get('prompts_per_workload')} calib prompts x {s.get('max_new_tokens')} tokens a "
                     f"workload, margin {s.get('margin')}, confidence {s.get('confidence')}):")
        for w in doc["workloads"]:
            def fig(name: str) -> str:
                g = gmean(w["tokens_per_second"][name])
                rep = w["replayed"].get(name)
                factor = (w.get("sample_factor") or {}).get(name)
                label = f"{name} ({w['own']})" if name == "own" else name
                return (f"{label} {g:.1f}" + ("" if factor is None else f" x{factor:.3f}")
                        + ("" if rep is None else f" [{rep:.1f}]"))
            chosen = w["own"] if w["chosen"] == "own" else w["chosen"]
            lines.append(f"  - {w['workload']}: {', '.join(fig(n) for n in w['candidates'])} -> **{chosen}**")
    return lines + [""]


def render_stop_classes(tag: str, figures: Mapping) -> list[str]:
    """The keep/drop rule's held-out test of each stop-policy class (rounds.json "ship"): the
    stop-only bound of S, each class's and the chosen policy's gain over the best fixed depth, its share
    of that bound, its ratio to the best static tree with the interval, and the smallest gain the test sees."""
    th, so = figures.get("threshold"), figures.get("stop_only")
    if not th or not so or not th.get("classes"):
        return []
    out = ["", f"  {tag}: stop-only bound of S +{100 * so['bound_gain']:.1f}% over its best fixed depth "
           f"d={so['best_fixed_depth']} ({so['best_fixed_J']:.1f} tok/s); held out over {th['n_requests']} record requests "
           f"({th['folds']} folds), smallest gain this test detects ~{100 * th['detectable_gain']:.1f}%", "",
           "  | stop policy | gain over best fixed depth | share of the bound | / best static tree [95%] |",
           "  |---|---:|---:|---:|"]

    def row(name: str, v: Mapping) -> str:
        share = "-" if v.get("share_of_bound") is None else f"{v['share_of_bound']:+.2f}"
        lo, hi = v["interval"]
        return (f"  | {name} | {100 * v['gain_over_best_fixed']:+.1f}% | {share} | "
                f"{v['ratio']:.3f} [{lo:.3f}, {hi:.3f}] vs {v['best_static']} |")

    out += [row(name, v) for name, v in th["classes"].items()]
    out.append(row(f"**chosen in each fold** (on all: {th.get('class', th.get('feature'))})", th))
    return out + [""]


LATENCY_CHECKED = (REFERENCE, TUNED, "sequoia", OGSPO)


LATENCY_BAND = (0.95, 1.05)


def latency_check(rows: list[dict]) -> dict:
    """The latency model against realised requests: per method of `LATENCY_CHECKED`, the per-cell medians
    of predicted / realised throughput and whether all lie within `LATENCY_BAND`."""
    out = {}
    for m in LATENCY_CHECKED:
        cells = {f"{r['workload']}/T{r['temperature']:g}": r["predicted_over_realised"] for r in rows
                 if r["method"] == m and r.get("predicted_over_realised") is not None}
        if cells:
            out[m] = {"cells": cells, "within": all(LATENCY_BAND[0] <= v <= LATENCY_BAND[1] for v in cells.values())}
    return out


def render_latency_check(check: dict) -> list[str]:
    if not check:
        return []
    lines = ["### Latency model against realised requests (median predicted / realised per cell; band "
             f"{LATENCY_BAND[0]:.2f}-{LATENCY_BAND[1]:.2f})", ""]
    for m, c in check.items():
        vals = list(c["cells"].values())
        lines.append(f"- {m}: {min(vals):.3f}-{max(vals):.3f} over {len(vals)} cells, "
                     f"{'all within' if c['within'] else 'NOT all within'} the band.")
    return lines + [""]


def render_latency(rows: list[dict]) -> list[str]:
    """Time to first token and request latency percentiles beside throughput, per method and cell."""
    lines = ["## Latency (seconds: time to first token p50; whole request p50 / p90)", "",
             "| T | workload | method | requests | TTFT p50 | latency p50 | latency p90 | tok/s (median) |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['workload']} | {r['method']} | {r['n_requests']} | "
                     f"{_fmt(r.get('ttft_p50'), '.3f')} | {_fmt(r.get('latency_p50'), '.2f')} | "
                     f"{_fmt(r.get('latency_p90'), '.2f')} | {r['throughput']:.1f} |")
    return lines + [""]


def render_heads(acceptance: dict, metas: Mapping[str, dict]) -> list[str]:
    """The draft heads side by side (stage measure_drafter, same eval prompts, interleaved): top-1
    acceptance by depth of a chain, the best EAGLE-3 tree's tau and its speedup, per head; and each
    head's training figures (held-out TTT top-1; GTO's held-out Draft Tree Reward before and after)."""
    figs = acceptance.get("figures", [])
    heads = list(dict.fromkeys(f["head"] for f in figs if f.get("head")))
    lines = ["## Draft heads (stage measure_drafter: held-out eval prompts, heads interleaved prompt by prompt)", "",
             "Chain acceptance by depth d: P(depth d accepted | depth d-1 reached) [cycles that reached d-1]. First-token "
             "ceiling: the target's mean largest probability at the chain's roots, which a drafted token (a point mass) "
             "is accepted with at most, at T > 0. Top-k recall at depth 1: how often the target's greedy token is among "
             "the head's k best (k = 1/2/4/8), on the T=0 continuations (what a tree k wide at the first level can "
             "accept; `acceptance.md` has every depth).", "",
             "| workload | T | head | chain acceptance by depth | first-token ceiling | top-k recall, depth 1 | best tree | tau "
             "| speedup vs ar |",
             "|---|---:|---|---|---:|---|---|---:|---:|"]
    recall = acceptance.get("recall", {})
    keys = list(dict.fromkeys((f["workload"], f["temperature"]) for f in figs))
    for w, t in keys:
        for h in heads:
            mine = [f for f in figs if f["workload"] == w and f["temperature"] == t and f.get("head") == h]
            chain_ = next((f for f in mine if f["method"].startswith("chain")), None)
            trees = [f for f in mine if f["method"].startswith("eagle")]
            best = max(trees, key=lambda f: f["tau"]) if trees else None
            acc = "-"
            if chain_:
                counts = chain_.get("depth_trials") or [None] * len(chain_["accept_by_depth"])
                acc = ", ".join(f"{a:.2f}" + (f" [{n}]" if n is not None else "") for a,
                                n in zip(chain_["accept_by_depth"], counts))
                acc += f" ({chain_['prompts']} prompts)" if chain_.get("prompts") else ""
            ceiling = _fmt(chain_.get("first_token_ceiling") if chain_ else None, ".3f")
            rec = recall.get(h, {}).get(w) if t == 0 else None
            rec = "/".join(f"{x:.2f}" for x in rec["recall"][0]) if rec else "-"
            lines.append(f"| {w} | {t:g} | {h} | {acc} | {ceiling} | {rec} | {best['method'] if best else '-'} | "
                         f"{_fmt(best['tau'] if best else None)} | {_fmt(best['speedup'] if best else None)}x |")
    for h, meta in metas.items():
        top1 = [round(a, 3) for a in meta.get("metrics", {}).get("val_top1", [])]
        m = meta.get("metrics", {})
        text = (f"- {h}: held-out TTT top-1 {top1}" if "published" not in meta
                else f"- {h}: the EAGLE-3 head at {meta['published']} (drafter.path)")
        d = m.get("data")
        if d:
            made = "read from the cache" if d["cached"] else (
                f"{d['generation_tokens_per_second']:.0f} tokens/s of generation, {d['annotation_tokens_per_second']:.0f} "
                f"tokens/s of reading text at {d['annotate_rows']} rows"
                + (f", on the {d['bulk']['write']} / {d['bulk']['read']} kernels" if d.get("bulk") else ""))
            text += (f"; {m['train_tokens']} training tokens ({d['generated_tokens']} written by the target, "
                     f"{d['annotated_tokens']} read as text, "
                     f"{d['self_instructions']} self-written requests, {d['near_held_out']} prompts dropped as near an "
                     f"eval/calib prompt; {made}); data {m['data_seconds'] / 60:.1f} min, {m['steps']} steps "
                     f"{m['train_seconds'] / 60:.1f} min")
            b = d.get("budget")
            if b and b.get("seconds") is not None:  # what drafter.minutes took of the recipe
                text += ("; within the budget: blocks " + ", ".join(f"{k} {n} of {b['offered'][k]}" for k,
                                                                     n in b["taken"].items())
                         + f", steps {m['steps']} of {m['recipe_steps']}")
        g = meta.get("gto_metrics")
        if g:
            text += (f"; GTO {g['steps']} steps ({g['seconds'] / 60:.1f} min), held-out Draft Tree Reward "
                     f"{g['reward_before']:.3f} -> {g['reward_after']:.3f}, accepted tokens per tree "
                     f"{g['accepted_before']:.3f} -> {g['accepted_after']:.3f}")
        lines.append(text)
    return lines + [""]


def limiting_factors(rows: list[dict], *, latency_doc: dict | None, structures: Mapping[str, list]) -> list[str]:
    """Data-driven statements about what bounds the speedup on this device."""
    out = []
    if latency_doc is not None:
        m = LatencyModel.from_json(latency_doc)
        L = float(np.median(m.contexts))
        t1 = float(m.t_verify(1, L))
        parts = [f"n={n}: {float(m.t_verify(n, L)) / t1:.2f}x" for n in (2, 4, 8, 16, 32) if n <= max(m.sizes)]
        out.append(f"Verification cost relative to one token at L={L:.0f} (latency model): {', '.join(parts)}; one "
                   f"draft level costs {1e3 * float(m.t_draft(1)):.1f} ms against {1e3 * t1:.1f} ms for a one-token "
                   f"target pass, t_fixed {1e3 * m.fixed:.1f} ms. A cycle must commit more tokens than its relative "
                   "cost to beat autoregressive decoding.")
    for t in sorted({r["temperature"] for r in rows}):
        at = [r for r in rows if r["temperature"] == t]
        # a method that verified no drafted node (an empty structure, "do not speculate") is not speculative
        best = max((r for r in at if r["method"] not in (REFERENCE, AA_CHECK) and r["speedup"] is not None
                    and r["mean_tree_size"] > 0), key=lambda r: r["speedup"], default=None)
        if best is not None:
            out.append(f"T={t:g}: fastest speculative method/workload is {best['method']} on {best['workload']} at "
                       f"{best['speedup']:.2f}x autoregressive (tau {best['tau']:.2f}, verify "
                       f"{100 * best['time_split']['verify']:.0f}% and draft {100 * best['time_split']['draft']:.0f}% "
                       "of its wall time).")
        og = [r for r in at if r["method"] == OGSPO]
        if og:
            tau = np.mean([r["tau"] for r in og])
            pol = np.mean([r["time_split"]["policy"] for r in og])
            pr = [r["predicted_over_realised"] for r in og if r["predicted_over_realised"] is not None]
            orc = [r for r in og if r["oracle_throughput"] is not None]
            text = f"T={t:g}: OGSPO commits {tau:.2f} tokens per cycle; its stop policy takes {100 * pol:.1f}% of wall time"
            if pr:
                text += f"; the latency model predicts {np.mean(pr):.2f}x the realised throughput"
            if orc:
                text += (f"; realised median {np.mean([r['throughput'] for r in orc]):.1f} tok/s against an oracle "
                         f"bound of {orc[0]['oracle_throughput']:.1f} (records, cycles only)")
            out.append(text + ".")
    for tag, paths in structures.items():
        depth = max((len(p) for p in paths), default=0)
        out.append(f"{tag}: the OGSPO structure has {len(paths)} nodes, depth {depth}"
                   + (" (empty: the oracle found drafting not worth its cost here)." if not paths else "."))
    return out
