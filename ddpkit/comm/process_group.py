"""ddpkit's process group: the real one underneath, every collective counted, recorded and timed.

A Cluster's ranks join ``torch.distributed`` with backend ``"ddpkit"`` (``install``): a Python
``ProcessGroup`` that hands each collective to the real backend (gloo, NCCL) and, on the way, for
*every* caller (our strategies, torch's DDP through its C++ reducer, ``fully_shard``,
``ZeroRedundancyOptimizer``):

1. counts it: the bytes one rank sends by the ring algorithm (``network.ring_bytes``), per kind and
   link, in ``Comm.counts`` (``rank_comm``);
2. records it, the one writer of a collective's record, a span from issue to completion carrying
   the labels the strategy set (``with recorder.labels(bucket=i): dist.all_reduce(...)``);
3. on an emulated network, returns a ``Work`` that completes when the link would have delivered it
   (``Network.route``: which link, how long, whether ``at_wait``; ``comm.emulator``);
4. keeps it, before launching it, in the rank's flight ring (``comm.flight``), which
   ``comm.desync`` reads when ranks' sequences part.

Methods that are not collectives (send, recv, ...) pass through uncounted. gloo's flat
reduce-scatter is an all-reduce keeping one chunk (``_reduce_scatter_by_all_reduce``): ``bytes``
counts what the algorithm sends, ``transport_bytes`` what the backend moved.
"""
from __future__ import annotations

import itertools
import time

import torch.distributed as dist

from ddpkit.comm.emulator import EmulatedWork
from ddpkit.comm.rank_comm import Comm
from ddpkit.network import Network, Route, ring_bytes
from ddpkit import rankside
from ddpkit.trace import seam
from ddpkit.torch_internals import (AllgatherOptions, backend_registered, hold_for_torch, register_real_backend,
                                    work_from_future)

BACKEND_NAME = "ddpkit"


def _finished(value):
    import torch

    future = torch.futures.Future()
    future.set_result(value)
    return future


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(tensors):
    """The dtype of a collective's tensors (a list, or all-gather's list of lists); None: none."""
    while isinstance(tensors, (list, tuple)):
        if not tensors:
            return None
        tensors = tensors[0]
    return tensors.dtype


