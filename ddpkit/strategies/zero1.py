"""ShardedOptimizer: placeholder until the strategies issue lands."""


class ShardedOptimizer:
    def __init__(self, *a, **k):
        raise NotImplementedError("ShardedOptimizer is not written yet")
