"""`learn.on_device` and stage `choose_on_device`: the policy folder's own choice, autoregressive decoding and the best-replayed
static trees decode calib prompts side by side; the fastest ships, and the `ogspo` method decodes it.

Tiny float64 models and records collected from them (fast)."""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from engine_helpers import tiny_model
from policy_helpers import threshold_head
from solve_helpers import synthetic_latency

from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import Autoregressive, StaticTree
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.learn.export import write_policy_folder
from ogspo.learn.on_device import OWN, candidate_trees, choose_on_device, decide, rank_static, replay_static
from ogspo.learn.ship import static_candidates
from ogspo.methods.ogspo import OgspoTree, make_ogspo
from ogspo.stages.choose_on_device import read_device_choice, write_choice
from ogspo.stages.collect_records import collect_records

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 3, 3, 3, 3, 40, 41], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13]]
TEMPLATE = Structure.full([3, 2, 2])
SUB = Structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
K = 2  # best-replayed static trees beside the own choice and AR


def _engine():
    target = build_tree_lm(tiny_model(0), max_len=256)
    return target, LMDrafter(LlamaTreeLM(tiny_model(0), max_len=256, n_layers=1))  # early exit: partial acceptance


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("records-T0")
    target, drafter = _engine()
    collect_records(target=target, drafter=drafter, template=TEMPLATE, prompts=PROMPTS, temperature=0.0, seed=0,
                    max_new_tokens=14, out_dir=out, shard_size=3, model_checksum="m" * 64, drafter_id="ee1")
    return out


def test_the_own_choice_stays_unless_another_is_faster_by_more_than_the_margin():
    tps = {OWN: [10.0, 20.0], "chain1": [10.5, 21.0], "ar": [9.0, 9.0]}
    assert decide(tps, margin=0.0) == "chain1"
    assert decide(tps, margin=0.1) == OWN  # 5% faster is inside a 10% margin
    assert decide({OWN: [10.0], "ar": [10.0]}, margin=0.0) == OWN  # a tie keeps the own choice
    assert decide({OWN: [10.0, 30.0], "ar": [17.0, 17.0]}, margin=0.0) == OWN  # geometric means: 17.3 > 17


def test_with_a_confidence_the_lead_must_hold_across_the_prompts():
    """A paired one-sided t-test over prompts: a lead of +1% on every prompt switches, a larger mean lead
    that one prompt reverses does not, nor does one prompt alone; the margin still applies."""
    steady = {OWN: [40.0, 50.0, 60.0], "chain1": [40.4, 50.6, 60.5]}
    assert decide(steady, margin=0.0, confidence=0.9) == "chain1"
    assert decide(steady, margin=0.02, confidence=0.9) == OWN
    mixed = {OWN: [40.0, 50.0, 60.0], "sequoia": [36.0, 54.0, 68.0]}  # gmean +3.5%, one prompt -10%
    assert decide(mixed, margin=0.0) == "sequoia" and decide(mixed, margin=0.0, confidence=0.9) == OWN
    assert decide({OWN: [40.0], "ar": [48.0]}, margin=0.0, confidence=0.9) == OWN


def test_the_candidates_are_the_own_choice_ar_and_the_best_replayed_trees_each_once():
    cands = static_candidates(SUB, Structure([(0,), (1,), (2,)]))
    ranked = {"S<=1": 9.0, "sequoia": 8.0, "chain1": 7.0, "S<=2": 6.0, "ar": 5.0}
    own = StaticTree(cands["S<=1"], name=OWN)  # the folder ships S<=1: not repeated under its name
    got = candidate_trees(own, ranked, cands, k=2)
    assert list(got) == [OWN, "sequoia", "chain1", "ar"] and got[OWN] == cands["S<=1"].to_list()
    # the own choice autoregressive and Sequoia's tree empty: neither counts among the k, nor is AR run twice
    empty = static_candidates(Structure([]), Structure([]))
    got = candidate_trees(Autoregressive(name=OWN), {"ar": 9.0, "sequoia": 8.0, "chain1": 7.0, "chain2": 6.0}, empty, k=2)
    assert list(got) == [OWN, "chain1", "chain2"] and got[OWN] == []
    policy = SimpleNamespace(hook=object())  # a stop policy: no paths of its own
    got = candidate_trees(policy, ranked, cands, k=3)
    assert list(got) == [OWN, "S<=1", "sequoia", "chain1", "ar"] and got[OWN] is None and got["ar"] == []


