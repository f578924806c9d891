"""The one training step every notebook, test and benchmark shares, and its single-process twin.

``train_step`` never asks which strategy it runs: every wrapper has the same small interface
(``finish_gradient_synchronization()``), and the optimizer is whatever the caller built over
``model.parameters()`` (for FSDP: the local shards).

Equality with one process: rank r trains on its slice of the global batch with a *mean* loss.
Averaging the N ranks' gradients gives (1/N) sum_r mean_r = the mean over the whole batch,
which is exactly what one process computes on the whole batch.
"""
from __future__ import annotations

import torch

from ddpkit.models import build_model, loss_fn, make_batch, shard_batch
from ddpkit.strategies._common import NULL_RECORDER


def train_step(model, optimizer, inputs, targets, recorder=NULL_RECORDER):
    """Forward, backward, finish gradient sync, optimizer step; returns the local loss."""
    with recorder.span("forward", cat="compute"):
        loss = loss_fn(model(inputs), targets)
    with recorder.span("backward", cat="compute"):
        loss.backward()
    with recorder.span("sync", cat="compute"):
        model.finish_gradient_synchronization()  # a no-op where backward already finished it
    with recorder.span("step", cat="compute"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_optimizer(params, name: str = "sgd", lr: float | None = None):
    """SGD (lr 0.05, momentum 0.9) or AdamW (lr 1e-3): the two optimizers the tests use."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 1e-3)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def optimizer_class(name: str):
    """(class, defaults) for an optimizer name, e.g. to build a ShardedOptimizer."""
    if name == "sgd":
        return torch.optim.SGD, dict(lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=1e-3)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def local_batch(module, global_batch_size: int, step: int, rank: int, world_size: int, seed: int = 0):
    """This rank's slice of global batch ``step`` (``module`` is the unwrapped model)."""
    return shard_batch(make_batch(module, global_batch_size, step, seed), rank, world_size)


def train_single_process(model_name: str = "mlp", optimizer: str = "sgd", steps: int = 5,
                         global_batch_size: int = 16, seed: int = 0, **model_kwargs) -> dict:
    """Train on the whole batch in this process: the reference every strategy must equal.

    Returns ``{parameter name: tensor}`` after ``steps`` steps.
    """
    model = build_model(model_name, seed=seed, **model_kwargs)
    opt = make_optimizer(model.parameters(), optimizer)
    for step in range(steps):
        x, y = make_batch(model, global_batch_size, step, seed)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two {name: tensor} dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameter names: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------
# The strategy table: one name -> how to wrap a model and build its optimizer.
#
# Every entry is two lines: the wrapper, and the optimizer over what the wrapper exposes as
# parameters (for FSDP the local shards). Nothing else in a training loop depends on the name.
# ---------------------------------------------------------------------------------------------
STRATEGIES = ("naive", "bucketed", "overlapped", "zero1", "fsdp", "torch_ddp", "torch_fsdp")


def fsdp_units(module) -> list:
    """FSDP units for the course's models: one per Linear of the MLP, one per block of TinyGPT."""
    from ddpkit.models import MLP, TinyGPT

    if isinstance(module, MLP):
        return [block[0] for block in module.layers] + [module.head]
    if isinstance(module, TinyGPT):
        return list(module.blocks)  # the root keeps embeddings, final norm and the tied head
    return [m for m in module.children() if any(True for _ in m.parameters())]


def wrap(strategy: str, module, optimizer: str = "sgd", bucket_cap_mb: float = 25.0,
         recorder=NULL_RECORDER, process_group=None):
    """(wrapped model, optimizer) for ``strategy``; the model is moved to this rank's device first."""
    import ddpkit

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    module = module.to(ddpkit.device())
    common = dict(recorder=recorder, process_group=process_group)
    if strategy == "naive":
        model = ddpkit.NaiveDDP(module, **common)
    elif strategy == "bucketed":
        model = ddpkit.BucketedDDP(module, bucket_cap_mb=bucket_cap_mb, **common)
    elif strategy in ("overlapped", "zero1"):
        model = ddpkit.OverlappedDDP(module, bucket_cap_mb=bucket_cap_mb, **common)
    elif strategy == "fsdp":
        model = ddpkit.FSDP(module, units=fsdp_units(module), **common)
    elif strategy == "torch_ddp":
        from ddpkit.strategies.reference import TorchDDP

        model = TorchDDP(module, bucket_cap_mb=bucket_cap_mb, **common)
    else:  # torch_fsdp: fully_shard with the same units as our FSDP
        from ddpkit.strategies.reference import TorchFSDP

        model = TorchFSDP(module, units=fsdp_units(module), **common)

    if strategy == "zero1":  # ZeRO-1: gradients all-reduced as in DDP, optimizer state 1/N per rank
        cls, defaults = optimizer_class(optimizer)
        opt = ddpkit.ShardedOptimizer(model.parameters(), cls, **common, **defaults)
    else:
        opt = make_optimizer(model.parameters(), optimizer)
    return model, opt


# ---------------------------------------------------------------------------------------------
# What one recorded run measures, tallied as the strategy reports it.
# ---------------------------------------------------------------------------------------------
def _union(intervals):
    """Merge (start, end) intervals into disjoint sorted ones."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_fraction(comm, compute) -> float:
    """Share of communication time (union of comm intervals) that falls inside compute intervals."""
    comm, compute = _union(comm), _union(compute)
    total = sum(e - s for s, e in comm)
    if total <= 0:
        return 0.0
    hidden = 0.0
    for s, e in comm:
        for cs, ce in compute:
            hidden += max(0.0, min(e, ce) - max(s, cs))
    return hidden / total


class Tally:
    """A recorder that forwards the four seam calls and keeps the numbers ``compare`` reports.

    Kept here rather than read back from the full records, so these figures stay the same
    whatever the trace format does: per step, the collectives (name, full bytes S, launch and
    completion times) and the compute spans; the peak memory sample. ``inner`` (a
    ``ddpkit.trace.Recorder`` or the null recorder) gets every call unchanged.
    """

    enabled = True

    def __init__(self, inner=NULL_RECORDER):
        import time

        self._now = time.perf_counter
        self.inner = inner
        self.step = 0
        self.collectives: list[list] = []   # [step, name, nbytes, launch_s, done_s or None]
        self.compute: list[tuple] = []      # (step, name, start_s, end_s)
        self.last_grad_ready: dict = {}     # step -> time the last gradient became ready
        self.peak_memory = 0

    def span(self, name: str, cat: str = "compute", **fields):
        import contextlib

        inner_span = self.inner.span(name, cat=cat, **fields)

        @contextlib.contextmanager
        def timed():
            start = self._now()
            with inner_span:
                yield
            if cat == "compute":
                self.compute.append((self.step, name, start, self._now()))

        return timed()

    def collective(self, name: str, work, nbytes: int, **fields) -> None:
        self.inner.collective(name, work, nbytes, **fields)
        row = [self.step, name, int(nbytes), self._now(), None]
        self.collectives.append(row)
        if work is None:  # already completed synchronously
            row[4] = row[3]
            return
        # On gloo the future completes when gloo's thread finished the collective; on NCCL when
        # the work is done relative to the stream, so there this time is an upper bound on launch.
        work.get_future().add_done_callback(lambda _fut: row.__setitem__(4, self._now()))

    def grad_ready(self, param_name: str, **fields) -> None:
        self.inner.grad_ready(param_name, **fields)
        self.last_grad_ready[self.step] = self._now()

    def memory(self, **bytes_by_category: int) -> None:
        self.inner.memory(**bytes_by_category)
        self.peak_memory = max(self.peak_memory, sum(int(v) for v in bytes_by_category.values()))

    def next_step(self) -> None:
        self.step += 1
        if hasattr(self.inner, "next_step"):
            self.inner.next_step()

    def summary(self, world_size: int, skip_first: bool = True) -> dict:
        """Per-step averages over the steps recorded (the first one left out when there are more:
        it can include one-off work, e.g. torch DDP rebuilding its buckets)."""
        from ddpkit.costmodel import ring_bytes

        first = 1 if skip_first and self.step > 1 else 0
        steps = max(1, self.step - first)
        colls = [c for c in self.collectives if c[0] >= first]
        # Only backward can hide gradient communication; FSDP's forward all-gathers can also
        # hide under forward compute, so forward counts as well. "sync" and "step" are waits
        # or work that comes after the communication it would hide.
        # The backward span can end with waiting for the last buckets (a strategy that finishes
        # synchronisation when backward returns); where gradients report readiness, backward
        # compute ends when the last gradient became ready, so that wait does not count as hidden.
        compute = [(s, min(e, self.last_grad_ready.get(st, e)) if name == "backward" else e)
                   for st, name, s, e in self.compute
                   if st >= first and name in ("forward", "backward")]
        comm = [(c[3], c[4]) for c in colls if c[4] is not None]
        counts: dict = {}
        for c in colls:
            counts[c[1]] = counts.get(c[1], 0) + 1
        return dict(
            comm_bytes_per_step=sum(ring_bytes(c[1], c[2], world_size) for c in colls) / steps,
            collective_bytes_per_step=sum(c[2] for c in colls) / steps,
            collectives_per_step={k: v / steps for k, v in counts.items()},
            comm_ms_per_step=sum(e - s for s, e in _union(comm)) * 1e3 / steps,
            overlap_fraction=overlap_fraction(comm, compute),
        )


def state_bytes(model, optimizer) -> int:
    """Bytes of parameters + gradients + optimizer state this rank holds (its shards for FSDP)."""
    try:
        from ddpkit.memory import model_state_bytes
    except ImportError:  # the memory module is not there yet: count the tensors directly
        model_state_bytes = None
    if model_state_bytes is not None:
        out = model_state_bytes(model, optimizer)
        return int(sum(out.values()) if isinstance(out, dict) else out)
    total, seen = 0, set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


class _StepTimer:
    """Wall time of one step: CUDA events on GPU (host time lies there), perf_counter on CPU."""

    def __init__(self, device):
        import time

        self.cuda = device.type == "cuda"
        self._now = time.perf_counter
        self.times_ms: list[float] = []
        self._pending: list = []

    def start(self):
        if self.cuda:
            self._ev = torch.cuda.Event(enable_timing=True)
            self._ev.record()
        else:
            self._t = self._now()

    def stop(self):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._ev, end))  # resolved once, at the end: no sync per step
        else:
            self.times_ms.append((self._now() - self._t) * 1e3)

    def result(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            self.times_ms = [s.elapsed_time(e) for s, e in self._pending]
            self._pending = []
        return self.times_ms


def run_strategy(strategy: str, model: str = "mlp", steps: int = 10, global_batch_size: int = 32,
                 optimizer: str = "sgd", record: bool = False, bucket_cap_mb: float = 25.0,
                 warmup: int = 1, seed: int = 0, model_kwargs: dict | None = None,
                 reference: dict | None = None, return_records: bool = False,
                 report_progress: bool = True) -> dict:
    """A Cluster job: build, train ``warmup + steps`` steps, and report on this rank.

    Timing covers the ``steps`` steps after the warmup (which pays one-off costs: allocating
    buckets, torch DDP's bucket rebuild). With ``record=True`` a recorder is attached and
    bytes, overlap and memory are measured too — use a separate run for timing, recording
    costs a little. ``reference`` ({name: tensor} after warmup + steps single-process steps)
    adds ``max_param_diff``. Returns a plain dict (picklable, for ``Cluster.run``).
    """
    import torch.distributed as dist

    import ddpkit
    from ddpkit.models import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = ddpkit.device()
    module = build_model(model, seed=seed, **(model_kwargs or {}))
    recorder = NULL_RECORDER
    tally = None
    if record:
        from ddpkit.trace import Recorder

        tally = recorder = Tally(Recorder(rank=rank, world_size=world, device=str(dev)))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    wrapped, opt = wrap(strategy, module, optimizer, bucket_cap_mb, recorder)
    timer = _StepTimer(dev)
    losses = []
    total = warmup + steps
    for step in range(total):
        x, y = local_batch(module, global_batch_size, step, rank, world, seed)
        x, y = x.to(dev), y.to(dev)
        if step >= warmup:
            timer.start()
        loss = train_step(wrapped, opt, x, y, recorder)
        if step >= warmup:
            timer.stop()
        losses.append(loss)
        if tally is not None and step < total - 1:
            tally.next_step()
        if report_progress:
            ddpkit.progress(step + 1, total)
    times = timer.result()
    out = dict(strategy=strategy, rank=rank, world_size=world, model=model, steps=steps,
               step_ms=times, ms_per_step=float(torch.tensor(times).median()) if times else 0.0,
               losses=[float(l) for l in losses])
    if record:
        out.update(tally.summary(world))
        # Model state is measured with gradients present, as in the middle of a step (train_step
        # ends by setting them to None): one more forward/backward/sync, no optimizer step.
        x, y = local_batch(module, global_batch_size, total, rank, world, seed)
        loss_fn(wrapped(x.to(dev)), y.to(dev)).backward()
        wrapped.finish_gradient_synchronization()
        out["model_state_bytes"] = state_bytes(wrapped, opt)
        out["comm_buffer_bytes"] = int(wrapped.comm_buffer_bytes())
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
        else:  # CPU: the largest memory sample the strategy reported, at least the model state
            out["peak_bytes"] = max(tally.peak_memory, out["model_state_bytes"] + out["comm_buffer_bytes"])
        if return_records:
            out["records"] = tally.inner.records
    if reference is not None:
        full = {k: v.detach().cpu() for k, v in wrapped.full_state_dict().items()}
        if reference.keys() < full.keys():  # a tied parameter listed under both its names:
            full = {k: full[k] for k in reference}  # compare the names named_parameters() gives
        out["max_param_diff"] = max_abs_diff(full, reference)
    return out
