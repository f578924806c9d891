"""The harness: build a strategy by name, run it, time it, and read back what it recorded.

``wrap`` (a name -> wrapper + optimizer), the single-process twin every strategy must equal
(``train_single_process``, ``max_abs_diff``), and ``run_strategy``, the Cluster job behind
``compare`` and ``trace``: build, train with ``ddpkit.step.train_batch``, time, optionally record,
and return a ``ddpkit.run_result.RunResult``.
"""
from __future__ import annotations

import torch

from ddpkit.models import make_batch
from ddpkit.run_result import RecordSummary, RunResult
from ddpkit.step import train_batch, train_step  # noqa: F401 - the step lives in step.py; notebooks import it here
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.trace.seam import recorder as rank_recorder
from ddpkit.workload import resolve, shard_batch


def optimizer_class(name: str):
    """(class, defaults) for an optimizer name: SGD (lr 0.05, momentum 0.9) or AdamW (lr 1e-3)."""
    if name == "sgd":
        return torch.optim.SGD, dict(lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=1e-3)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def make_optimizer(params, name: str = "sgd"):
    """A plain torch optimizer over ``params`` (see ``optimizer_class``)."""
    cls, defaults = optimizer_class(name)
    return cls(params, **defaults)


def local_batch(module, global_batch_size: int, step: int, rank: int, world_size: int, seed: int = 0):
    """This rank's slice of the course's global batch ``step`` (``module``: the unwrapped model)."""
    return shard_batch(make_batch(module, global_batch_size, step, seed), rank, world_size)


def train_single_process(workload="mlp", optimizer: str = "sgd", steps: int = 5, global_batch_size: int = 16,
                         seed: int = 0, max_norm: float | None = None, **model_kwargs) -> dict:
    """Train on the whole batch in this process: the reference every strategy must equal.
    Returns ``{parameter name: tensor}`` after ``steps`` steps (clipped to ``max_norm`` if given)."""
    wl = resolve(workload, model_kwargs=model_kwargs, seed=seed)
    model = wl.build(seed)
    opt = make_optimizer(model.parameters(), optimizer)
    for step in range(steps):
        wl.compute_loss(model, wl.global_batch(step, global_batch_size)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two {name: tensor} dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameter names: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def wrap(strategy: str, module, optimizer: str = "sgd", bucket_cap_mb: float | None = None,
         recorder=None, process_group=None, options: dict | None = None):
    """(wrapped model, optimizer) for ``strategy``, as the table of strategies builds them, on this
    rank's device; ``options``: more keywords for the wrapper (e.g. FSDP's ``forward_prefetch=True``)."""
    from ddpkit.rankside import device

    row = strategy_row(strategy)
    cls, defaults = optimizer_class(optimizer)
    common = dict(recorder=recorder, process_group=process_group)
    model = row.wrap(module.to(device()), bucket_cap_mb=bucket_cap_mb, **common, **(options or {}))
    return model, row.optimizer(model, cls, defaults, **common)


def summarize_records(records, world_size: int, steps: list[int]) -> RecordSummary:
    """Per-step averages over ``steps`` of one rank's records (``ddpkit.trace``'s definitions)."""
    from ddpkit import trace as tr

    t = tr.Trace(list(records), world_size)
    rank = t.ranks[0] if t.ranks else 0
    per_bytes = tr.comm_bytes_per_step(t)  # over each collective's own group (hybrid sharding)
    inter_node = tr.comm_bytes_per_step(t, link="inter-node")
    per_count = tr.collective_counts(t)
    counts: dict = {}
    comm_ns = hidden_ns = 0
    for s in steps:
        for name, c in per_count.get(s, {}).get(rank, {}).items():
            counts[name] = counts.get(name, 0) + c / len(steps)
        comm, _, both = tr.overlap_intervals(t.records, rank, s)
        comm_ns += sum(b - a for a, b in comm)
        hidden_ns += sum(b - a for a, b in both)
    peak_sample = max((sum(v for k, v in r.args.items() if not k.startswith("cuda"))
                       for r in t.records if r.kind == "counter" and r.cat == "memory"), default=0)
    return RecordSummary(
        comm_bytes_per_step=sum(per_bytes.get(s, {}).get(rank, 0.0) for s in steps) / len(steps),
        inter_node_bytes_per_step=sum(inter_node.get(s, {}).get(rank, 0.0) for s in steps) / len(steps),
        collectives_per_step=counts,
        comm_ms_per_step=comm_ns / 1e6 / len(steps),
        overlap_fraction=hidden_ns / comm_ns if comm_ns else 0.0,
        peak_memory_sample=peak_sample,
    )


DROPOUT_NOTE = "dropout is on: masks differ from one process by design; set dropout to 0 to compare"
_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def active_dropout(module) -> list[str]:
    """Where ``module`` drops out in training, as ``"name (p=0.1)"``: dropout layers with p > 0 and
    float ``*dropout*`` attributes > 0 (Hugging Face's ``attention_dropout``); see ``DROPOUT_NOTE``."""
    found = []
    for name, m in module.named_modules():
        if not m.training:
            continue
        if isinstance(m, _DROPOUT_MODULES):
            if m.p > 0:
                found.append(f"{name or type(m).__name__} (p={m.p:g})")
            continue
        found += [f"{name + '.' if name else ''}{attr} (p={value:g})" for attr, value in vars(m).items()
                  if "dropout" in attr and isinstance(value, float) and value > 0]
    return found


def _diff_to(reference: dict, wrapped) -> float:
    """Largest |difference| between the wrapper's full parameters and ``reference``."""
    return max_abs_diff({k: v.detach().cpu() for k, v in wrapped.full_state_dict().items()}, reference)


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


def run_strategy(strategy: str, workload=None, steps: int = 10, global_batch_size: int = 32,
                 optimizer: str = "sgd", record: bool = False, bucket_cap_mb: float | None = None,
                 warmup: int = 1, seed: int = 0, model_kwargs: dict | None = None,
                 reference: dict | None = None, return_records: bool = False,
                 report_progress: bool = True, options: dict | None = None,
                 max_norm: float | None = None) -> RunResult:
    """A Cluster job: build ``workload``'s model, train ``warmup + steps`` steps, report on this rank.

    ``workload``: a ``ddpkit.Workload``, a built-in's name (sized by ``model_kwargs``) or
    ``"package.module:function"``; default the MLP. Timing covers the steps after the warmup.
    ``record=True`` also measures bytes, overlap and memory (time in a separate run).
    ``reference`` ({name: tensor} single-process) adds ``max_param_diff`` and ``dropout``.
    ``options``: more keywords for the wrapper (``wrap``); ``max_norm``: clip gradients every step.
    """
    import torch.distributed as dist

    from ddpkit.rankside import device
    from ddpkit.trace.seam import recording

    for name, value, least, what in (("steps", steps, 1, "the timed steps, after the warmup"),
                                     ("warmup", warmup, 0, "untimed steps first")):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"run_strategy: {name} must be a whole number >= {least} ({what}), got {value!r}")
    wl = resolve(workload, model_kwargs=model_kwargs, seed=seed)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    module = wl.build(seed)
    dropout = active_dropout(module) if reference is not None else []  # before the wrapper moves it
    recorder = _run_recorder(record, rank, world, dev)
    with recording(recorder):
        wrapped, opt = wrap(strategy, module, optimizer, bucket_cap_mb, recorder, options=options)
        result, gpu_peak = _train_and_time(strategy, wrapped, opt, wl, recorder, record, steps, warmup,
                                           global_batch_size, max_norm, report_progress, dev)
        if record:
            # averages over the timed steps; what follows is put in a step of its own, not counted
            summary = summarize_records(recorder.records, world, list(range(warmup, warmup + steps)))
            for k, v in vars(summary).items():
                if k != "peak_memory_sample":  # goes to _measure_memory
                    setattr(result, k, v)
            recorder.next_step()
        if reference is not None:
            result.max_param_diff, result.dropout = _diff_to(reference, wrapped), dropout
        if record:
            batch = wl.local_batch(warmup + steps, global_batch_size, rank, world, dev)
            _measure_memory(result, wrapped, opt, batch, wl.compute_loss, recorder, gpu_peak,
                            summary.peak_memory_sample)
            if return_records:
                result.records = recorder.records
    return result


