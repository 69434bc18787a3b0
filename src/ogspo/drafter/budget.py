"""How much of the head's recipe `train_drafter` builds and trains within `drafter.minutes` on the
machine it runs on.

The recipe (default.yaml's `drafter`) names the most data and training it will use; a machine that
writes, reads or trains slower gets a prefix of it, sized from the rates measured as the work goes:

- the data comes in blocks, in a fixed order (blocks of prompts of similar length, shuffled by the
  seed, so a prefix mixes every source; then the text to read, source by source): `DataBudget.admit` takes the next block
  while the seconds spent plus the block's predicted seconds (its work units times the seconds per
  unit measured so far for its kind, writing or reading; before the first, the rate `expect`ed, e.g.
  of the forwards `plan_bulk` timed) stay within the data's share of the budget.
  A block read from the cache counts the seconds it took when it was built, so a rerun on the same
  machine takes the same blocks.
- the training steps are the recipe's (`epochs` passes over the data taken) or fewer:
  `budget_steps` fits them into what is left of the budget at the step time measured.

What was taken is recorded (`DataBudget.sizes`, the steps) in `drafter.json`; `drafter.sizes` set to
that record rebuilds exactly those blocks and steps, whatever the time (a reproducible rerun).

The same admission sizes the stages that decode requests after it (`stages.measure_drafter`,
`stages.collect_records`, `stages.evaluate`): there a block is a round of prompts or a records shard,
of kind WRITE, and the work that always runs is `charge`d rather than predicting the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WRITE, READ = "write", "read"  # kinds of work: the target generating (units: prompts), reading text (units: tokens)


@dataclass
class DataBudget:
    """Admits the head's data blocks in order, within `seconds` (None: every block), or exactly the
    blocks per part of `fixed` (an earlier run's `sizes`). The first block written is always taken;
    a part's blocks are a prefix (once one is refused, the rest of that part are too)."""

    seconds: float | None
    fixed: dict[str, int] | None = None
    spent: float = 0.0
    taken: dict[str, int] = field(default_factory=dict)  # blocks taken per part ("generated", "sharegpt", ...)
    offered: dict[str, int] = field(default_factory=dict)  # blocks the recipe holds per part
    _closed: set[str] = field(default_factory=set)
    _prior: dict[str, float] = field(default_factory=dict)  # seconds per unit before any block of a kind is measured
    _units: dict[str, float] = field(default_factory=lambda: {WRITE: 0.0, READ: 0.0})
    _seconds: dict[str, float] = field(default_factory=lambda: {WRITE: 0.0, READ: 0.0})

    @classmethod
    def replay(cls, sizes: dict[str, int] | None) -> DataBudget:
        """Exactly the blocks of a `sizes` record (`drafter.sizes`, or a trained head's metrics.sizes;
        its `steps` are the trainer's); None: every block."""
        return cls(seconds=None, fixed=None if sizes is None else {k: v for k, v in sizes.items() if k != "steps"})

    def expect(self, kind: str, seconds_per_unit: float) -> None:
        """The rate that predicts `kind`'s first block, before one is measured (for reading: the causal
        forwards `plan_bulk` timed)."""
        self._prior[kind] = seconds_per_unit

    def predict(self, kind: str, units: float) -> float | None:
        """Seconds a block of `units` of `kind` should take at the rate measured so far, else at the
        expected one (None: neither)."""
        if self._units[kind]:
            return units * self._seconds[kind] / self._units[kind]
        return units * self._prior[kind] if kind in self._prior else None

    def admit(self, part: str, kind: str, units: float) -> bool:
        """Whether the next block of `part` (`units` of work of `kind`) is built; counts it offered."""
        n = self.taken.get(part, 0)
        self.offered[part] = self.offered.get(part, 0) + 1
        if part in self._closed:
            ok = False
        elif self.fixed is not None:
            ok = n < self.fixed.get(part, 0)
        elif self.seconds is None or (kind == WRITE and not self._units[WRITE]):
            ok = True
        else:
            ok = self.spent + (self.predict(kind, units) or 0.0) <= self.seconds
        if ok:
            self.taken[part] = n + 1
        else:
            self._closed.add(part)
        return ok

    def charge(self, seconds: float) -> None:
        """Seconds of the data's work that are no block (the target writing its own requests): the budget's
        time, not a rate."""
        self.spent += seconds

    def spend(self, kind: str, units: float, seconds: float) -> None:
        """A block of `units` of `kind` took `seconds` (when built; as recorded, when cached)."""
        self.spent += seconds
        self._units[kind] += units
        self._seconds[kind] += seconds

    @property
    def sizes(self) -> dict[str, int]:
        """Blocks taken per part: the `drafter.sizes` that rebuilds this data."""
        return {part: self.taken.get(part, 0) for part in self.offered}

    def describe(self) -> dict:
        rate = {k: (self._units[k] / self._seconds[k] if self._seconds[k] else None) for k in (WRITE, READ)}
        return {"seconds": self.seconds, "spent": round(self.spent, 1), "fixed": self.fixed is not None,
                "taken": self.sizes, "offered": dict(self.offered),
                "prompts_per_second": rate[WRITE], "read_tokens_per_second": rate[READ]}


def budget_steps(full: int, *, seconds_left: float | None, step_seconds: float) -> int:
    """Training steps: the recipe's `full`, or as many as `seconds_left` holds at `step_seconds` each
    (at least 1)."""
    if seconds_left is None:
        return full
    return max(1, min(full, int(seconds_left / max(step_seconds, 1e-9))))
