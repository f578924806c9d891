"""FlatLayout: where each tensor sits in one flat buffer, and which shard of it is this rank's.

Every flat buffer of the strategies (DDP and ZeRO buckets, FSDP's flat parameters, the sharded
optimizer's slots) follows one rule, decided here:

    tensors   t_0 (shape s_0), t_1, ..., t_{k-1}         numels n_i, T = sum n_i
    offsets   o_0 = 0, o_i = o_{i-1} + n_{i-1}          t_i lives in flat[o_i : o_i + n_i]
    padding   to N * ceil(T/N) elements (N = world_size; at most N-1 zeros), so that a
              reduce-scatter or an all-gather cuts the buffer into N equal shards
    shard r   flat[r*s : (r+1)*s], s = ceil(T/N): what rank r keeps, steps or receives

A layout holds only shapes, so it serves buffers of any dtype. A buffer needed part of the time
(FSDP's gathered parameter, ZeRO-2's gradient) keeps its tensor but gives its memory back
(``free_storage`` / ``alloc_storage``): views of it stay valid and see the data once refilled.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class FlatLayout:
    """Offsets of k tensors in one flat buffer padded to a multiple of ``world_size``; ``rank``'s shard."""

    def __init__(self, shapes: Iterable, world_size: int = 1, rank: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"FlatLayout: rank {rank} of world_size {world_size}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.world_size, self.rank = world_size, rank
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)                       # T
        self.shard_numel = -(-self.numel // world_size)     # s = ceil(T / N)
        self.padded_numel = self.shard_numel * world_size   # N * s: at most N-1 zeros of padding

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], world_size: int = 1, rank: int = 0) -> FlatLayout:
        """The layout of ``tensors`` in this order."""
        return cls([t.shape for t in tensors], world_size, rank)

    def __len__(self) -> int:
        return len(self.shapes)

    def __repr__(self) -> str:
        return (f"FlatLayout({len(self)} tensors, {self.numel} elements, padded to {self.padded_numel} "
                f"= {self.world_size} x {self.shard_numel}, rank {self.rank})")

    # ------------------------------------------------------------------ buffers
    def empty(self, dtype: torch.dtype, device) -> torch.Tensor:
        """A new, uninitialized buffer of the padded size: (N * s,)."""
        return torch.empty(self.padded_numel, dtype=dtype, device=device)

    def zeros(self, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.zeros(self.padded_numel, dtype=dtype, device=device)

    def pack(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Copy each tensor (None: zeros) into its place in ``out``, zero the rest, return ``out`` (padded
        size, or just big enough for the tensors)."""
        with torch.no_grad():
            for t, view in zip(tensors, self.views(out), strict=True):
                if t is None:
                    view.zero_()
                else:
                    view.copy_(t.detach())
            out[self.numel:].zero_()
        return out

    # ------------------------------------------------------------------ views
    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's place in ``flat``, shaped like tensor i (a view: writes go to ``flat``)."""
        off, n = self.offsets[i], self.numels[i]
        return flat[off:off + n].view(self.shapes[i])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor's place in ``flat``, in order."""
        return [self.view(flat, i) for i in range(len(self))]

    def shard(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank r's shard of a padded buffer: elements [r*s, (r+1)*s) (default: this rank's)."""
        r = self.rank if rank is None else rank
        s = self.shard_numel
        return flat[r * s:(r + 1) * s]


# ---------------------------------------------------------------------------- storage
def free_storage(t: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor (and every view of it) alive."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give a freed tensor its memory back (the values are garbage until written)."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


def is_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def held_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly freed) buffer holds right now: 0 while its storage is freed."""
    return t.untyped_storage().nbytes()