def _run_recorder(record: bool, rank: int, world: int, dev):
    """The run's recorder: one of its own when it records, else the rank's."""
    if not record:
        return rank_recorder()
    from ddpkit.trace import Recorder

    recorder = Recorder(rank=rank, world_size=world, device=str(dev))
    recorder.align_clocks()  # so the ranks' records share rank 0's clock in a trace
    return recorder


def _train_and_time(strategy, wrapped, opt, wl, recorder, record, steps, warmup, global_batch_size, max_norm,
                    report_progress, dev) -> tuple[RunResult, int | None]:
    """Train, timing the steps after the warmup; (the result so far, the GPU peak over those steps)."""
    import torch.distributed as dist

    from ddpkit import rankside
    from ddpkit.cluster.worker import progress

    comm = rankside.comm()  # what this rank's emulated links did
    rank, world = dist.get_rank(), dist.get_world_size()
    timer = _StepTimer(dev)
    losses = []
    total = warmup + steps
    for step in range(total):
        if record:
            recorder.next_step()  # records carry the step index (construction is "setup")
        batch = wl.local_batch(step, global_batch_size, rank, world, dev)
        if step == warmup and dev.type == "cuda":  # the peak of the timed steps only
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        if step == warmup:
            emulated_before, transport_before = comm.emulation_counts(), comm.transport_seconds()
        if step >= warmup:
            timer.start()
        loss = train_batch(wrapped, opt, batch, wl.compute_loss, recorder, max_norm)
        if step >= warmup:
            timer.stop()
        losses.append(loss)
        if report_progress:
            progress(step + 1, total)
    times = timer.result()
    emulated = [b - a for a, b in zip(emulated_before, comm.emulation_counts(), strict=True)]
    # read now, before the comparison's gather and the memory pass allocate more than a step
    gpu_peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
    result = RunResult(
        strategy, rank, world, wl.name, steps, step_ms=times,
        ms_per_step=float(torch.tensor(times).median()),
        losses=[float(loss) for loss in losses], emulated_collectives=emulated[0], outran_link=emulated[1],
        transport_ms_per_step=1e3 * (comm.transport_seconds() - transport_before) / steps)
    return result, gpu_peak


def _measure_memory(result: RunResult, wrapped, opt, batch, loss, recorder, gpu_peak: int | None,
                    peak_sample: int) -> None:
    """Memory, measured in one more forward/backward/sync with the gradients present (no step)."""
    from ddpkit.memory import MODEL_STATES, measure_step

    sample = measure_step(wrapped, opt, batch, loss, recorder)
    opt.zero_grad(set_to_none=True)
    result.memory = sample
    result.model_state_bytes = sum(sample[c] for c in MODEL_STATES)
    # GPU: the allocator's peak over the timed steps; CPU: one step's sample, or a strategy's largest
    result.peak_bytes = gpu_peak if gpu_peak is not None else max(
        sum(v for k, v in sample.items() if not k.startswith("cuda")), peak_sample)
