"""Nested batches, arguments and outputs (tuples, lists, dicts, named tuples, dataclasses), walked
one way everywhere: torch's pytree, through ``ddpkit.torch_internals``.
"""
from __future__ import annotations

import torch

from ddpkit.torch_internals import tree_leaves_with_path as leaves  # (where, leaf), e.g. ("['input_ids']", t)
from ddpkit.torch_internals import tree_map as map_leaves  # map_leaves(fn, obj): fn on each leaf, structure kept


def tensors(obj):
    """The tensors among the leaves of ``obj``."""
    return (t for _, t in leaves(obj) if torch.is_tensor(t))


__all__ = ["leaves", "map_leaves", "tensors"]
