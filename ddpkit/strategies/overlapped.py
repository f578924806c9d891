"""OverlappedDDP: placeholder until the strategies issue lands."""
from torch import nn


class OverlappedDDP(nn.Module):
    def __init__(self, module, *a, **k):
        raise NotImplementedError("OverlappedDDP is not written yet")
