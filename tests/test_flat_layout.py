"""FlatLayout: the one rule for where a tensor sits in a flat buffer and which shard is a rank's.

Every flat buffer of the strategies follows it (DDP buckets, ZeRO-1/2 buckets, FSDP units,
ShardedOptimizer's all-gather slots); these tests pin the rule itself, with no process group.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddpkit.strategies.flat_layout import FlatLayout, alloc_storage, free_storage, held_bytes, is_allocated

SHAPES = [(3, 2), (5,), (), (2, 2, 2)]  # 6 + 5 + 1 + 8 = 20 elements


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 21, 40])
def test_offsets_padding_and_shards(world_size):
    layouts = [FlatLayout(SHAPES, world_size, r) for r in range(world_size)]
    lay = layouts[0]
    assert lay.numels == [6, 5, 1, 8] and lay.offsets == [0, 6, 11, 12] and lay.numel == 20
    assert lay.shard_numel == math.ceil(20 / world_size)
    assert lay.padded_numel == world_size * lay.shard_numel and 0 <= lay.padded_numel - 20 < world_size
    flat = torch.arange(float(lay.padded_numel))
    shards = [layout.shard(flat) for layout in layouts]  # each rank's own shard
    assert all(s.numel() == lay.shard_numel for s in shards)
    assert torch.equal(torch.cat(shards), flat)  # the N shards tile the padded buffer, in rank order
    assert all(torch.equal(lay.shard(flat, r), shards[r]) for r in range(world_size))


def test_one_rank_has_no_padding_and_its_shard_is_everything():
    lay = FlatLayout(SHAPES)
    assert lay.padded_numel == lay.numel == lay.shard_numel == 20
    flat = lay.zeros(torch.float32, "cpu")
    assert lay.shard(flat).data_ptr() == flat.data_ptr() and lay.shard(flat).numel() == 20


def test_pack_and_views_round_trip_with_zeros_for_missing_and_padding():
    tensors = [torch.randn(s) for s in SHAPES]
    lay = FlatLayout.of(tensors, world_size=3)   # 20 -> 21: one element of padding
    flat = lay.pack(tensors[:1] + [None] + tensors[2:], torch.full((lay.padded_numel,), 7.0))
    views = lay.views(flat)
    assert [v.shape for v in views] == [torch.Size(s) for s in SHAPES]
    assert torch.equal(views[0], tensors[0]) and torch.equal(views[3], tensors[3])
    assert views[1].eq(0).all() and flat[20:].eq(0).all()  # a missing tensor and the padding: zeros
    views[3].fill_(1.0)                                    # views write through to the buffer
    assert flat[12:20].eq(1.0).all() and torch.equal(lay.view(flat, 3), views[3])


def test_pack_converts_dtype_and_fills_a_larger_slot():
    tensors = [torch.randn(4), torch.randn(2, 3)]
    lay = FlatLayout.of(tensors)
    slot = torch.full((15,), 3.0, dtype=torch.bfloat16)   # a ShardedOptimizer slot bigger than the layout
    lay.pack(tensors, slot)
    assert slot.dtype == torch.bfloat16 and slot[10:].eq(0).all()
    assert torch.allclose(lay.view(slot, 1).float(), tensors[1], atol=1e-2)


def test_pack_leaves_autograd_alone():
    p = nn.Parameter(torch.randn(3))
    out = FlatLayout.of([p]).pack([p], torch.empty(3))
    assert not out.requires_grad and torch.equal(out, p.detach())


def test_free_and_alloc_storage_keep_views_alive():
    lay = FlatLayout(SHAPES, world_size=2)
    flat = lay.zeros(torch.float32, "cpu")
    views = lay.views(flat)
    free_storage(flat)
    assert not is_allocated(flat) and held_bytes(flat) == 0 and flat.numel() == 20
    alloc_storage(flat)
    assert is_allocated(flat) and held_bytes(flat) == 20 * 4
    flat.fill_(2.0)
    assert all(v.eq(2.0).all() for v in views)  # the same views see the refilled storage


def test_bad_rank_is_a_value_error():
    for world_size, rank in [(0, 0), (2, 2), (2, -1)]:
        with pytest.raises(ValueError, match="FlatLayout"):
            FlatLayout(SHAPES, world_size, rank)
