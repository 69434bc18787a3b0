"""OGSPO stop policy: features online == offline, backward induction, ONNX export, the `ogspo` method.

Tiny float64 models and synthetic data only (fast)."""

import json
import warnings

import numpy as np
import pytest
import torch
from engine_helpers import hf_greedy, tiny_model
from policy_helpers import threshold_head
from solve_helpers import synthetic_latency

from ogspo.artifacts.records import load_records, request_seed
from ogspo.artifacts.structure import write_structure
from ogspo.engine.decode import SpeculativeEngine
from ogspo.engine.drafters import LMDrafter
from ogspo.engine.policies import StaticTree
from ogspo.engine.target import LlamaTreeLM, build_tree_lm
from ogspo.engine.tree import Structure
from ogspo.learn.export import export_policy
from ogspo.learn.policy import PolicyData, PolicyHead, offline_states, policy_depths, train_policy
from ogspo.methods.features import FEATURE_NAMES, FEATURES_VERSION, N_FEATURES
from ogspo.methods.ogspo import OnnxPolicy, load_policy_dir
from ogspo.methods.registry import make_policy
from ogspo.stages.collect_records import collect_records

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 3, 3, 3, 3, 40, 41], [17, 22, 60, 1, 8, 33, 12, 5, 9, 13]]
TEMPLATE = Structure.full([3, 2, 2])
SUB = Structure([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
MAX_NEW = 14
FAST = {"hidden": 16, "steps_per_sweep": 150, "rounds": 2, "holdout_fraction": 0.25}


def _setup(max_len=256):
    target = build_tree_lm(tiny_model(0), max_len=max_len)
    drafter = LMDrafter(LlamaTreeLM(tiny_model(0), max_len=max_len, n_layers=1))  # early exit: partial acceptance
    return target, drafter


@pytest.fixture(scope="module")
def tiny_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("records")
    target, drafter = _setup()
    collect_records(
        target=target, drafter=drafter, template=TEMPLATE, prompts=PROMPTS, temperature=0.0, seed=0,
        max_new_tokens=MAX_NEW, out_dir=out, shard_size=2, model_checksum="m" * 64, drafter_id="ee1",
    )
    return load_records(out)


def _constant_head(value: float) -> PolicyHead:
    head = PolicyHead(N_FEATURES, 4)
    with torch.no_grad():
        for p in head.net.parameters():
            p.zero_()
        head.net[-1].bias.fill_(value)
    return head.eval()


class Recorder:
    """Stop hook that records the features an OnnxPolicy computes, then decides with it."""

    def __init__(self, policy: OnnxPolicy):
        self.policy, self.rows = policy, []

    def __call__(self, tree, level, ctx):
        f = self.policy.features(tree, level, ctx)
        self.rows.append((level, f))
        return self.policy.decide(f)


def test_features_online_equal_offline_full_template(tiny_records, tmp_path):
    """Online (engine + hook, same seeds as the records) == offline (records), bit for bit, on every cycle
    and level: the request's history (EMA and last cycle's commit, from the growth of the committed
    context) and context length included."""
    data = offline_states(records=tiny_records, structure=TEMPLATE, latency=synthetic_latency())
    export_policy(head=_constant_head(1.0), path=tmp_path / "p.onnx", structure=TEMPLATE, lam=1.0)
    target, drafter = _setup()
    rec = Recorder(OnnxPolicy(tmp_path / "p.onnx"))
    engine = SpeculativeEngine(target=target, policy=StaticTree(TEMPLATE), drafter=drafter, stop_hook=rec)
    for i, prompt in enumerate(PROMPTS):
        engine.generate(prompt, max_new_tokens=MAX_NEW, seed=request_seed(0, f"p{i}"))
    D = TEMPLATE.max_depth
    online = np.stack([f for _, f in rec.rows]).reshape(-1, D - 1, N_FEATURES)  # hook runs at levels 1..D-1
    assert [lv for lv, _ in rec.rows[: D - 1]] == list(range(1, D))
    assert online.shape[0] == data.features.shape[0] > 5
    np.testing.assert_array_equal(online, data.features[:, : D - 1])
    for name in ("recent_accept", "last_accept"):  # the request's history is exercised
        assert data.features[:, :, FEATURE_NAMES.index(name)].max() > 1


def test_features_online_equal_offline_sub_structure(tiny_records, tmp_path):
    """Same-trace executions of each recorded cycle under a sub-structure S: the tree features match the
    offline reconstruction from the records' rows of S's nodes."""
    data = offline_states(records=tiny_records, structure=SUB, latency=synthetic_latency())
    export_policy(head=_constant_head(1.0), path=tmp_path / "p.onnx", structure=SUB, lam=1.0)
    target, drafter = _setup()
    policy = OnnxPolicy(tmp_path / "p.onnx")
    rec = Recorder(policy)
    engine = SpeculativeEngine(target=target, policy=StaticTree(SUB), drafter=drafter, stop_hook=rec)
    cyc = tiny_records.cycles
    seq: dict[str, list[int]] = {}
    history = [FEATURE_NAMES.index("recent_accept"), FEATURE_NAMES.index("last_accept")]
    for c, row in enumerate(cyc.iter_rows(named=True)):
        rid = row["request_id"]
        prompt = PROMPTS[int(rid[1:])]
        if row["cycle"] == 1:
            seq[rid] = prompt + [row["root_token"]]
        context, root = seq[rid][:-1], seq[rid][-1]
        assert root == row["root_token"] and len(context) == row["context_length"]
        rec.rows.clear()
        engine.cycle_from(context, root, request_seed=row["request_seed"], index=row["cycle"])
        seq[rid] = seq[rid] + list(row["committed"])
        got = np.stack([f for _, f in rec.rows])  # [D_S - 1, F]
        want = data.features[c, : SUB.max_depth - 1]
        keep = [i for i in range(N_FEATURES) if i not in history]  # a fresh cycle_from has no request history
        np.testing.assert_array_equal(got[:, keep], want[:, keep])


def _synthetic_data(n_cycles=3000, D=6, seed=0) -> PolicyData:
    """Cycles with a hidden quality q: the accepted prefix k ~ geometric with per-depth acceptance q; the
    features carry q (noisily) and the level, so a policy can stop early on bad cycles."""
    rng = np.random.default_rng(seed)
    q = rng.beta(2, 1.5, n_cycles)  # [C]
    k = np.minimum((rng.random((n_cycles, D)) < q[:, None]).cumprod(1).sum(1), D)  # [C]
    d = np.arange(1, D + 1)
    accepted = 1.0 + np.minimum(k[:, None], d[None, :])  # [C, D]
    seconds = 0.1 + 0.03 * d[None, :] + 0.0 * accepted  # [C, D]
    feats = np.zeros((n_cycles, D, N_FEATURES), dtype=np.float32)
    feats[:, :, 0] = d
    feats[:, :, FEATURE_NAMES.index("max_cum_prob")] = (q[:, None] ** d + 0.05 * rng.standard_normal((n_cycles, D)))
    feats[:, :, FEATURE_NAMES.index("mean_entropy")] = rng.random((n_cycles, D))  # noise
    reqs = np.array([f"r{i // 20}" for i in range(n_cycles)], dtype=object)
    return PolicyData(Structure.chain(D), feats, accepted, seconds, reqs)


@pytest.fixture(scope="module")
def trained():
    data = _synthetic_data()
    return data, train_policy(data=data, seed=0, config=FAST)


def test_backward_induction_beats_best_fixed_depth(trained):
    data, res = trained
    tr = res.train
    assert tr.throughput >= tr.best_fixed_throughput * 1.01, tr
    assert tr.throughput <= tr.posterior_bound + 1e-9
    assert res.holdout is not None and res.holdout.throughput >= res.holdout.best_fixed_throughput
    assert len(set(tr.stop_histogram) - {0}) > 1  # it does stop at different depths
    # deterministic given the seed
    again = train_policy(data=data, seed=0, config=FAST)
    np.testing.assert_array_equal(policy_depths(again.head, data), policy_depths(res.head, data))


def test_onnx_matches_torch_and_metadata_round_trips(trained, tmp_path):
    data, res = trained
    out = export_policy(head=res.head, path=tmp_path / "policy.onnx", structure=data.structure, lam=res.lam)
    pol = OnnxPolicy(out.path)
    X = data.features.reshape(-1, N_FEATURES)  # [C*D, F]
    ort_adv = pol.advantage(X)
    torch_adv = res.head.advantage(X)
    agree = np.mean((ort_adv <= 0) == (torch_adv <= 0))
    assert agree >= 0.999, agree
    np.testing.assert_allclose(ort_adv, torch_adv, rtol=1e-4, atol=1e-4)
    assert pol.decide(X[0]) == bool(torch_adv[0] <= 0)
    assert pol.structure.paths == data.structure.paths
    assert pol.lam == pytest.approx(res.lam)
    assert int(pol.metadata["ogspo_features_version"]) == FEATURES_VERSION
    assert json.loads(pol.metadata["ogspo_feature_names"]) == list(FEATURE_NAMES)
    assert pol.providers == ["CPUExecutionProvider"]
    assert not list(tmp_path.glob(".*tmp*"))  # temp file renamed


def test_bad_policy_files_give_one_line_errors(tmp_path):
    (tmp_path / "policy.onnx").write_bytes(b"not an onnx model")
    write_structure(SUB, tmp_path / "structure.json")
    for path, needle in ((tmp_path, "is not a readable ONNX model"), (tmp_path / "missing", "does not exist")):
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            load_policy_dir(path)
        assert needle in str(info.value) and "\n" not in str(info.value)
    # an ONNX model without ogspo metadata
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(_constant_head(1.0), (torch.zeros(1, N_FEATURES),), str(tmp_path / "policy.onnx"),
                          dynamo=False, input_names=["features"], output_names=["advantage"], opset_version=17)
    with pytest.raises(ValueError, match="has no ogspo metadata"):
        load_policy_dir(tmp_path)
    # structure.json that disagrees with the policy's structure
    export_policy(head=_constant_head(1.0), path=tmp_path / "policy.onnx", structure=TEMPLATE, lam=1.0)
    with pytest.raises(ValueError, match="differs from the structure"):
        load_policy_dir(tmp_path)
    # through the CLI: one `ogspo: error:` line, exit status 2
    from ogspo.cli import main

    (tmp_path / "policy.onnx").write_bytes(b"garbage")
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["generate", "hi", "--model", str(tmp_path), "--method", "ogspo", "--policy", str(tmp_path)])
    assert rc == 2 and err.getvalue().count("\n") == 1 and "not a readable ONNX model" in err.getvalue()


def test_ogspo_method_is_lossless_at_temperature_zero(tmp_path):
    export_policy(head=threshold_head("max_cum_prob", 0.5), path=tmp_path / "policy.onnx", structure=SUB, lam=1.0)
    write_structure(SUB, tmp_path / "structure.json")
    target_model = tiny_model(0)
    target = build_tree_lm(target_model, max_len=256)
    policy = make_policy("ogspo", policy_path=tmp_path)
    assert policy.name == "ogspo" and policy.structure.paths == SUB.paths
    for prompt in PROMPTS:
        engine = SpeculativeEngine(target=target, policy=policy, drafter=LMDrafter(build_tree_lm(tiny_model(1), max_len=256)))
        res = engine.generate(prompt, max_new_tokens=30)
        assert res.tokens == hf_greedy(target_model, prompt, 30)
    hook = policy.hook
    assert 0 < hook.stops < hook.calls  # it stopped early sometimes, not always
    with pytest.raises(ValueError, match="needs a policy folder"):
        make_policy("ogspo")


def test_train_policy_cli(tiny_records, tmp_path):
    """records + latency + oracle -> policy folder that the `ogspo` method loads."""
    from ogspo.artifacts.oracle import write_oracle
    from ogspo.cli import main
    from ogspo.offline.replay import replay_cycles
    from ogspo.offline.solve import solve_oracle

    lat = synthetic_latency()
    (tmp_path / "latency.json").write_text(json.dumps(lat.to_json()))
    rec_dir = tmp_path / "rec"
    target, drafter = _setup()
    collect_records(target=target, drafter=drafter, template=TEMPLATE, prompts=PROMPTS, temperature=0.0, seed=0,
                    max_new_tokens=MAX_NEW, out_dir=rec_dir, shard_size=3, model_checksum="m" * 64, drafter_id="ee1")
    oracle = solve_oracle(cycles=replay_cycles(load_records(rec_dir)), latency=lat, config={"time_limit": 10})
    write_oracle(oracle, tmp_path / "oracle.json")
    cfg = json.dumps({"seed": 0, "policy": {**FAST, "sweeps": 0, "lr": 0.003, "weight_decay": 0.0}})
    rc = main(["train-policy", "--config-json", cfg, "--records", str(rec_dir), "--latency", str(tmp_path / "latency.json"),
               "--oracle", str(tmp_path / "oracle.json"), "--out", str(tmp_path / "pol")])
    assert rc == 0
    report = json.loads((tmp_path / "pol" / "train.json").read_text())
    assert report["structure"] == oracle.structure
    assert report["train"]["throughput"] <= report["train"]["posterior_bound"] + 1e-9
    S, pol, _ = load_policy_dir(tmp_path / "pol")
    assert S.to_list() == oracle.structure and pol.structure.paths == S.paths


def test_empty_oracle_structure_means_autoregressive(tmp_path):
    """When the oracle keeps no node (drafting never pays), the stage writes an empty policy and the
    ogspo method decodes autoregressively instead of failing."""
    import json

    from ogspo.methods.registry import make_policy
    from ogspo.stages.train_policy_only import run_train_policy

    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"structure": [], "throughput": 25.0}))
    r = run_train_policy(records_dirs=[], latency_path=tmp_path / "unused.json", oracle_path=oracle,
                         out_dir=tmp_path / "policy", config=None, seed=0)
    assert r.train is None and json.loads((tmp_path / "policy" / "train.json").read_text())["autoregressive"]
    policy = make_policy("ogspo", policy_path=tmp_path / "policy")
    assert policy.max_nodes == 1 and policy.name == "ogspo"