class DdpkitProcessGroup(dist.ProcessGroup):
    """A process group over the real one: each collective counted, recorded, maybe delayed."""

    def __init__(self, comm: Comm, real, rank: int, size: int, global_ranks: list[int]):
        super().__init__(rank, size)
        self.comm, self.real = comm, real
        self.global_ranks = global_ranks
        self._group = tuple(global_ranks)  # names the group in records (same_collectives matches on it)
        self._id = comm.flight.new_group(global_ranks)  # groups are made in the same order on every rank
        self._index = itertools.count(1)   # this group's sequence: 1 for its first collective
        self._route = (None, None)          # (network, this group's Route on it): see _route_on
        # torch holds the real backend itself (a staging wrapper is Python only: what it wraps);
        # ranks on a GPU over gloo's family register it for CUDA tensors too, as torch does for gloo
        register_real_backend(self, getattr(real, "inner", real), comm.real_backend,
                              cuda=rankside.device().type == "cuda")

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    # --- the one path every collective takes ---------------------------------------------
    def _issue(self, op: str, full_bytes: int, launch, result, moved_as: str | None = None):
        """Launch on the real backend, count, record, emulate (``full_bytes``: the full size S)."""
        comm = self.comm
        n = self.size()
        route = self._route_on(comm.network)
        link_s = route.time(op, full_bytes)
        delayed = comm.emulator.delays(link_s)
        rec, labels = seam.recorder(), seam.labelled()
        recorders = [r for r in (rec if rec.enabled else None,
                                 labels.recorder if labels is not None and labels.recorder is not rec else None) if r]
        # into the flight recorder first: a rank that dies inside the launch (gloo aborts on a
        # size mismatch) keeps it in its record
        pending = comm.flight.issue(self._id, next(self._index), op, full_bytes, _dtype(result), labels)
        # the start is marked *before* the launch: a synchronous NCCL op runs on the current
        # stream, so a start event recorded after launch() would fire after the collective
        marks = [r.launch_mark() for r in recorders]
        issued = time.perf_counter()  # the link starts on it now, as the launch starts moving bytes
        at_wait = delayed and route.at_wait  # the emulated network card (comm.emulator)
        work = launch(at_wait=True) if at_wait else launch()
        comm.count(op, route.kind, ring_bytes(op, full_bytes, n), ring_bytes(moved_as or op, full_bytes, n))
        if delayed:
            work = comm.emulator.submit(route.kind, work, link_s, result, issued, at_wait)
        comm.flight.launched(pending, work)  # the watchdog watches the Work the caller waits on
        if recorders:
            self._record(op, work, full_bytes, route.kind, recorders, marks, labels)
        return hold_for_torch(work)  # torch 2.6 let C++ keep only its half of a Python Work

    def _route_on(self, network) -> Route:
        """This group's ``Route`` on ``network``, worked out once per network, not per collective."""
        if self._route[0] is not network:
            self._route = (network, network.route(self.global_ranks, self.comm.real_backend))
        return self._route[1]

    def _record(self, op: str, work, full_bytes: int, link: str, recorders, marks, labels) -> None:
        """The collective's one record: in the rank's recorder, and in the labelling strategy's when
        that is another one (a job's own ``recorder=``)."""
        fields = dict(labels.fields) if labels is not None else {}
        fields.update(link=link, group_size=self.size(), group=self._group)
        watched = work.observed() if isinstance(work, EmulatedWork) else work  # see EmulatedWork.observed
        for r, mark in zip(recorders, marks, strict=True):
            r.collective(op, watched, full_bytes, **fields, **({} if mark is None else {"launched": mark}))

    def _on_real(self, method: str, *args):
        """A launch for ``_issue``: the real backend's ``method(*args)``, passing ``at_wait`` on."""
        return lambda **at_wait: getattr(self.real, method)(*args, **at_wait)

    # --- collectives: the names torch.distributed calls on a group ------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._issue("all_reduce", _nbytes(tensors), self._on_real("allreduce", tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._issue("all_reduce", _nbytes(tensors), self._on_real("allreduce_coalesced", tensors, opts), tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._issue("broadcast", _nbytes(tensors), self._on_real("broadcast", tensors, opts), tensors)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        return self._issue("all_gather", _nbytes(inputs) * self.size(),
                           self._on_real("allgather", output_lists, inputs, opts), output_lists)

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        return self._issue("all_gather", _nbytes([output]), self._on_real("_allgather_base", output, input, opts),
                           [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        return self._issue("all_gather", _nbytes(outputs),
                           lambda **_: self._one_by_one(self.real._allgather_base, outputs, inputs, opts), outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue("reduce_scatter", _nbytes(outputs) * self.size(),
                           self._on_real("reduce_scatter", outputs, input_lists, opts), outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if self.comm.real_backend == "gloo":  # see the docstring, and _reduce_scatter_by_all_reduce
            return self._issue("reduce_scatter", _nbytes([input]),
                               lambda **_: self._reduce_scatter_by_all_reduce(output, input, opts), [output],
                               "all_reduce")
        return self._issue("reduce_scatter", _nbytes([input]),
                           self._on_real("_reduce_scatter_base", output, input, opts), [output])

    def _reduce_scatter_by_all_reduce(self, output, input, opts):
        """gloo's flat reduce-scatter: all-reduce a copy, copy our chunk out once (gloo's own copies it
        on every ``wait()``, overwriting what the caller did since)."""
        flat = input.detach().reshape(-1).clone()
        options = dist.AllreduceOptions()
        options.reduceOp = opts.reduceOp
        options.timeout = opts.timeout
        work = self.real.allreduce([flat], options)
        n = output.numel()
        mine = flat[self.rank() * n:(self.rank() + 1) * n]

        def copy_out(_):
            output.view(-1).copy_(mine)
            return [output]

        return work_from_future(work.get_future().then(copy_out))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        gloo = self.comm.real_backend == "gloo"
        one = self._reduce_scatter_by_all_reduce if gloo else self.real._reduce_scatter_base
        return self._issue("reduce_scatter", _nbytes(inputs),
                           lambda **_: self._one_by_one(one, outputs, inputs, opts), outputs,
                           "all_reduce" if gloo else None)

    @staticmethod
    def _one_by_one(op, outputs, inputs, opts):
        """A coalesced collective the real binding lacks (gloo; DTensor asks), tensor by tensor; finished."""
        for out, inp in zip(outputs, inputs, strict=True):
            op(out, inp, opts).wait()
        return work_from_future(_finished(outputs))

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        if self.comm.real_backend == "nccl" and not opts.device_ids:  # else NCCL guesses a GPU, and warns
            opts.device_ids = [rankside.device().index]
        return self._issue("barrier", 0, self._on_real("barrier", opts), [])


def _passed_through(name: str):
    """A method that hands the call to the real backend as it is (not counted, not emulated)."""
    def method(self, *args):
        return getattr(self.real, name)(*args)
    method.__name__ = method.__qualname__ = name
    return method


# What no strategy here issues passes through, uncounted: point-to-point, rooted collectives.
for _name in ("reduce", "gather", "scatter", "alltoall", "alltoall_base", "send", "recv", "recv_anysource",
              "monitored_barrier"):
    setattr(DdpkitProcessGroup, _name, _passed_through(_name))


def install(network, real_backend: str, shm_prefix: str | None = None) -> None:
    """Register backend ``"ddpkit"`` (once, before ``init_process_group``): groups wrap ``real_backend``
    ("shm" under ``shm_prefix``, "cuda-ipc", gloo, NCCL) and emulate ``network``."""
    network = Network.from_dict(network) if isinstance(network, dict) else Network.of(network)
    rankside.attach_comm(Comm(network, real_backend))

    def create(opts, _backend_options):
        # one call per group: its store, its rank and size, and the global ranks it spans
        real = build_real_backend(real_backend, opts, shm_prefix)
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        return DdpkitProcessGroup(rankside.comm(), real, opts.group_rank, opts.group_size, ranks)

    if not backend_registered(BACKEND_NAME):  # torch keeps its backend plugins per process
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])


def build_real_backend(name: str, opts, shm_prefix: str | None = None):
    """The real process group under one of ddpkit's (``name``: the Cluster's transport)."""
    if name == "nccl":
        # as torch builds its NCCL groups: the Cluster's timeout (not NCCL's 10 minutes), the group's
        # name and global ranks (NCCL's logs and the desync report name a group by them)
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = opts.timeout
        options.group_name = opts.group_id
        options.global_ranks_in_group = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        return dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, options)
    from ddpkit.comm.transport import POINT_TO_POINT, STAGED, HostStaged, ShmBackend

    dev = rankside.device()
    if name in ("shm", "cuda-ipc"):  # a gloo group whose collectives move their bytes through a slab
        real = ShmBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout, prefix=shm_prefix,
                          device=dev if name == "cuda-ipc" else None)  # the slab in GPU memory, or the host's
    else:
        real = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    if dev.type != "cuda":
        return real
    # ranks sharing a GPU: gloo takes CUDA tensors in collectives but not in send/recv, and the host
    # slab takes none: what the transport cannot take is staged through pinned host memory
    return HostStaged(real, methods=STAGED if name == "shm" else POINT_TO_POINT)


__all__ = ["BACKEND_NAME", "DdpkitProcessGroup", "build_real_backend", "install"]
