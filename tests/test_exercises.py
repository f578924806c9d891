"""The grader: checks the course's exercises by what they do, on real ranks.

    DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py                     # your exercises/
    DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py -k average_gradients  # one of them
    python -m pytest tests/test_exercises.py                                             # the reference solutions

``DDPKIT_TARGET`` names the package to grade (``solutions``, the default, or ``exercises``); it
is the grader's only knob and is read here, in the test file, never inside ddpkit.

Every test here checks the learner's work and nothing else (the grader's own tests are in
``tests/test_grader.py``), so the counts pytest prints are the learner's progress. An exercise
that is still a stub (its body only ``raise NotImplementedError``) is *skipped*, with the reason
"not written yet: exercises/<topic>.py: <name> raises NotImplementedError", so CI stays green on
the untouched exercises; ``tests/conftest.py`` prints a summary per exercise at the end (right /
wrong / not written yet) that a learner sees without ``-rs``. A wrong answer fails with a message
alone, not the grader's code, and where the answer equals a known wrong variant (summed but not
divided, divided twice, buckets in registration order, shards not padded, ...) the message says
which mistake that is. Checks are by behaviour: against torch's own collectives, against one
process training on the whole batch, or against properties the docstring states. Multi-rank
checks run on the shared gloo clusters of ``tests/conftest.py`` at 2 and 3 ranks.

Target functions are pickled *by value* for the ranks (cloudpickle), so the ranks run the file
as it is now, even on a cluster that imported an older copy.
"""
from __future__ import annotations

import importlib
import math
import os
import random
import re
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import ddpkit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import exercises  # noqa: E402  (needs ROOT on sys.path)

TARGET = os.environ.get("DDPKIT_TARGET", "solutions")
if TARGET not in ("solutions", "exercises"):
    raise ValueError(f"DDPKIT_TARGET must be 'solutions' or 'exercises', got {TARGET!r}")

# Jobs below are module-level functions of this file: ship them by value, since the ranks may
# not have tests/ on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def exercise(request):
    """``exercise(topic, name)`` -> the function under test; a stub skips as "not written yet".

    Each call also tags the test with the exercise it grades (a pytest user property), which
    ``tests/conftest.py`` reads for the summary at the end of the run.
    """
    def get(topic: str, name: str):
        request.node.user_properties.append(("ddpkit_exercise", (TARGET, f"{topic}.{name}")))
        module = importlib.import_module(f"{TARGET}.{topic}")
        cloudpickle.register_pickle_by_value(module)
        fn = getattr(module, name)
        if exercises.is_stub(fn):
            pytest.skip(f"not written yet: {TARGET}/{topic}.py: {name} raises NotImplementedError")
        return fn
    return get


def wrong(message: str):
    """Fail with ``message`` alone: the learner reads what is wrong, not the grader's code."""
    pytest.fail(message, pytrace=False)


def check(ok: bool, message: str) -> None:
    if not ok:
        wrong(message)


def report(title: str, problems: list[str]) -> None:
    """Fail with ``title``, the first few problems and each distinct hint once; pass if none.

    A problem is one line, optionally followed by "\\n  hint: ..." lines.
    """
    if not problems:
        return
    mains = [p.split("\n  hint: ")[0] for p in problems]
    hints = dict.fromkeys(h for p in problems for h in p.split("\n  hint: ")[1:])
    lines = [title, *(f"  {m}" for m in mains[:3])]
    if len(mains) > 3:
        lines.append(f"  ... and {len(mains) - 3} more")
    wrong("\n".join(lines + [f"  hint: {h}" for h in hints]))


