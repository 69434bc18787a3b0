"""The OGSPO size decision (docs/DESIGN.md §5, "Size decision"): size.json, its reader and writer.

After the stop policy ends drafting at depth d, the size rule chooses how many drafted nodes V to
verify: the top-V by confidence (`engine.tree.confidence_order`, an ancestor- and left-closed
subset). With p(v) the calibrated probability that node v lies on the accepted path (a monotone
table over its cumulative drafter log-prob, fitted on records), the expected committed tokens of
top-V are 1 + sum of its p(v) (the set is ancestor-closed, so the accepted path inside it is a prefix),
and the rule maximises the net gain

    1 + sum_{i<=V} p(v_i)  -  lambda * t_verify(V + 1, L)       over V = 0 .. |drafted nodes|

with lambda the policy's throughput estimate (tokens/s) and t_verify(n, L) = a(n) + b(n) L taken from
the device's latency model at fitting time. Draft time is sunk by then, so it does not enter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ogspo.artifacts.io import read_json, write_json

SIZE_FILE = "size.json"
SCHEMA_VERSION = 1


@dataclass
class SizeRule:
    lam: float  # tokens/s the net gain is taken at
    edges: list[float]  # cumulative log-prob bin edges, ascending (len(probs) - 1 inner edges)
    probs: list[float]  # P(on the accepted path) per bin, non-decreasing
    verify_intercept: list[float]  # a(n) for n = 1 .. max_nodes + 1 (index n - 1)
    verify_slope: list[float]  # b(n), seconds per context row
    meta: dict

    @property
    def max_nodes(self) -> int:
        return len(self.verify_intercept) - 1

    def node_probs(self, cum: np.ndarray) -> np.ndarray:
        """Calibrated P(on the accepted path) of nodes with cumulative log-probs `cum`. [m] -> [m]"""
        return np.asarray(self.probs)[np.searchsorted(np.asarray(self.edges), np.asarray(cum), side="right")]

    def gains(self, cum_sorted: np.ndarray, context_length: float) -> np.ndarray:
        """Net gain of verifying the top-V nodes, V = 0 .. m, for nodes already in confidence order. [m] -> [m + 1]"""
        m = min(len(cum_sorted), self.max_nodes)
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(self.node_probs(cum_sorted[:m]))])  # [m + 1]
        a, b = np.asarray(self.verify_intercept[: m + 1]), np.asarray(self.verify_slope[: m + 1])
        return expected - self.lam * (a + b * float(context_length))

    def choose(self, cum_sorted: np.ndarray, context_length: float) -> int:
        """V with the highest net gain (the smallest on ties)."""
        return int(np.argmax(self.gains(cum_sorted, context_length)))

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}


def write_size_rule(rule: SizeRule, path: Path) -> None:
    write_json(Path(path), rule.to_json())


def read_size_rule(path: Path) -> SizeRule:
    """A size.json written by `write_size_rule`; one-line ValueError otherwise."""
    path = Path(path)
    data = dict(read_json(path, "size rule"))
    if data.pop("schema_version", None) != SCHEMA_VERSION:
        raise ValueError(f"size rule {path}: not a size.json of schema version {SCHEMA_VERSION}")
    want = set(SizeRule.__dataclass_fields__)
    if set(data) != want:
        raise ValueError(f"size rule {path}: wrong keys (missing {sorted(want - set(data))}, unexpected "
                         f"{sorted(set(data) - want)})")
    rule = SizeRule(**data)
    if (len(rule.probs) != len(rule.edges) + 1 or len(rule.verify_slope) != len(rule.verify_intercept)
            or not rule.verify_intercept):
        raise ValueError(f"size rule {path}: table lengths do not match (probs = edges + 1, one slope per intercept)")
    if np.any(np.diff(rule.edges) < 0) or np.any(np.diff(rule.probs) < -1e-12) or not rule.lam > 0:
        raise ValueError(f"size rule {path}: edges and probs must be non-decreasing and lambda positive")
    return rule
