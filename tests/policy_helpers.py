"""Hand-set policy heads shared by the policy, rounds and evaluate tests."""

import torch

from ogspo.learn.policy import PolicyHead
from ogspo.methods.features import FEATURE_NAMES, N_FEATURES


def threshold_head(feature: str, threshold: float) -> PolicyHead:
    """advantage = x[feature] - threshold (continue while the feature is above the threshold)."""
    head = PolicyHead(N_FEATURES, 2)
    i = FEATURE_NAMES.index(feature)
    with torch.no_grad():
        for p in head.net.parameters():
            p.zero_()
        head.net[0].weight[0, i], head.net[0].bias[0] = 1.0, -threshold
        head.net[0].weight[1, i], head.net[0].bias[1] = -1.0, threshold
        head.net[2].weight[0, 0], head.net[2].weight[1, 1] = 1.0, 1.0
        head.net[4].weight[0, 0], head.net[4].weight[0, 1] = 1.0, -1.0
    return head.eval()