def call(fn, *args, **kwargs):
    """Call a target function in this process; NotImplementedError -> not written yet."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        pytest.skip(f"not written yet: {TARGET}/{fn.__module__.split('.')[-1]}.py: {fn.__name__} "
                    f"raises NotImplementedError")


def on_ranks(cluster, job, *args, hints: dict[str, str] | None = None):
    """``cluster.run(job, *args)``; NotImplementedError on the ranks -> not written yet; any
    other error -> a failure with its last line, a hint where ``hints`` (text in the error ->
    hint) has one, and the ranks' tracebacks (through the learner's code)."""
    try:
        return cluster.run(job, *args)
    except ddpkit.RankError as exc:
        error = exc
    first = error.failures[error.ranks[0]]
    if all("NotImplementedError" in tb for tb in error.failures.values()):
        frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', first)
        where = f"{os.path.relpath(frames[-1][0], ROOT)}: {frames[-1][1]}" if frames else job.__name__
        pytest.skip(f"not written yet: {where} raises NotImplementedError")
    last = first.strip().splitlines()[-1]
    hint = next((f"\n  hint: {h}" for text, h in (hints or {}).items() if text in first), "")
    alike = len(set(error.failures.values())) == 1
    tracebacks = (f"rank {error.ranks[0]}'s traceback (the other ranks' are the same):\n{first.rstrip()}"
                  if alike else str(error))
    wrong(f"an error on rank{'s' if len(error.ranks) > 1 else ''} {', '.join(map(str, error.ranks))}: "
          f"{last}{hint}\n{tracebacks}")


# ----------------------------------------------------------------------------- hints
# A wrong answer is compared with the answers that known mistakes give; the first one it equals
# names the mistake. Each "variant" is (what the mistake would give, the hint).
def same(got, want, atol: float = 1e-6) -> bool:
    return (torch.is_tensor(got) and torch.is_tensor(want) and got.shape == want.shape
            and torch.allclose(got.to(want.dtype), want, atol=atol))


def mean_mistakes(mean, n: int, local=None) -> list:
    """What an average over ``n`` ranks gives when done wrong, with the hint for each."""
    variants = [
        (mean * n, f"the result is {n} times the expected (world size {n}): did you sum without "
                   f"dividing by the world size?"),
        (mean / n, f"the result is 1/{n} of the expected: did you divide twice (ReduceOp.AVG "
                   f"already divides by the world size)?"),
    ]
    if local is not None:
        variants += [
            (local, "the result is this rank's own value, unchanged: it was never averaged. Was it "
                    "skipped (only a .grad that is None should be), or did the all-reduce run on a "
                    "copy whose result was never written back (x / n makes a new tensor; x.div_(n) "
                    "divides in place)?"),
            (local / n, "the result is this rank's own value divided by the world size: divided, but "
                        "never all-reduced (the all-reduce ran on a copy, or not at all)"),
        ]
    return variants


def tensor_problem(got, want, variants=()) -> str:
    """'' if ``got`` equals ``want``, else what is wrong with it and, if known, a hint why."""
    if not torch.is_tensor(got):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if same(got, want):
        return ""
    hint = next((h for value, h in variants if same(got, value)), "")
    err = f"max |error| {(got.to(want.dtype) - want).abs().max().item():.3g}"
    return f"{err}\n  hint: {hint}" if hint else err


# Every collective torch.distributed offers (point-to-point send/recv/isend/irecv are not here).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "broadcast", "broadcast_object_list", "reduce", "all_to_all", "all_to_all_single",
               "gather", "gather_object", "scatter", "scatter_object_list")


class _PatchedCollectives:
    """Inside a rank: replace every collective in ``torch.distributed`` while the block runs.

    ``forbid=True`` makes each one raise (to prove an exercise uses only sends and receives);
    otherwise each call is counted in ``.calls`` and passed through.
    """

    def __init__(self, forbid: bool):
        self.forbid = forbid
        self.calls: dict[str, int] = {}

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for n, f in self.saved.items():
            def patched(*a, _n=n, _f=f, **k):
                if self.forbid:
                    raise AssertionError(f"this exercise must use only point-to-point sends and "
                                         f"receives, not dist.{_n}")
                self.calls[_n] = self.calls.get(_n, 0) + 1
                return _f(*a, **k)
            setattr(dist, n, patched)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def NoCollectives():
    return _PatchedCollectives(forbid=True)


def CountCollectives():
    return _PatchedCollectives(forbid=False)


# ----------------------------------------------------------------------------- collectives
def _job_ring(fn, lengths):
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = []
    for length in lengths:
        x = torch.randn(length, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * rank + length))
        expected = x.clone()
        dist.all_reduce(expected)
        got = x.clone()
        with NoCollectives():
            out = fn(got)
        if out is not None and out.data_ptr() != got.data_ptr():
            errors.append(f"length {length}: must work in place and return the tensor it was given")
        problem = tensor_problem(got, expected, [
            (x, "the tensor is unchanged: write the result into the tensor you were given (in place)"),
            (expected / n, "the result is the mean, not the sum: this all-reduce sums (no division)"),
        ])
        if problem:
            errors.append(f"rank {rank}, length {length}: {problem}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_ring_all_reduce_equals_all_reduce(exercise, cluster_of, world):
    fn = exercise("collectives", "ring_all_reduce")
    # 1 and 2 are shorter than 3 ranks (empty chunks); 7 does not split evenly; 1000 is larger
    errors = [e for r in on_ranks(cluster_of(world), _job_ring, fn, [1, 2, 7, 1000]) for e in r]
    report(f"ring_all_reduce on {world} ranks differs from dist.all_reduce:", errors)


# ----------------------------------------------------------------------------- averaging
def _small_mlp():
    from ddpkit.models import build_model

    model = build_model("mlp", seed=3, width=12, depth=3)
    model.layers[0][0].weight.requires_grad_(False)  # a frozen parameter: never reduced
    return model


def _whole_batch_grads():
    from ddpkit.models import loss_fn, make_batch

    model = _small_mlp()
    x, y = make_batch(model, 12, step=0, seed=5)
    loss_fn(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _job_average(fn):
    from ddpkit.experiment import local_batch
    from ddpkit.models import loss_fn

    rank, n = dist.get_rank(), dist.get_world_size()
    model = _small_mlp()
    x, y = local_batch(model, 12, 0, rank, n, seed=5)
    loss_fn(model(x), y).backward()
    local = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    fn(model)
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, local


@pytest.mark.parametrize("world", [2, 3])
def test_average_gradients_equals_one_process(exercise, cluster_of, world):
    fn = exercise("averaging", "average_gradients")
    reference = _whole_batch_grads()
    problems = []
    hints = {"'NoneType' object has no attribute": "a frozen parameter (requires_grad=False) has .grad None: "
                                                    "skip parameters whose .grad is None"}
    for rank, (grads, local) in enumerate(on_ranks(cluster_of(world), _job_average, fn, hints=hints)):
        for name in sorted(grads.keys() - reference.keys()):
            problems.append(f"rank {rank}: {name} is frozen (requires_grad=False), its .grad must stay None"
                            f"\n  hint: skip parameters whose .grad is None")
        for name in reference:
            if name not in grads:
                problems.append(f"rank {rank}: {name}.grad is None after average_gradients")
                continue
            problem = tensor_problem(grads[name], reference[name], mean_mistakes(reference[name], world, local[name]))
            if problem:
                problems.append(f"rank {rank}, {name}.grad: {problem}")
        left_out = [name for name in reference if name in grads and not same(grads[name], reference[name])
                    and same(grads[name], local[name])]
        if left_out and len(left_out) < len(reference):   # some averaged, these not: skipped by a condition
            problems.insert(0, f"rank {rank}: averaged some gradients but not {', '.join(left_out)}: they kept this "
                            f"rank's own values\n  hint: does a condition in your loop skip them? Skip only "
                            f"parameters whose .grad is None")
    report(f"average_gradients on {world} ranks: the gradients are not one process's gradients on the whole "
           f"batch:", problems)


# ----------------------------------------------------------------------------- buckets
def _buckets_like(sizes, cap, reverse=True, strict=False, crossing_opens_next=False):
    """assign_buckets done right (the defaults) or with one of the usual mistakes."""
    buckets, current, filled = [], [], 0
    for i in (reversed(range(len(sizes))) if reverse else range(len(sizes))):
        if crossing_opens_next and current and filled + sizes[i] > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
        if (filled > cap) if strict else (filled >= cap):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


BUCKET_MISTAKES = [
    (dict(reverse=False), "the buckets follow registration order: walk the parameters from the last to the "
                          "first (backward produces the last layers' gradients first)"),
    (dict(strict=True), "a bucket closes as soon as it holds >= cap_bytes (it reaches the cap), not only "
                        "once it exceeds the cap"),
    (dict(crossing_opens_next=True), "the tensor that crosses the cap stays in its bucket: add it first, then "
                                     "close the bucket (buckets may go over the cap)"),
]


def _assign_problem(sizes, cap, got) -> str:
    """'' if ``got`` is the right assignment of ``sizes`` under ``cap``, else what is wrong and, if known, why."""
    want = _buckets_like(sizes, cap)
    if got == want:
        return ""
    where = f"assign_buckets({sizes}, {cap}) returned {got}, expected {want}"
    for kwargs, hint in BUCKET_MISTAKES:
        if got == _buckets_like(sizes, cap, **kwargs):
            return f"{where}\n  hint: {hint}"
    if got == [list(reversed(b)) for b in want]:
        return f"{where}\n  hint: inside a bucket too, the indices go from last to first"
    if not isinstance(got, list) or not all(got):
        return f"{where}\n  hint: a list of non-empty lists of indices (no empty buckets)"
    return where


def test_assign_buckets(exercise):
    fn = exercise("buckets", "assign_buckets")
    rng = random.Random(0)
    cases = [([4, 4, 4, 4], 8), ([4, 4, 4, 4], 6), ([], 8), ([4, 4, 4], 0)]
    for _ in range(200):
        cases.append(([rng.choice([0, 4, 16, 100, 1000, 40000]) for _ in range(rng.randint(1, 12))],
                      rng.choice([0, 1, 64, 1000, 50000, 10**9])))
    answers = [(sizes, cap, call(fn, sizes, cap)) for sizes, cap in cases]
    for sizes, cap, got in answers:
        problem = _assign_problem(sizes, cap, got)
        if problem:
            # a mistake that explains every answer beats one that explains this answer only
            every = next((h for kwargs, h in BUCKET_MISTAKES
                          if all(g == _buckets_like(sz, c, **kwargs) for sz, c, g in answers)), "")
            wrong(problem.split("\n  hint: ")[0] + f"\n  hint: {every}" if every else problem)
    try:
        got = call(fn, [4, 4], -1)
    except ValueError:
        return
    wrong(f"assign_buckets([4, 4], -1) returned {got}: a negative cap must raise ValueError")


def _grad_on(rank, shape, k):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + k))


def _job_reduce_bucket(fn, shapes):
    rank, n = dist.get_rank(), dist.get_world_size()
    grads = [_grad_on(rank, s, k) for k, s in enumerate(shapes)]
    with CountCollectives() as counter:
        fn(grads)
    problems = []
    for k, (got, shape) in enumerate(zip(grads, shapes, strict=True)):
        mean = sum(_grad_on(r, shape, k) for r in range(n)) / n
        local = _grad_on(rank, shape, k)
        problem = tensor_problem(got, mean, [
            (local, "the gradients are unchanged: the flat buffer is a copy, so copy each slice of it back "
                    "into its gradient (g.copy_(flat[offset:offset + g.numel()].view_as(g)))"),
            *mean_mistakes(mean, n, local)])
        if problem:
            problems.append(f"rank {rank}, gradient {k} of shape {shape}: {problem}")
    return problems, counter.calls


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_bucket_averages_with_one_all_reduce(exercise, cluster_of, world):
    fn = exercise("buckets", "reduce_bucket")
    shapes = [(3, 4), (5,), (2, 2, 2), (1,)]
    for problems, calls in on_ranks(cluster_of(world), _job_reduce_bucket, fn, shapes):
        report(f"reduce_bucket on {world} ranks: the gradients are not the mean over ranks:", problems)
        hint = ("\n  hint: one all_reduce per gradient: copy them into one flat buffer (torch.cat of their "
                "flattened views) and all-reduce that buffer once" if calls.get("all_reduce") == len(shapes) else "")
        check(calls == {"all_reduce": 1}, f"reduce_bucket of {len(shapes)} gradients: expected exactly one "
                                          f"all_reduce, got {calls or 'no collective'}{hint}")


# ----------------------------------------------------------------------------- overlap
class _Handle:
    def __init__(self, log, b):
        self.log, self.b, self.waits = log, b, 0

    def wait(self):
        self.waits += 1
        self.log.append(("wait", self.b))


def _overlap_state(topic_module, bucket_of, log, handles):
    counts = [bucket_of.count(b) for b in range(max(bucket_of) + 1)]

    def launch(b):
        log.append(("launch", b))
        handles.append(_Handle(log, b))
        return handles[-1]

    return topic_module.OverlapState(bucket_of=list(bucket_of), counts=counts, launch=launch)


def test_mark_ready_launches_complete_buckets_in_order(exercise):
    fn = exercise("overlap", "mark_ready")
    module = importlib.import_module(f"{TARGET}.overlap")
    rng = random.Random(1)
    bucket_of = [2, 2, 1, 1, 1, 0, 0]  # registration order; bucket 0 holds the last parameters
    for _ in range(50):
        log, handles = [], []
        state = _overlap_state(module, bucket_of, log, handles)
        order = list(range(len(bucket_of)))
        rng.shuffle(order)
        ready = set()
        for index in order:
            call(fn, state, index)
            ready.add(index)
            complete = [all(i in ready for i, b in enumerate(bucket_of) if b == k) for k in range(3)]
            allowed = next((k for k, c in enumerate(complete) if not c), 3)  # launched: 0 .. allowed-1
            assert log == [("launch", k) for k in range(allowed)], f"ready order {order}: after {index}, {log}"
        assert state.handles == handles


def test_wait_all_waits_each_handle_once_and_resets(exercise):
    fn = exercise("overlap", "wait_all")
    mark_ready = importlib.import_module("solutions.overlap").mark_ready  # the part under test is wait_all
    module = importlib.import_module(f"{TARGET}.overlap")
    bucket_of = [1, 1, 0]
    log, handles = [], []
    state = _overlap_state(module, bucket_of, log, handles)
    for step in range(2):  # the second backward must work after the reset
        for index in (2, 1, 0):
            mark_ready(state, index)
        call(fn, state)
        assert [h.waits for h in handles[-2:]] == [1, 1], f"step {step}: each handle waited once"
        assert state.handles == [] and state.next_bucket == 0 and state.missing == [1, 2]
    mark_ready(state, 2)  # bucket 0 launched, bucket 1 never becomes ready
    with pytest.raises(RuntimeError):
        call(fn, state)


def _job_overlap(mark_ready, wait_all, state_cls):
    """Real autograd hooks, real async all-reduces: the bookkeeping must give one process's grads."""
    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model, loss_fn

    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_model("mlp", seed=3, width=12, depth=3)
    params = list(model.parameters())
    # buckets of about 2 tensors, reverse order (the grader's own assignment, not the exercise's)
    buckets = [list(reversed(range(len(params))))[i:i + 2] for i in range(0, len(params), 2)]
    bucket_of = [0] * len(params)
    for b, idx in enumerate(buckets):
        for i in idx:
            bucket_of[i] = b
    events = []

    class Bucket:
        def __init__(self, b):
            self.grads = [params[i].grad for i in buckets[b]]
            self.flat = torch.cat([g.reshape(-1) for g in self.grads]) / n
            self.work = dist.all_reduce(self.flat, async_op=True)

        def wait(self):
            self.work.wait()
            off = 0
            for g in self.grads:
                g.copy_(self.flat[off:off + g.numel()].view_as(g))
                off += g.numel()

    def launch(b):
        events.append(("launch", b))
        return Bucket(b)

    state = state_cls(bucket_of=bucket_of, counts=[len(b) for b in buckets], launch=launch)
    def hook_for(i):
        def hook(p):  # runs when p.grad has been accumulated: gradient i is ready
            events.append(("ready", i))
            mark_ready(state, i)
        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook_for(i))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        events.clear()
        x, y = local_batch(model, 12, step, rank, n, seed=5)
        loss_fn(model(x), y).backward()
        wait_all(state)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.named_parameters()}, events


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_hooks_on_ranks(exercise, cluster_of, world):
    mark_ready = exercise("overlap", "mark_ready")
    wait_all = exercise("overlap", "wait_all")
    from ddpkit.models import build_model, loss_fn, make_batch

    model = build_model("mlp", seed=3, width=12, depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = make_batch(model, 12, step, seed=5)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for rank, (params, events) in enumerate(on_ranks(cluster_of(world), _job_overlap, mark_ready, wait_all,
                                                        importlib.import_module(f"{TARGET}.overlap").OverlapState)):
        for name, p in model.named_parameters():
            assert torch.allclose(params[name], p.detach(), atol=1e-6), f"rank {rank}: {name}"
        launches = [b for kind, b in events if kind == "launch"]
        assert launches == sorted(launches) == list(range(len(launches))) and launches, events
        # overlap: the first bucket is launched before the last gradient is ready
        assert events.index(("launch", 0)) < max(i for i, e in enumerate(events) if e[0] == "ready"), events


# ----------------------------------------------------------------------------- sharding
def _shards(flat, world):
    """Every rank's shard, done right: pad to a multiple of ``world``, equal contiguous chunks."""
    per = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, flat.new_zeros(per * world - flat.numel())])
    return [padded[r * per:(r + 1) * per] for r in range(world)]


