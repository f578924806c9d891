"""FSDP: placeholder until the strategies issue lands."""
from torch import nn


class FSDP(nn.Module):
    def __init__(self, module, *a, **k):
        raise NotImplementedError("FSDP is not written yet")
