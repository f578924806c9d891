"""ShmBackend: a gloo process group whose collectives move their bytes through shared memory.

Ranks on one host need not push gradients through the network stack: gloo over loopback costs
a millisecond or more per collective here, and that copying is CPU work on the cores backward
needs. NCCL and MPI move intra-node bytes through shared memory instead (DeepSpeed, vLLM and
SGLang ship the same for CPU all-reduce); so does this backend, for the collectives data
parallelism issues:

- all-reduce (SUM, AVG, PRODUCT, MIN, MAX): each rank copies its chunk into its region of the
  slab; barrier; rank r reduces the r-th 1/N slice of every region into the shared result area
  (a reduce-scatter); barrier; every rank copies the whole result out (an all-gather). Each
  rank adds N slices of S/N bytes, so the arithmetic is split N ways, as in a ring. Up to
  64 KiB, one barrier instead: every rank reduces the whole of it from the N regions;
- all-gather and reduce-scatter, in list and flat-tensor forms (and their coalesced lists),
  broadcast and barrier: one barrier per chunk.
Tensors bigger than a region (``chunk_bytes``, 1 MiB) go through in chunks, so the slab is
bounded: 2 halves x (N + 1) chunks per group (6 MiB for 2 ranks). Sums run in rank order
(0 + 1 + ... + N-1) in the tensor's dtype, so every rank gets bit-identical results.

It *is* a ``ProcessGroupGloo`` (a Python subclass): whatever is not carried here (send/recv,
gather, scatter, all-to-all, sparse or CUDA tensors, other dtypes or ops) runs on gloo, beside
it, over the same group. Collectives run in issue order, on the group's thread or in the thread
that waits for one (``runner``), and return a ``Work`` whose ``get_future()`` completes with the
result; a failure (a peer died, the group's timeout passed, ranks issued different collectives)
is an ``ShmError`` (a ``DistError``) on ``wait()`` and on the future, and every later collective
on the group fails at once.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from ddpkit.transport.runner import Runner, finished
from ddpkit.transport.segment import Segment, ShmError

CHUNK_BYTES = 1 << 20   # bytes of one rank's region: the largest piece moved per barrier
SMALL_BYTES = 64 << 10  # all-reduces up to this size take one barrier, each rank reducing all of it
SPIN_US = 50.0          # how long a rank polls its doorbell (yielding the core) before it sleeps
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
    """A flat view of ``t`` to write the result into, and what to call afterwards (a
    non-contiguous tensor is written through a contiguous copy, then copied back)."""
    if t.is_contiguous():
        return t.view(-1), None
    flat = t.contiguous().view(-1)
    return flat, lambda: t.copy_(flat.view(t.shape))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ShmBackend(dist.ProcessGroupGloo):
    """One process group of ranks on one host: collectives through a shared slab, the rest gloo."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta = timedelta(minutes=30), *,
                 prefix: str | None = None, chunk_bytes: int = CHUNK_BYTES, spin_us: float = SPIN_US,
                 small_bytes: int = SMALL_BYTES):
        super().__init__(store, rank, size, timeout)  # gloo's connections: the fallback
        self._rank, self._size = rank, size
        self._timeout_s = timeout.total_seconds()
        # prefix: how this group's names in /dev/shm start (a Cluster picks one per start and
        # removes leftovers by it); only group rank 0 names things
        self._seg = Segment(store, rank, size, chunk_bytes, prefix or f"dk{os.getpid()}_", spin_us * 1e-6)
        self._small_bytes = min(small_bytes, self._seg.chunk)  # all-reduces up to this: one barrier
        self._runner = Runner(f"ddpkit-shm-rank{rank}of{size}")
        self._seq = 0              # collectives run on the slab so far (the same on every rank)
        self._half = 0             # chunks moved so far: chunk j uses half j % 2
        self._failed: ShmError | None = None
        self._what, self._deadline = "", 0.0   # the collective running now (read by the thread running it)

    # ------------------------------------------------------------------ issuing
    def _carries(self, tensors) -> bool:
        return all(t.device.type == "cpu" and t.layout == torch.strided and t.dtype in CARRIED
                   and t.dtype == tensors[0].dtype for t in tensors)

    def _carried_op(self, reduce_op, tensors):
        """The reduction for ``reduce_op`` if this backend carries it on ``tensors``, else None
        (bitwise ops, AVG of integers, other dtypes or devices: gloo's)."""
        op = _reducer(reduce_op)
        if op is None or not tensors or not self._carries(tensors) or (op[1] and not tensors[0].is_floating_point()):
            return None
        return op

    def _submit(self, opts, what: str, code: int, nbytes: int, body, result):
        """Queue ``body`` behind this group's earlier collectives; a Work for its completion."""
        return self._runner.submit(lambda future: self._execute(what, code, nbytes, body, result, future),
                                   waited=not getattr(opts, "asyncOp", True))

    def _execute(self, what: str, code: int, nbytes: int, body, result, future) -> None:
        """Run one collective (on whichever thread runs the queue) and complete its future."""
        if self._failed is None and (nbytes or code == BARRIER):  # empty tensors: nothing to move
            self._seq += 1
            self._what = f"shm {what} #{self._seq} ({nbytes} bytes, rank {self._rank} of {self._size})"
            self._deadline = time.monotonic() + self._timeout_s
            self._seg.publish(self._seq, code, nbytes)
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - the peers may now wait forever: fail the group
                self._failed = exc if isinstance(exc, ShmError) else ShmError(
                    f"{self._what}: {type(exc).__name__}: {exc}")
                future.set_exception(self._failed)
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt in a thread that waited: it stops the job as usual
                return
        if self._failed is not None:
            future.set_exception(ShmError(f"shm {what}: this group failed earlier: {self._failed}"))
        else:
            future.set_result(result)

    def _sync(self, first: bool) -> None:
        self._seg.barrier(self._deadline, self._what)
        if first:
            self._seg.check(self._seq, self._what)

    def _next_half(self) -> int:
        self._half += 1
        return self._half % 2

    # ------------------------------------------------------------------ the collectives
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = self._carried_op(opts.reduceOp, tensors)
        if len(tensors) != 1 or op is None:
            return super().allreduce(tensors, opts)  # several tensors per rank, bitwise ops, ...: gloo
        t = tensors[0]
        return self._submit(opts, "all_reduce", ALL_REDUCE + 16 * op[2], _nbytes(tensors),
                            lambda: self._all_reduce(t, op), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op = self._carried_op(opts.reduceOp, tensors)
        if op is None:
            return super().allreduce_coalesced(tensors, opts)

        def body():  # one flat buffer for all of them: one collective's barriers, not one per tensor
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self._all_reduce(flat, op)
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(part.view(t.shape))
        return self._submit(opts, "all_reduce", ALL_REDUCE + 16 * op[2], _nbytes(tensors), body, tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        if len(tensors) != 1 or opts.rootTensor != 0 or not self._carries(tensors):
            return super().broadcast(tensors, opts)
        t, root = tensors[0], opts.rootRank
        return self._submit(opts, "broadcast", BROADCAST + 16 * root, _nbytes(tensors),
                            lambda: self._broadcast(t, root), tensors)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        if (len(inputs) != 1 or len(output_lists) != 1 or len(output_lists[0]) != self._size
                or not self._carries(inputs + output_lists[0])
                or any(o.numel() != inputs[0].numel() for o in output_lists[0])):
            return super().allgather(output_lists, inputs, opts)
        x, outs = inputs[0], output_lists[0]
        return self._submit(opts, "all_gather", ALL_GATHER, _nbytes(outs),
                            lambda: self._all_gather(x, outs), output_lists)

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        if not self._carries([output, input]) or output.numel() != self._size * input.numel():
            return super()._allgather_base(output, input, opts)
        return self._submit(opts, "all_gather", ALL_GATHER, _nbytes([output]),
                            lambda: self._all_gather(input, [output]), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if not all(self._carries([o, i]) and o.numel() == self._size * i.numel()
                   for o, i in zip(outputs, inputs, strict=True)):
            return self._on_gloo(dist.ProcessGroupGloo._allgather_base, outputs, inputs, opts)

        def body():
            for o, i in zip(outputs, inputs, strict=True):
                self._all_gather(i, [o])
        return self._submit(opts, "all_gather", ALL_GATHER, _nbytes(outputs), body, outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._carried_op(opts.reduceOp, outputs + [t for ins in input_lists for t in ins])
        if (op is None or len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != self._size
                or any(i.numel() != outputs[0].numel() for i in input_lists[0])):
            return super().reduce_scatter(outputs, input_lists, opts)
        out, ins = outputs[0], input_lists[0]
        return self._submit(opts, "reduce_scatter", REDUCE_SCATTER + 16 * op[2], _nbytes(ins),
                            lambda: self._reduce_scatter(ins, out, op), outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._carried_op(opts.reduceOp, [output, input])
        if op is None or input.numel() != self._size * output.numel():
            return super()._reduce_scatter_base(output, input, opts)
        return self._submit(opts, "reduce_scatter", REDUCE_SCATTER + 16 * op[2], _nbytes([input]),
                            lambda: self._reduce_scatter([input], output, op), [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = self._carried_op(opts.reduceOp, outputs + inputs)
        if op is None or not all(i.numel() == self._size * o.numel() for o, i in zip(outputs, inputs, strict=True)):
            return self._on_gloo(dist.ProcessGroupGloo._reduce_scatter_base, outputs, inputs, opts)

        def body():
            for o, i in zip(outputs, inputs, strict=True):
                self._reduce_scatter([i], o, op)
        return self._submit(opts, "reduce_scatter", REDUCE_SCATTER + 16 * op[2], _nbytes(inputs), body, outputs)

    def _on_gloo(self, method, outputs, inputs, opts):
        """A coalesced collective that gloo's binding lacks, pair by pair on gloo (finished)."""
        for o, i in zip(outputs, inputs, strict=True):
            method(self, o, i, opts).wait()
        return finished(outputs)

    def barrier(self, opts=None):
        return self._submit(opts, "barrier", BARRIER, 0, lambda: self._sync(first=True), [])

    # ------------------------------------------------------------------ moving the bytes (worker thread)
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

    def _all_reduce(self, t: torch.Tensor, op) -> None:
        x, copy_back = _writable(t)
        n, r, v = self._size, self._rank, self._seg.views(x.dtype)   # v: (2, N + 1, E)
        if x.numel() * x.element_size() <= self._small_bytes:
            # Small: one barrier, then every rank reduces all of it (in rank order, so the same
            # bits everywhere): a second barrier costs more than N-1 additions of a few KB.
            h = self._next_half()
            v[h, r, :x.numel()].copy_(x)
            self._sync(first=True)
            self._reduce([v[h, k, :x.numel()] for k in range(n)], x, op)
        else:
            step = v.shape[2]
            for i in range(0, x.numel(), step):
                length = min(step, x.numel() - i)
                h = self._next_half()
                v[h, r, :length].copy_(x[i:i + length])              # my chunk into my region
                self._sync(first=i == 0)
                lo, hi = length * r // n, length * (r + 1) // n      # my 1/N slice: reduce it
                if hi > lo:
                    self._reduce([v[h, k, lo:hi] for k in range(n)], v[h, n, lo:hi], op)
                self._sync(first=False)
                x[i:i + length].copy_(v[h, n, :length])              # everyone's slices, reduced
        if copy_back:
            copy_back()

    def _all_gather(self, x: torch.Tensor, outs: list) -> None:
        """``outs``: N tensors of x's size (list form) or one of N times it (flat form)."""
        x = x.reshape(-1)
        n, r, v = self._size, self._rank, self._seg.views(x.dtype)
        flats = [_writable(o) for o in outs]
        rows = flats[0][0].view(n, -1) if len(outs) == 1 else [f for f, _ in flats]
        step = v.shape[2]
        for i in range(0, x.numel(), step):
            length = min(step, x.numel() - i)
            h = self._next_half()
            v[h, r, :length].copy_(x[i:i + length])
            self._sync(first=i == 0)
            if len(outs) == 1:
                rows[:, i:i + length].copy_(v[h, :n, :length])   # one strided copy for all N rows
            else:
                for k in range(n):
                    rows[k][i:i + length].copy_(v[h, k, :length])
        for _, copy_back in flats:
            if copy_back:
                copy_back()

    def _reduce_scatter(self, ins: list, out: torch.Tensor, op) -> None:
        """``ins``: N tensors of out's size (list form) or one of N times it (flat form)."""
        n, r, v = self._size, self._rank, self._seg.views(out.dtype)
        y, copy_back = _writable(out)
        rows = ins[0].reshape(n, -1) if len(ins) == 1 else [i.reshape(-1) for i in ins]
        step = max(1, v.shape[2] // n)    # my region holds N blocks of `step`, one per destination
        for i in range(0, y.numel(), step):
            length = min(step, y.numel() - i)
            h = self._next_half()
            mine = v[h, r, :n * length].view(n, length)
            if len(ins) == 1:
                mine.copy_(rows[:, i:i + length])
            else:
                for k in range(n):
                    mine[k].copy_(rows[k][i:i + length])
            self._sync(first=i == 0)
            self._reduce([v[h, k, r * length:(r + 1) * length] for k in range(n)], y[i:i + length], op)
        if copy_back:
            copy_back()

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        x, copy_back = _writable(t)
        v = self._seg.views(x.dtype)
        step = v.shape[1] * v.shape[2]    # the root fills a whole half
        for i in range(0, x.numel(), step):
            length = min(step, x.numel() - i)
            half = v[self._next_half()].view(-1)
            if self._rank == root:
                half[:length].copy_(x[i:i + length])
            self._sync(first=i == 0)
            if self._rank != root:
                x[i:i + length].copy_(half[:length])
        if copy_back and self._rank != root:
            copy_back()
