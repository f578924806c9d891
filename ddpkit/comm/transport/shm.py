"""ShmBackend: a gloo process group whose collectives move their bytes through shared memory.

gloo over loopback costs a millisecond or more per collective, CPU work on the cores backward
needs; NCCL and MPI move intra-node bytes through shared memory (DeepSpeed, vLLM and SGLang do for
CPU all-reduce), and so does this backend. Each collective is cut into pieces of at most
``chunk_bytes`` per rank, deposited and completed through the slab (``segment``, ``runner``):

- all-reduce (SUM, AVG, PRODUCT, MIN, MAX): reduce all N regions into my tensor in rank order, so
  every rank computes the same bits;
- all-gather: copy every region into its place; reduce-scatter: reduce the N ranks' blocks for me;
- broadcast: the root deposits, the others copy out; barrier: a piece of nothing;
in list, flat and coalesced forms; a group of one exchanges nothing. The slab is bounded (S slots
x N regions, 32 MiB a group by default): big tensors go in as many pieces as they need. The same
cutting serves ranks sharing a GPU (``device_slab``); a host slab's CUDA tensors are ``staging``'s.

It *is* a ``ProcessGroupGloo``: what it does not carry (send/recv, other ops, dtypes, devices)
runs on gloo over the same group. A failure (a peer died, the timeout, mismatched collectives) is
an ``ShmError`` on ``wait()`` and the future, and every later collective on the group fails.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from ddpkit.comm.transport.device_slab import DEVICE_SLAB_BYTES, DEVICE_SLOTS
from ddpkit.comm.transport.runner import Piece, Runner, finished
from ddpkit.comm.transport.segment import Segment
from ddpkit.torch_internals import is_async

CHUNK_BYTES = 2 << 20   # bytes of one rank's region at most: the largest piece a rank deposits at once
SLOTS = 8               # pieces in flight per group: a rank may deposit this far ahead of the slowest
SLAB_BYTES = 32 << 20   # a group's slab at most (S x N regions): more ranks, smaller regions
CARRIED = {torch.float16, torch.bfloat16, torch.float32, torch.float64,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, BARRIER = 1, 2, 3, 4, 5  # fingerprint op codes
_REDUCE = (("SUM", torch.add), ("AVG", torch.add), ("PRODUCT", torch.mul),
           ("MIN", torch.minimum), ("MAX", torch.maximum))


def _reducer(op):
    """(elementwise function, divide by N after?, code) for ``op``; None if not carried here."""
    for code, (name, fn) in enumerate(_REDUCE):
        if op == getattr(dist.ReduceOp, name):
            return fn, name == "AVG", code
    return None


def _writable(t: torch.Tensor):
    """A flat view of ``t`` to write into, and what to call after (a non-contiguous one: a copy back)."""
    if t.is_contiguous():
        return t.view(-1), None
    flat = t.contiguous().view(-1)
    return flat, lambda: t.copy_(flat.view(t.shape))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ShmBackend(dist.ProcessGroupGloo):
    """One process group of ranks on one host: collectives through a shared slab, the rest gloo."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta = timedelta(minutes=30), *,
                 prefix: str | None = None, chunk_bytes: int | None = None, slots: int | None = None,
                 device=None):
        """``device``: the CPU (None) or the GPU the ranks share (``device_slab``); other tensors: gloo."""
        super().__init__(store, rank, size, timeout)  # gloo's connections: the fallback
        self._device = torch.device("cpu") if device is None else torch.device(device)
        on_gpu = self._device.type == "cuda"
        if slots is None:
            slots = DEVICE_SLOTS if on_gpu else SLOTS
        if chunk_bytes is None:  # host: 2 MiB regions for 2 ranks, 1 MiB for 4, ...: 32 MiB a group
            chunk_bytes = (DEVICE_SLAB_BYTES // (max(slots, 1) * size) if on_gpu  # GPU: 8 MiB for 2, 4 for 4
                           else min(CHUNK_BYTES, SLAB_BYTES // (max(slots, 1) * size)))
        if chunk_bytes < 8 * size or slots < 1:
            raise ValueError(f"a region must hold one 8-byte element per rank ({8 * size} bytes) and there "
                             f"must be a slot; got chunk_bytes={chunk_bytes}, slots={slots}")
        self._rank, self._size = rank, size
        # prefix: how this group's names in /dev/shm start (a Cluster picks one per start and
        # removes leftovers by it); only group rank 0 names things
        self._seg = Segment(store, rank, size, slots, chunk_bytes, prefix or f"dk{os.getpid()}_",
                            device=self._device if on_gpu else None)
        self._runner = Runner(self._seg, f"ddpkit-shm-rank{rank}of{size}", timeout.total_seconds(),
                              device=self._device if on_gpu else None)
        self._seq = 0              # collectives carried so far (the same on every rank)

    # ------------------------------------------------------------------ issuing
    def _carries(self, tensors) -> bool:
        return all(t.device == self._device and t.layout == torch.strided and t.dtype in CARRIED
                   and t.dtype == tensors[0].dtype for t in tensors)

    def _carried_op(self, reduce_op, tensors):
        """The reduction for ``reduce_op`` where this backend carries it on ``tensors``, else None (gloo's)."""
        op = _reducer(reduce_op)
        if op is None or not tensors or not self._carries(tensors) or (op[1] and not tensors[0].is_floating_point()):
            return None
        return op

    def _issue(self, opts, name: str, code: int, nbytes: int, dtype, cuts, result, finish=None, at_wait=False):
        """Queue one collective: ``cuts``, its (deposit, complete) pairs on the slot's (N, R / itemsize)
        view; ``finish`` after the last; ``at_wait``: bytes move when somebody waits."""
        if not cuts:  # nothing to move (empty tensors): done, on every rank alike
            if finish is not None:
                finish()
            return finished(result)
        self._seq += 1
        what = f"shm {name} #{self._seq} ({nbytes} bytes, rank {self._rank} of {self._size})"
        fingerprint = (self._seq, code, nbytes)
        inputs = self._seg.data.inputs_ready()  # on a GPU slab: after what produced the inputs (device_slab)
        pieces = [Piece(deposit, complete, dtype, fingerprint, what, inputs=inputs) for deposit, complete in cuts]
        pieces[-1].finish = finish
        return self._runner.submit(pieces, result, waited=not is_async(opts), at_wait=at_wait)

    def _alone(self, result, *copies):
        """A group of one: the result is the input (``copies``: (output, input) pairs), done, no slab."""
        for out, x in copies:
            out.copy_(x)
        return finished(result)

    def _elements(self, dtype) -> int:
        """Elements of ``dtype`` in one region."""
        return self._seg.region // torch.empty(0, dtype=dtype).element_size()

    # ------------------------------------------------------------------ the collectives
    def allreduce(self, tensors, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = self._carried_op(opts.reduceOp, tensors)
        if len(tensors) != 1 or op is None:
            return super().allreduce(tensors, opts)  # several tensors per rank, bitwise ops, ...: gloo
        if self._size == 1:
            return self._alone(tensors)
        x, copy_back = _writable(tensors[0])
        return self._issue(opts, "all_reduce", ALL_REDUCE + 16 * op[2], _nbytes(tensors), x.dtype,
                           self._all_reduce(x, op), tensors, copy_back, at_wait=at_wait)

    def allreduce_coalesced(self, tensors, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op = self._carried_op(opts.reduceOp, tensors)
        if op is None:
            return super().allreduce_coalesced(tensors, opts)
        if self._size == 1:
            return self._alone(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])  # one collective for all of them

        def copy_back():
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(part.view(t.shape))
        return self._issue(opts, "all_reduce", ALL_REDUCE + 16 * op[2], _nbytes(tensors), flat.dtype,
                           self._all_reduce(flat, op), tensors, copy_back, at_wait=at_wait)

    def broadcast(self, tensors, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else dist.BroadcastOptions()
        if len(tensors) != 1 or opts.rootTensor != 0 or not self._carries(tensors):
            return super().broadcast(tensors, opts)
        if self._size == 1:
            return self._alone(tensors)
        x, copy_back = _writable(tensors[0])
        root = opts.rootRank
        return self._issue(opts, "broadcast", BROADCAST + 16 * root, _nbytes(tensors), x.dtype,
                           self._broadcast(x, root), tensors, copy_back if self._rank != root else None,
                           at_wait=at_wait)

    def allgather(self, output_lists, inputs, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else AllgatherOptions()
        if (len(inputs) != 1 or len(output_lists) != 1 or len(output_lists[0]) != self._size
                or not self._carries(inputs + output_lists[0])
                or any(o.numel() != inputs[0].numel() for o in output_lists[0])):
            return super().allgather(output_lists, inputs, opts)
        if self._size == 1:
            return self._alone(output_lists, (output_lists[0][0], inputs[0]))
        cuts, finish = self._all_gather(inputs[0], output_lists[0])
        return self._issue(opts, "all_gather", ALL_GATHER, _nbytes(output_lists[0]), inputs[0].dtype, cuts,
                           output_lists, finish, at_wait=at_wait)

    def _allgather_base(self, output, input, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else AllgatherOptions()
        if not self._carries([output, input]) or output.numel() != self._size * input.numel():
            return super()._allgather_base(output, input, opts)
        if self._size == 1:
            return self._alone([output], (output, input))
        cuts, finish = self._all_gather(input, [output])
        return self._issue(opts, "all_gather", ALL_GATHER, _nbytes([output]), input.dtype, cuts, [output], finish,
                           at_wait=at_wait)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None, *, at_wait: bool = False):
        if not all(self._carries([o, i]) and o.numel() == self._size * i.numel()
                   for o, i in zip(outputs, inputs, strict=True)) or len({i.dtype for i in inputs}) > 1:
            return self._on_gloo(dist.ProcessGroupGloo._allgather_base, outputs, inputs, opts)
        if self._size == 1:
            return self._alone(outputs, *zip(outputs, inputs, strict=True))
        cuts, finishes = [], []
        for o, i in zip(outputs, inputs, strict=True):
            c, f = self._all_gather(i, [o])
            cuts += c
            finishes.append(f)
        return self._issue(opts, "all_gather", ALL_GATHER, _nbytes(outputs), inputs[0].dtype, cuts, outputs,
                           lambda: [f() for f in finishes if f is not None], at_wait=at_wait)

    def reduce_scatter(self, outputs, input_lists, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._carried_op(opts.reduceOp, outputs + [t for ins in input_lists for t in ins])
        if (op is None or len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != self._size
                or any(i.numel() != outputs[0].numel() for i in input_lists[0])):
            return super().reduce_scatter(outputs, input_lists, opts)
        if self._size == 1:
            return self._alone(outputs, (outputs[0], input_lists[0][0]))
        cuts, finish = self._reduce_scatter(input_lists[0], outputs[0], op)
        return self._issue(opts, "reduce_scatter", REDUCE_SCATTER + 16 * op[2], _nbytes(input_lists[0]),
                           outputs[0].dtype, cuts, outputs, finish, at_wait=at_wait)

    def _reduce_scatter_base(self, output, input, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._carried_op(opts.reduceOp, [output, input])
        if op is None or input.numel() != self._size * output.numel():
            return super()._reduce_scatter_base(output, input, opts)
        if self._size == 1:
            return self._alone([output], (output, input))
        cuts, finish = self._reduce_scatter([input], output, op)
        return self._issue(opts, "reduce_scatter", REDUCE_SCATTER + 16 * op[2], _nbytes([input]), output.dtype,
                           cuts, [output], finish, at_wait=at_wait)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None, *, at_wait: bool = False):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._carried_op(opts.reduceOp, outputs + inputs)
        if op is None or not all(i.numel() == self._size * o.numel() for o, i in zip(outputs, inputs, strict=True)):
            return self._on_gloo(dist.ProcessGroupGloo._reduce_scatter_base, outputs, inputs, opts)
        if self._size == 1:
            return self._alone(outputs, *zip(outputs, inputs, strict=True))
        cuts, finishes = [], []
        for o, i in zip(outputs, inputs, strict=True):
            c, f = self._reduce_scatter([i], o, op)
            cuts += c
            finishes.append(f)
        return self._issue(opts, "reduce_scatter", REDUCE_SCATTER + 16 * op[2], _nbytes(inputs), outputs[0].dtype,
                           cuts, outputs, lambda: [f() for f in finishes if f is not None], at_wait=at_wait)

    def _on_gloo(self, method, outputs, inputs, opts):
        """A coalesced collective that gloo's binding lacks, pair by pair on gloo (finished)."""
        for o, i in zip(outputs, inputs, strict=True):
            method(self, o, i, opts).wait()
        return finished(outputs)

    def barrier(self, opts=None, *, at_wait: bool = False):
        if self._size == 1:
            return self._alone([])
        nothing = [(_nothing, _nothing)]  # one empty piece: it completes once every rank deposited it
        return self._issue(opts, "barrier", BARRIER, 0, torch.uint8, nothing, [], at_wait=at_wait)

    # ------------------------------------------------------------------ cutting them into pieces
    # Each returns the (deposit, complete) pair of every piece; ``v`` is the slot, (N, R / itemsize):
    # v[k] is rank k's region. They run later, in order, on whichever thread moves the queue.
    def _reduce(self, parts, out, op) -> None:
        """out = parts[0] op parts[1] op ... (in rank order), then / N for AVG."""
        fn, average, _ = op
        if len(parts) == 1:
            out.copy_(parts[0])
        else:
            fn(parts[0], parts[1], out=out)
            for p in parts[2:]:
                fn(out, p, out=out)
        if average:
            out.div_(len(parts))

    def _all_reduce(self, x: torch.Tensor, op) -> list:
        n, r = self._size, self._rank

        def piece(i: int, length: int):
            mine = x[i:i + length]

            def deposit(v):
                v[r, :length].copy_(mine)

            def complete(v):
                if n == 2 and op[0] is torch.add:  # a + b == b + a, bit for bit: add the peer's part in place
                    mine.add_(v[1 - r, :length])
                    if op[1]:
                        mine.div_(2)
                else:
                    self._reduce([v[k, :length] for k in range(n)], mine, op)
            return deposit, complete
        return [piece(i, length) for i, length in _cut(x.numel(), self._elements(x.dtype))]

    def _all_gather(self, x: torch.Tensor, outs: list):
        """``outs``: N tensors of x's size (list form) or one of N times it (flat form)."""
        x = x.reshape(-1)
        n, r = self._size, self._rank
        flats = [_writable(o) for o in outs]
        rows = flats[0][0].view(n, -1) if len(outs) == 1 else [f for f, _ in flats]

        def piece(i: int, length: int):
            def deposit(v):
                v[r, :length].copy_(x[i:i + length])

            def complete(v):
                if len(outs) == 1:
                    rows[:, i:i + length].copy_(v[:, :length])   # one strided copy for all N rows
                else:
                    for k in range(n):
                        rows[k][i:i + length].copy_(v[k, :length])
            return deposit, complete
        backs = [back for _, back in flats if back is not None]
        return ([piece(i, length) for i, length in _cut(x.numel(), self._elements(x.dtype))],
                (lambda: [back() for back in backs]) if backs else None)

    def _reduce_scatter(self, ins: list, out: torch.Tensor, op):
        """``ins``: N tensors of out's size (list form) or one of N times it (flat form)."""
        n, r = self._size, self._rank
        y, copy_back = _writable(out)
        rows = ins[0].reshape(n, -1) if len(ins) == 1 else [i.reshape(-1) for i in ins]

        def piece(i: int, length: int):
            def deposit(v):   # my region holds N blocks of `length`, one per destination rank
                mine = v[r, :n * length].view(n, length)
                if len(ins) == 1:
                    mine.copy_(rows[:, i:i + length])
                else:
                    for k in range(n):
                        mine[k].copy_(rows[k][i:i + length])

            def complete(v):
                self._reduce([v[k, r * length:(r + 1) * length] for k in range(n)], y[i:i + length], op)
            return deposit, complete
        return [piece(i, length) for i, length in _cut(y.numel(), self._elements(y.dtype) // n)], copy_back

    def _broadcast(self, x: torch.Tensor, root: int) -> list:
        """The root fills the whole slot (N regions) per piece, the others copy it out."""
        r = self._rank

        def piece(i: int, length: int):
            def deposit(v):
                if r == root:
                    v.view(-1)[:length].copy_(x[i:i + length])

            def complete(v):
                if r != root:
                    x[i:i + length].copy_(v.view(-1)[:length])
            return deposit, complete
        return [piece(i, length) for i, length in _cut(x.numel(), self._size * self._elements(x.dtype))]


def _cut(numel: int, step: int):
    """(start, length) of each piece of ``numel`` elements, ``step`` at most."""
    return [(i, min(step, numel - i)) for i in range(0, numel, step)]


def _nothing(v) -> None:
    pass
