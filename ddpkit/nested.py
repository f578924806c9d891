"""Nested batches and outputs: the leaves of tuples, lists and dicts, walked one way everywhere.

A workload's batch (``ddpkit.Workload``), a forward's arguments (FSDP's mixed precision casts
them) and a module's output (FSDP hooks the tensors in it) nest tuples, lists and dicts as deep as
they like; anything else is a leaf.
"""
from __future__ import annotations

import torch


def leaves(obj, where: str = ""):
    """``(where, leaf)`` for every leaf of ``obj``, in order, e.g. ``("['input_ids']", t)``."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{where}[{k!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{where}[{i}]")
    else:
        yield where, obj


def map_leaves(fn, obj):
    """``obj`` with ``fn`` applied to each leaf, its structure (tuple, list, dict) kept."""
    if isinstance(obj, dict):
        return type(obj)((k, map_leaves(fn, v)) for k, v in obj.items())
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_leaves(fn, v) for v in obj)
    return fn(obj)


def tensors(obj):
    """The tensors among the leaves of ``obj``."""
    return (t for _, t in leaves(obj) if torch.is_tensor(t))
