"""What the strategy tests share: small models, a tolerance, and the single-process reference.

The reference (``train_single_process``) is what every strategy must equal; many tests ask for
the same one, so it is computed once per distinct call. Callers must not modify the tensors.
"""
from __future__ import annotations

import functools

from ddpkit.experiment import train_single_process

SMALL_MLP = dict(width=16, depth=4)                          # 5 Linears, 1258 parameters
SMALL_GPT = dict(vocab=16, dim=16, layers=1, heads=2, seq=8)  # tied head, LayerNorm, attention
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _reference(model_name, optimizer, steps, batch, kwargs_items):
    return train_single_process(model_name, optimizer, steps=steps, global_batch_size=batch, **dict(kwargs_items))


def reference_params(model_name: str, optimizer: str = "sgd", steps: int = 5, batch: int = 24, **model_kwargs) -> dict:
    """``train_single_process(...)`` after ``steps`` steps on global batches of ``batch``."""
    return _reference(model_name, optimizer, steps, batch, tuple(sorted(model_kwargs.items())))
