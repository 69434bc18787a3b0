"""Token-for-token comparison with plain greedy decoding that tells near-ties from real bugs.

Batched tree verification reorders floating-point sums, so on a near-tie (the reference's top-2
logits within ~1e-4) the argmax can legitimately flip. `compare_greedy` finds the first
divergence, recomputes the reference logits there, and reports whether it is such a tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LosslessReport:
    equal: bool
    first_mismatch: int | None = None  # index into the generated tokens
    margin: float | None = None  # reference top-1 minus top-2 logit at the divergence
    candidate_is_runner_up: bool = False  # the diverging token is the reference's second choice
    near_tie: bool = False  # a float-rounding flip, not a bug

    def describe(self) -> str:
        if self.equal:
            return "identical"
        kind = "near-tie" if self.near_tie else "MISMATCH"
        return f"{kind} at token {self.first_mismatch} (top-2 margin {self.margin:.2e})"


def compare_greedy(
    hf_model, prompt: list[int], reference: list[int], candidate: list[int], *, tie_margin: float = 1e-4
) -> LosslessReport:
    """Compare `candidate` with the greedy `reference` continuation of `prompt`."""
    n = min(len(reference), len(candidate))
    for i in range(n):
        if reference[i] != candidate[i]:
            break
    else:
        if len(reference) == len(candidate):
            return LosslessReport(equal=True)
        i = n
    if i >= n:  # one is a prefix of the other (e.g. one stopped at EOS): not a tie
        return LosslessReport(equal=False, first_mismatch=i, margin=float("inf"))
    with torch.inference_mode():
        ids = torch.tensor([prompt + reference[:i]], device=hf_model.device)  # [1, L + i]
        logits = hf_model(ids).logits[0, -1].double()
    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    runner_up = int(top.indices[1]) == candidate[i]
    return LosslessReport(
        equal=False,
        first_mismatch=i,
        margin=margin,
        candidate_is_runner_up=runner_up,
        near_tie=runner_up and margin < tie_margin,
    )