def test_the_static_trees_are_ranked_by_their_replay_on_the_records(records):
    from ogspo.artifacts.records import load_records
    from ogspo.offline.replay import replay, replay_cycles

    lat = synthetic_latency()
    ranked = rank_static(records, lat, static_candidates(SUB, Structure([(0,), (1,), (2,), (0, 0)])))
    assert list(ranked.values()) == sorted(ranked.values(), reverse=True) and "ar" in ranked and "chain2" in ranked
    cyc = replay_cycles(load_records(records))
    s = static_candidates(SUB, None)["S<=2"]
    r = replay(cycles=cyc, structures=[s], depths=np.array([2]), model=lat)
    assert ranked["S<=2"] == pytest.approx(float(r.accepted.sum() / r.seconds.sum()))
    outside = rank_static(records, lat, static_candidates(SUB, Structure([(0,), (1,), (2,), (3,)])))  # rank 3: not in T
    assert "sequoia" not in outside


def test_a_trees_sample_factor_is_its_replay_on_all_requests_over_that_on_the_prompts_decoded(records):
    """replay_static: (all requests, `request_ids` alone) per tree; the second is the replay of those
    requests' cycles, and equals the first when none of the ids is in the records."""
    from ogspo.artifacts.records import load_records
    from ogspo.offline.replay import replay, replay_cycles

    lat = synthetic_latency()
    trees = static_candidates(SUB, None)
    recs = load_records(records)
    first = sorted(set(recs.cycles["request_id"].to_list()))[0]
    got = replay_static(records, lat, trees, [first])
    mine = (recs.cycles["request_id"] == first).to_numpy()
    r = replay(cycles=replay_cycles(recs), structures=[trees["S<=2"]], depths=np.array([2]), model=lat)
    assert got["S<=2"][0] == pytest.approx(rank_static(records, lat, trees)["S<=2"])
    assert got["S<=2"][1] == pytest.approx(float(r.accepted[:, mine].sum() / r.seconds[:, mine].sum()))
    assert all(a == pytest.approx(b) for a, b in replay_static(records, lat, trees, ["elsewhere/x"]).values())


def test_the_choice_made_on_the_device_is_what_the_ogspo_method_decodes(records, tmp_path):
    policy = tmp_path / "policy"
    write_policy_folder(head=threshold_head("max_cum_prob", 0.3), structure=SUB, lam=1.0, out_dir=policy, info={})
    target, drafter = _engine()
    prompts = {"w": [("a", PROMPTS[0]), ("b", PROMPTS[2])]}
    choices = choose_on_device(target=target, drafter=drafter, policy_dir=policy, records_dirs={"w": records},
                               latency=synthetic_latency(), sequoia=None, prompts=prompts, temperature=0.0,
                               candidates=K, max_new_tokens=8, margin=0.0, seed=0, interleave="cycles")
    (c,) = choices
    assert c.own == "policy" and c.candidates[OWN] is None and c.candidates["ar"] == []
    assert len(c.candidates) == 2 + K  # own, the K best replayed, ar
    assert all(len(v) == 2 and min(v) > 0 for v in c.tokens_per_second.values())
    assert set(c.sample_factor) == set(c.candidates) and all(v > 0 for v in c.sample_factor.values())
    corrected = {n: [v * c.sample_factor[n] for v in tps] for n, tps in c.tokens_per_second.items()}
    assert c.chosen == decide(corrected, 0.0) and OWN not in c.replayed

    out = tmp_path / "ogspo"
    write_choice(choices, policy_dir=policy, out_dir=out, meta={"temperature": 0.0})
    works = json.loads((out / "workloads.json").read_text())
    assert works["w"]["on_device"]["chosen"] == c.chosen and (out / "policy.onnx").is_file()
    assert read_device_choice(out)["workloads"][0]["chosen"] == c.chosen
    method = make_ogspo(policy_path=out, workload="w")
    if c.chosen == OWN:
        assert isinstance(method, OgspoTree)
    else:
        assert type(method) in (StaticTree, Autoregressive) and works["w"]["structure"] == c.candidates[c.chosen]

    # whichever wins is what the method decodes: the stop policy where it stays, a static tree or AR otherwise
    for chosen, kind in ((OWN, OgspoTree), ("ar", Autoregressive), (next(n for n in c.candidates if n not in (OWN, "ar")),
                                                                      StaticTree)):
        write_choice([dataclasses.replace(c, chosen=chosen)], policy_dir=policy, out_dir=out, meta={})
        method = make_ogspo(policy_path=out, workload="w")
        assert type(method) is kind
        if kind is StaticTree:
            assert method.structure.to_list() == c.candidates[chosen]
    with pytest.raises(ValueError, match="not a choose_on_device table"):
        read_device_choice(policy / "export.json")