SHARD_MISTAKES = [
    (lambda flat, w: list(torch.tensor_split(flat, w)),
     "the shards differ in length: pad `flat` with zeros to a multiple of world_size first, so every "
     "shard has ceil(numel / world_size) elements"),
    (lambda flat, w: [flat[r * (flat.numel() // w):(r + 1) * (flat.numel() // w)] for r in range(w)],
     "a shard has ceil(numel / world_size) elements, not numel // world_size: round up, and pad with zeros"),
    (lambda flat, w: [flat[r::w] for r in range(w)],
     "a shard is one contiguous chunk (elements rank * per to (rank + 1) * per), not every "
     "world_size-th element"),
]


def test_shard_flat(exercise):
    fn = exercise("sharding", "shard_flat")
    flats = [torch.arange(1, numel + 1, dtype=torch.float32) for numel in (1, 5, 6, 7, 64)]
    cases = [(flat, world, [call(fn, flat.clone(), r, world) for r in range(world)])
             for flat in flats for world in (1, 2, 3, 4)]

    def matches(variant, flat, world, shards):
        want = variant(flat, world)
        return len(shards) == len(want) and all(same(s, w) for s, w in zip(shards, want, strict=True))

    for flat, world, shards in cases:
        if not matches(_shards, flat, world, shards):
            # the mistake that explains every case, else one that explains this case
            hint = next((h for v, h in SHARD_MISTAKES if all(matches(v, *c) for c in cases)),
                        next((h for v, h in SHARD_MISTAKES if matches(v, flat, world, shards)), ""))
            wrong(f"shard_flat of a {flat.numel()}-element tensor on {world} ranks gave "
                  f"{[s.tolist() if torch.is_tensor(s) else s for s in shards]}, "
                  f"expected {[w.tolist() for w in _shards(flat, world)]}" + (f"\n  hint: {hint}" if hint else ""))
    flat = torch.arange(1.0, 8.0)
    call(fn, flat, 0, 2).fill_(-1.0)
    check(flat[0] == 1.0, "writing into rank 0's shard changed `flat`: a shard must be a copy (.clone()), not a "
                          "view into the full tensor")


def _job_unshard(fn, numels):
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = []
    for numel in numels:
        full = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        per = math.ceil(numel / n)
        padded = torch.cat([full, torch.zeros(per * n - numel)])
        shard = padded[rank * per:(rank + 1) * per]
        got = fn(shard.clone(), numel)  # once: a collective, every rank calls it as often
        problem = tensor_problem(got, full)
        if problem and per * n != numel and same(got, padded):
            problem += "\n  hint: the padding is still there: keep only the first numel elements"
        elif problem and same(got, shard):
            problem += "\n  hint: that is this rank's own shard: all-gather every rank's shard"
        if problem:
            errors.append(f"rank {rank}, numel {numel}: {problem}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_unshard_flat_rebuilds_the_full_tensor(exercise, cluster_of, world):
    fn = exercise("sharding", "unshard_flat")
    errors = [e for r in on_ranks(cluster_of(world), _job_unshard, fn, [1, 6, 7, 100]) for e in r]
    report(f"unshard_flat on {world} ranks did not rebuild the full tensor:", errors)


def _just_one_reduce_scatter(counter) -> bool:
    """The exercise issued one collective, a reduce-scatter (any of torch's spellings)."""
    return sum(counter.calls.values()) == 1 and any(k.startswith("reduce_scatter") for k in counter.calls)


def _one_reduce_scatter_problem(counter) -> str:
    if _just_one_reduce_scatter(counter):
        return ""
    calls = counter.calls or "no collective"
    if "all_reduce" in counter.calls:
        return (f"expected one reduce-scatter, got {calls}\n  hint: an all-reduce gives every rank the whole "
                f"sum; a reduce-scatter gives each rank only its shard, for half the bytes")
    return f"expected one reduce-scatter, got {calls}"


def _job_reduce_scatter(fn, numels):
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = []
    for numel in numels:
        def grad_of(r, numel=numel):
            return torch.randn(numel, generator=torch.Generator().manual_seed(10 * numel + r))
        with CountCollectives() as counter:
            got = fn(grad_of(rank))
        mean = sum(grad_of(r) for r in range(n)) / n
        expected = _shards(mean, n)[rank]
        problem = tensor_problem(got, expected, mean_mistakes(expected, n, local=_shards(grad_of(rank), n)[rank]))
        if problem and torch.is_tensor(got) and got.numel() >= numel and same(got[:numel], mean):
            problem += ("\n  hint: that is the whole averaged gradient: return only this rank's shard of "
                        "ceil(numel / N) elements")
        for p in (problem, _one_reduce_scatter_problem(counter)):
            if p:
                errors.append(f"rank {rank}, numel {numel}: {p}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_grad_gives_this_ranks_shard_of_the_mean(exercise, cluster_of, world):
    fn = exercise("sharding", "reduce_scatter_grad")
    errors = [e for r in on_ranks(cluster_of(world), _job_reduce_scatter, fn, [1, 6, 7, 100]) for e in r]
    report(f"reduce_scatter_grad on {world} ranks is not this rank's shard of the mean gradient:", errors)


def _layout(world, k):
    """hybrid_layout done right."""
    return ([[node * k + i for i in range(k)] for node in range(world // k)],
            [[node * k + i for node in range(world // k)] for i in range(k)])


def test_hybrid_layout_nodes_and_replicas(exercise):
    fn = exercise("sharding", "hybrid_layout")
    # 2 x 2; 2 nodes of 3; one node (nothing to replicate); nodes of one GPU (plain replication); larger
    for world, k in [(4, 2), (6, 3), (2, 2), (3, 1), (8, 2), (8, 4), (12, 3)]:
        got, want = call(fn, world, k), _layout(world, k)
        if got == want or got == tuple(want):
            continue
        hint = ""
        if isinstance(got, (tuple, list)) and len(got) == 2 and (got[1], got[0]) == want:
            hint = ("the two lists are swapped: return (shard_groups, replicate_groups); a shard group is "
                    "the k ranks of one node")
        elif got == list(want):
            hint = "return a tuple (shard_groups, replicate_groups), not a list"
        wrong(f"hybrid_layout({world}, {k}) returned {got}, expected {want}" + (f"\n  hint: {hint}" if hint else ""))
    for world, k in [(3, 2), (4, 0), (4, -2)]:
        try:
            got = call(fn, world, k)
        except ValueError:
            continue
        wrong(f"hybrid_layout({world}, {k}) returned {got}: {k} GPUs per node cannot lay out {world} ranks, "
              f"it must raise ValueError")


# ----------------------------------------------------------------------------- zero
def test_partition_parameters_balances_elements(exercise):
    fn = exercise("zero", "partition_parameters")
    rng = random.Random(2)
    for _ in range(100):
        numels = [rng.choice([1, 10, 100, 1000, 4096]) for _ in range(rng.randint(1, 20))]
        world = rng.randint(1, 5)
        owners = call(fn, numels, world)
        assert len(owners) == len(numels) and all(0 <= o < world for o in owners), (numels, world, owners)
        load = [0] * world
        for numel, owner in zip(numels, owners, strict=True):
            if load[owner] != min(load):
                hint = ("\n  hint: round-robin (i % world_size) ignores the sizes: give each parameter to the rank "
                        "that owns the fewest elements so far" if owners == [i % world for i in range(len(numels))]
                        else "")
                wrong(f"partition_parameters({numels}, {world}) returned {owners}: a parameter went to a busier "
                      f"rank (elements per rank before it: {load})" + hint)
            load[owner] += numel
        assert max(load) - min(load) <= max(numels), (numels, world, owners)
        assert call(fn, numels, world) == owners


def _job_zero(fn, steps):
    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model, loss_fn

    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_model("mlp", seed=3, width=12, depth=3)
    params = list(model.parameters())
    owners = [i % n for i in range(len(params))]  # the grader's own partition, not the exercise's
    mine = [p for p, o in zip(params, owners, strict=True) if o == rank]
    opt = torch.optim.AdamW(mine, lr=1e-2)
    for step in range(steps):
        x, y = local_batch(model, 12, step, rank, n, seed=5)
        loss_fn(model(x), y).backward()
        for p in params:  # average the gradients (as a DDP wrapper would)
            p.grad.div_(n)
            dist.all_reduce(p.grad)
        fn(params, owners, opt)
        for p in params:
            p.grad = None
    states = sum(1 for p in params if opt.state.get(p))
    return {k: v.detach() for k, v in model.named_parameters()}, states, len(mine)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_step_equals_one_process(exercise, cluster_of, world):
    fn = exercise("zero", "sharded_step")
    from ddpkit.models import build_model, loss_fn, make_batch

    model = build_model("mlp", seed=3, width=12, depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = make_batch(model, 12, step, seed=5)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for rank, (params, states, owned) in enumerate(on_ranks(cluster_of(world), _job_zero, fn, 3)):
        assert states == owned, f"rank {rank}: optimizer state for {states} parameters, owns {owned}"
        for name, p in model.named_parameters():
            assert torch.allclose(params[name], p.detach(), atol=1e-5), f"rank {rank}: {name}"


def _job_bucket(fn, shapes):
    rank, n = dist.get_rank(), dist.get_world_size()

    def grads_of(r):
        g = torch.Generator().manual_seed(100 + r)
        return [torch.randn(shape, generator=g) for shape in shapes]

    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    for p, g in zip(params, grads_of(rank), strict=True):
        p.grad = g
    with CountCollectives() as counter:
        got = fn(params)
    mean = sum(torch.cat([g.reshape(-1) for g in grads_of(r)]) for r in range(n)) / n
    per = math.ceil(mean.numel() / n)
    expected = torch.cat([mean, torch.zeros(per * n - mean.numel())])[rank * per:(rank + 1) * per]
    local = torch.cat([g.reshape(-1) for g in grads_of(rank)])
    local = torch.cat([local, torch.zeros(per * n - local.numel())])[rank * per:(rank + 1) * per]
    errors = [f"rank {rank}: {p}" for p in (tensor_problem(got, expected, mean_mistakes(expected, n, local)),
                                            _one_reduce_scatter_problem(counter)) if p]
    if any(p.grad is not None for p in params):
        errors.append(f"rank {rank}: the full gradients were not freed (set p.grad = None)")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_bucket_keeps_only_this_ranks_shard(exercise, cluster_of, world):
    fn = exercise("zero", "reduce_scatter_bucket")
    shapes = [(3, 4), (4,), (5,)]  # 21 elements: padded to 22 on 2 ranks, 21 on 3
    errors = [e for r in on_ranks(cluster_of(world), _job_bucket, fn, shapes) for e in r]
    report(f"reduce_scatter_bucket on {world} ranks:", errors)


# ----------------------------------------------------------------------------- costs
def test_ring_all_reduce_time(exercise):
    fn = exercise("costs", "ring_all_reduce_time")
    assert call(fn, 1e6, 1, 1e-5, 1e-9) == 0.0, "one rank: nothing to send"
    assert call(fn, 1e6, 2, 0.0, 1e-9) == pytest.approx(1e6 * 1e-9), "two ranks: each sends S/2 twice"
    assert call(fn, 0, 5, 1e-5, 1e-9) == pytest.approx(8 * 1e-5), "latency: 2(N-1) messages"
    big = call(fn, 1e6, 10**6, 0.0, 1e-9)
    assert big == pytest.approx(2e6 * 1e-9, rel=1e-5), "the bandwidth term tends to 2 S beta"
    times = [call(fn, 1e6, n, 1e-5, 1e-9) for n in (2, 4, 8, 16)]
    assert times == sorted(times), "more ranks never cost less"


def test_ring_all_gather_time(exercise):
    fn = exercise("costs", "ring_all_gather_time")
    assert call(fn, 1e6, 1, 1e-5, 1e-9) == 0.0
    assert call(fn, 1e6, 2, 0.0, 1e-9) == pytest.approx(0.5e6 * 1e-9)
    assert call(fn, 0, 5, 1e-5, 1e-9) == pytest.approx(4 * 1e-5)
    all_reduce = importlib.import_module("solutions.costs").ring_all_reduce_time
    for n in (2, 3, 8):  # reduce-scatter + all-gather is one all-reduce
        assert 2 * call(fn, 3e6, n, 2e-6, 1e-9) == pytest.approx(all_reduce(3e6, n, 2e-6, 1e-9))


def test_fit_alpha_beta_recovers_the_line(exercise):
    fn = exercise("costs", "fit_alpha_beta")
    rng = random.Random(3)
    for alpha, beta in [(2e-5, 1e-9), (1e-4, 5e-10), (0.0, 2e-9)]:
        sizes = [2 ** k for k in range(10, 24)]
        times = [alpha + beta * s for s in sizes]
        a, b = call(fn, sizes, times)
        assert a == pytest.approx(alpha, abs=1e-9) and b == pytest.approx(beta, rel=1e-9)
        noisy = [t * (1 + rng.uniform(-0.01, 0.01)) for t in times]
        a, b = call(fn, sizes, noisy)
        assert b == pytest.approx(beta, rel=0.05)
        if alpha:  # the latency is seen too: the small messages count, not only the big ones
            assert a == pytest.approx(alpha, rel=0.1)
    with pytest.raises(ValueError):
        call(fn, [1024, 1024], [1.0, 2.0])
    with pytest.raises(ValueError):
        call(fn, [1024, 2048], [0.0, 2.0])


def test_zero_model_state_bytes_matches_the_paper(exercise):
    fn = exercise("costs", "zero_model_state_bytes")
    # ZeRO paper, Figure 1: 7.5 B parameters, 64 devices, mixed-precision Adam (K = 12)
    got = [call(fn, 7.5e9, 64, stage) / 1e9 for stage in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.05), got
    assert call(fn, 1e6, 1, 3) == call(fn, 1e6, 1, 0), "one rank: sharding saves nothing"
    fp32 = [call(fn, 1e6, 4, s, param_bytes=4, grad_bytes=4, optimizer_bytes=8) for s in range(4)]
    assert fp32 == pytest.approx([16e6, 4e6 + 4e6 + 2e6, 4e6 + 3e6, 4e6])
    with pytest.raises(ValueError):
        call(fn, 1e6, 4, 4)
