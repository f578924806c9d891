"""The grader: checks the course's exercises by what they do, on real ranks.

    python -m pytest tests/test_exercises.py                            # the reference solutions
    DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py    # your exercises/
    DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py -k ring_all_reduce

``DDPKIT_TARGET`` names the package to grade (``solutions``, the default, or ``exercises``); it
is the grader's only knob and is read here, in the test file, never inside ddpkit.

An exercise that is still a stub (its body only ``raise NotImplementedError``) is reported as
*skipped: "not done yet: <topic>.<name>"* instead of failing, so a learner sees at a glance
what is left and CI stays green on the untouched exercises. A function that raises
NotImplementedError further in is reported the same way. Everything else is checked by
behaviour: against torch's own collectives, against one process training on the whole batch,
or against properties the docstring states. Multi-rank checks run on the shared gloo clusters
of ``tests/conftest.py`` at 2 and 3 ranks.

Target functions are pickled *by value* for the ranks (cloudpickle), so the ranks run the file
as it is now, even on a cluster that imported an older copy.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import random
import re
import subprocess
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


def target(topic: str, name: str):
    """The function under test, or a skip saying the exercise is not done yet."""
    module = importlib.import_module(f"{TARGET}.{topic}")
    cloudpickle.register_pickle_by_value(module)
    fn = getattr(module, name)
    if exercises.is_stub(fn):
        pytest.skip(f"not done yet: {topic}.{name}")
    return fn


def call(fn, *args, **kwargs):
    """Call a target function in this process; NotImplementedError -> not done yet."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        pytest.skip(f"not done yet: {fn.__module__.split('.')[-1]}.{fn.__name__}")


def on_ranks(cluster, job, *args):
    """``cluster.run(job, *args)``; a NotImplementedError on the ranks -> not done yet."""
    try:
        return cluster.run(job, *args)
    except ddpkit.RankError as exc:
        if all("NotImplementedError" in tb for tb in exc.failures.values()):
            pytest.skip(f"not done yet: {job.__name__} ({exc.failures[exc.ranks[0]].splitlines()[-1]})")
        raise


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


# ----------------------------------------------------------------------------- the course itself
def test_exercises_and_solutions_have_the_same_names_signatures_and_docstrings():
    for topic in exercises.TOPICS:
        mine = importlib.import_module(f"exercises.{topic}")
        ref = importlib.import_module(f"solutions.{topic}")
        ex, so = exercises.exercise_functions(mine), exercises.exercise_functions(ref)
        assert list(ex) == list(so), f"{topic}: exercise names {list(ex)} != solution names {list(so)}"
        for name in ex:
            assert inspect.signature(ex[name]) == inspect.signature(so[name]), f"{topic}.{name}: signature"
            assert inspect.getdoc(ex[name]) == inspect.getdoc(so[name]), f"{topic}.{name}: docstring"
            assert not exercises.is_stub(so[name]), f"solutions.{topic}.{name} is still a stub"
            assert "Check" in inspect.getdoc(ex[name]), f"{topic}.{name}: the docstring should say how it is checked"
    assert len(exercises.TOPICS) >= 6


def test_is_stub_tells_stubs_from_answers():
    def stub(x):
        """Docstring."""
        raise NotImplementedError("exercise: x")

    def bare_stub(x):
        raise NotImplementedError

    def answer(x):
        """Docstring."""
        if x < 0:
            raise NotImplementedError("negative")
        return x

    def other_error(x):
        raise ValueError("x")

    assert exercises.is_stub(stub) and exercises.is_stub(bare_stub)
    assert not exercises.is_stub(answer) and not exercises.is_stub(other_error)


def test_every_stub_is_reported_as_not_done(tmp_path):
    """Run this grader on exercises/ in a subprocess: each stub must be a 'not done yet' skip."""
    if TARGET == "exercises":
        pytest.skip("runs the exercises grader itself; only meaningful from the solutions run")
    stubs = {f"{topic}.{name}"
             for topic in exercises.TOPICS
             for name, fn in exercises.exercise_functions(importlib.import_module(f"exercises.{topic}")).items()
             if exercises.is_stub(fn)}
    env = dict(os.environ, DDPKIT_TARGET="exercises")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-rs", "-o", "addopts=",
         "-p", "no:cacheprovider", "-p", "no:nbval", "-p", "no:randomly",
         "-k", "not every_stub_is_reported"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    reported = set(re.findall(r"not done yet: (\w+\.\w+)", out))
    assert stubs <= reported, f"stubs not reported as not done: {sorted(stubs - reported)}\n{out[-3000:]}"
    assert "NotImplementedError" not in "\n".join(
        line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), out[-3000:]
    if len(stubs) == sum(len(exercises.exercise_functions(importlib.import_module(f"exercises.{t}")))
                         for t in exercises.TOPICS):
        # the untouched course: nothing may fail, the grader must not crash on stubs
        assert proc.returncode == 0, out[-3000:]
        assert re.search(r"\d+ skipped", out), out[-3000:]


STUB_LINE = 'raise NotImplementedError("exercise: costs.ring_all_gather_time (see the docstring)")'


def _learner_copy(tmp_path, monkeypatch):
    """A fresh ``exercises`` package in tmp_path (a learner's checkout), imported instead of ours."""
    pkg = tmp_path / "exercises"
    pkg.mkdir()
    (pkg / "__init__.py").write_text((ROOT / "exercises" / "__init__.py").read_text())
    stub_src = (ROOT / "exercises" / "costs.py").read_text()
    assert STUB_LINE in stub_src
    (pkg / "costs.py").write_text(stub_src)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
        monkeypatch.delitem(sys.modules, m)  # restored (ours) when the test ends
    fresh = importlib.import_module("exercises")
    assert fresh.__file__.startswith(str(tmp_path))

    def edit(body: str) -> None:
        (pkg / "costs.py").write_text(stub_src.replace(STUB_LINE, body))

    return fresh, edit


def test_use_falls_back_to_the_solution_and_picks_up_edits(tmp_path, monkeypatch, capsys):
    """``exercises.use`` gives the reference while a stub, the learner's code once written."""
    fresh, edit = _learner_copy(tmp_path, monkeypatch)
    fn = fresh.use("costs", "ring_all_gather_time")
    assert fn.__module__ == "solutions.costs"
    assert "not done yet" in capsys.readouterr().out
    edit("return 12345.0")
    fn = fresh.use("costs", "ring_all_gather_time")
    assert fn.__module__ == "exercises.costs" and fn(1, 2, 0, 0) == 12345.0
    # and it ships by value: a pickled copy runs the edited code without importing the file
    assert cloudpickle.loads(cloudpickle.dumps(fn))(1, 2, 0, 0) == 12345.0


def test_an_edited_exercise_reaches_running_ranks(tmp_path, monkeypatch, cluster_of):
    """Edit, run on the ranks, edit again, run again: the ranks never run a stale copy."""
    fresh, edit = _learner_copy(tmp_path, monkeypatch)
    cluster = cluster_of(2)
    fn = fresh.use("costs", "ring_all_gather_time", quiet=True)  # still a stub: the reference
    assert cluster.run(fn, 1e6, 2, 0.0, 1e-9) == [pytest.approx(0.5e6 * 1e-9)] * 2
    for value in (1.0, 2.0):
        edit(f"return {value}")
        fn = fresh.use("costs", "ring_all_gather_time", quiet=True)
        assert cluster.run(fn, 1e6, 2, 0.0, 1e-9) == [value, value]


# ----------------------------------------------------------------------------- collectives
def _job_ring(fn, lengths):
    rank = dist.get_rank()
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
        if not torch.allclose(got, expected, rtol=1e-12, atol=1e-12):
            errors.append(f"length {length}: max error {(got - expected).abs().max().item():.3g}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_ring_all_reduce_equals_all_reduce(cluster_of, world):
    fn = target("collectives", "ring_all_reduce")
    # 1 and 2 are shorter than 3 ranks (empty chunks); 7 does not split evenly; 1000 is larger
    results = on_ranks(cluster_of(world), _job_ring, fn, [1, 2, 7, 1000])
    assert results == [[]] * world, results


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
    fn(model)
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("world", [2, 3])
def test_average_gradients_equals_one_process(cluster_of, world):
    fn = target("averaging", "average_gradients")
    reference = _whole_batch_grads()
    for rank, grads in enumerate(on_ranks(cluster_of(world), _job_average, fn)):
        assert grads.keys() == reference.keys(), "frozen parameters must keep .grad None"
        for name in grads:
            assert torch.allclose(grads[name], reference[name], atol=1e-6), f"rank {rank}: {name}"


# ----------------------------------------------------------------------------- buckets
def test_assign_buckets():
    fn = target("buckets", "assign_buckets")
    assert call(fn, [4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert call(fn, [], 8) == []
    with pytest.raises(ValueError):
        call(fn, [4, 4], -1)
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 4, 16, 100, 1000, 40000]) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([0, 1, 64, 1000, 50000, 10**9])
        buckets = call(fn, sizes, cap)
        where = f"sizes={sizes} cap={cap} -> {buckets}"
        assert [i for b in buckets for i in b] == list(reversed(range(len(sizes)))), \
            "reverse order, each once: " + where
        assert all(buckets), "no empty buckets: " + where
        for b in buckets:
            total = sum(sizes[i] for i in b)
            assert total - sizes[b[-1]] < cap or (cap == 0 and len(b) == 1), \
                "a bucket closes as soon as it reaches the cap: " + where
        for b in buckets[:-1]:
            assert sum(sizes[i] for i in b) >= cap, "only the last bucket may stay under the cap: " + where
        if cap == 0:
            assert all(len(b) == 1 for b in buckets), "cap 0: one parameter per bucket: " + where


def _grad_on(rank, shape, k):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + k))


def _job_reduce_bucket(fn, shapes):
    rank, n = dist.get_rank(), dist.get_world_size()
    grads = [_grad_on(rank, s, k) for k, s in enumerate(shapes)]
    with CountCollectives() as counter:
        fn(grads)
    expected = [sum(_grad_on(r, s, k) for r in range(n)) / n for k, s in enumerate(shapes)]
    bad = [k for k, (g, e) in enumerate(zip(grads, expected, strict=True))
           if g.shape != e.shape or not torch.allclose(g, e, atol=1e-6)]
    return bad, counter.calls


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_bucket_averages_with_one_all_reduce(cluster_of, world):
    fn = target("buckets", "reduce_bucket")
    shapes = [(3, 4), (5,), (2, 2, 2), (1,)]
    for rank, (bad, calls) in enumerate(on_ranks(cluster_of(world), _job_reduce_bucket, fn, shapes)):
        assert bad == [], f"rank {rank}: gradients {bad} are not the mean over ranks"
        assert calls == {"all_reduce": 1}, f"rank {rank}: expected exactly one all_reduce, got {calls}"


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


def test_mark_ready_launches_complete_buckets_in_order():
    fn = target("overlap", "mark_ready")
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


def test_wait_all_waits_each_handle_once_and_resets():
    fn = target("overlap", "wait_all")
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
def test_overlap_hooks_on_ranks(cluster_of, world):
    mark_ready = target("overlap", "mark_ready")
    wait_all = target("overlap", "wait_all")
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
def test_shard_flat():
    fn = target("sharding", "shard_flat")
    for numel in (1, 5, 6, 7, 64):
        for world in (1, 2, 3, 4):
            flat = torch.arange(1, numel + 1, dtype=torch.float32)
            shards = [call(fn, flat, r, world) for r in range(world)]
            per = math.ceil(numel / world)
            assert all(s.shape == (per,) for s in shards), \
                f"numel {numel}, world {world}: shapes {[s.shape for s in shards]}"
            joined = torch.cat(shards)
            assert torch.equal(joined[:numel], flat) and not joined[numel:].any(), f"numel {numel}, world {world}"
            shards[0].fill_(-1.0)
            assert flat[0] == 1.0, "a shard must be a copy, not a view into the full tensor"


def _job_unshard(fn, numels):
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = []
    for numel in numels:
        full = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        per = math.ceil(numel / n)
        padded = torch.cat([full, torch.zeros(per * n - numel)])
        got = fn(padded[rank * per:(rank + 1) * per].clone(), numel)
        if got.shape != full.shape or not torch.equal(got, full):
            errors.append(f"numel {numel}: got shape {tuple(got.shape)}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_unshard_flat_rebuilds_the_full_tensor(cluster_of, world):
    fn = target("sharding", "unshard_flat")
    assert on_ranks(cluster_of(world), _job_unshard, fn, [1, 6, 7, 100]) == [[]] * world


def _just_one_reduce_scatter(counter) -> bool:
    """The exercise issued one collective, a reduce-scatter (any of torch's spellings)."""
    return sum(counter.calls.values()) == 1 and any(k.startswith("reduce_scatter") for k in counter.calls)


def _job_reduce_scatter(fn, numels):
    rank, n = dist.get_rank(), dist.get_world_size()
    errors = []
    for numel in numels:
        def grad_of(r, numel=numel):
            return torch.randn(numel, generator=torch.Generator().manual_seed(10 * numel + r))
        with CountCollectives() as counter:
            got = fn(grad_of(rank))
        mean = sum(grad_of(r) for r in range(n)) / n
        per = math.ceil(numel / n)
        expected = torch.cat([mean, torch.zeros(per * n - numel)])[rank * per:(rank + 1) * per]
        if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-6):
            errors.append(f"numel {numel}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        if not _just_one_reduce_scatter(counter):
            errors.append(f"numel {numel}: expected one reduce-scatter, got {counter.calls}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_grad_gives_this_ranks_shard_of_the_mean(cluster_of, world):
    fn = target("sharding", "reduce_scatter_grad")
    assert on_ranks(cluster_of(world), _job_reduce_scatter, fn, [1, 6, 7, 100]) == [[]] * world


def test_hybrid_layout_nodes_and_replicas():
    fn = target("sharding", "hybrid_layout")
    assert call(fn, 4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert call(fn, 6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert call(fn, 2, 2) == ([[0, 1]], [[0], [1]])      # one node: nothing to replicate
    assert call(fn, 3, 1) == ([[0], [1], [2]], [[0, 1, 2]])  # nodes of one GPU: plain replication
    for world, k in [(8, 2), (8, 4), (12, 3)]:
        shard, replicate = call(fn, world, k)
        assert sorted(r for g in shard for r in g) == list(range(world)), (world, k, shard)
        assert sorted(r for g in replicate for r in g) == list(range(world)), (world, k, replicate)
        assert all(len(g) == k for g in shard) and all(len(g) == world // k for g in replicate)
        for g in replicate:  # one rank per node, all with the same local index
            assert len({r // k for r in g}) == len(g) and len({r % k for r in g}) == 1, (world, k, g)
    for world, k in [(3, 2), (4, 0), (4, -2)]:
        with pytest.raises(ValueError):
            call(fn, world, k)


# ----------------------------------------------------------------------------- zero
def test_partition_parameters_balances_elements():
    fn = target("zero", "partition_parameters")
    rng = random.Random(2)
    for _ in range(100):
        numels = [rng.choice([1, 10, 100, 1000, 4096]) for _ in range(rng.randint(1, 20))]
        world = rng.randint(1, 5)
        owners = call(fn, numels, world)
        assert len(owners) == len(numels) and all(0 <= o < world for o in owners), (numels, world, owners)
        load = [0] * world
        for numel, owner in zip(numels, owners, strict=True):
            assert load[owner] == min(load), f"parameter went to a busier rank: {numels}, {world} -> {owners}"
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
def test_sharded_step_equals_one_process(cluster_of, world):
    fn = target("zero", "sharded_step")
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
    errors = []
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-6):
        errors.append(f"shard of shape {tuple(got.shape)}, expected {tuple(expected.shape)}, or wrong values")
    if any(p.grad is not None for p in params):
        errors.append("the full gradients were not freed (p.grad = None)")
    if not _just_one_reduce_scatter(counter):
        errors.append(f"expected one reduce-scatter, got {counter.calls}")
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_bucket_keeps_only_this_ranks_shard(cluster_of, world):
    fn = target("zero", "reduce_scatter_bucket")
    shapes = [(3, 4), (4,), (5,)]  # 21 elements: padded to 22 on 2 ranks, 21 on 3
    assert on_ranks(cluster_of(world), _job_bucket, fn, shapes) == [[]] * world


# ----------------------------------------------------------------------------- costs
def test_ring_all_reduce_time():
    fn = target("costs", "ring_all_reduce_time")
    assert call(fn, 1e6, 1, 1e-5, 1e-9) == 0.0, "one rank: nothing to send"
    assert call(fn, 1e6, 2, 0.0, 1e-9) == pytest.approx(1e6 * 1e-9), "two ranks: each sends S/2 twice"
    assert call(fn, 0, 5, 1e-5, 1e-9) == pytest.approx(8 * 1e-5), "latency: 2(N-1) messages"
    big = call(fn, 1e6, 10**6, 0.0, 1e-9)
    assert big == pytest.approx(2e6 * 1e-9, rel=1e-5), "the bandwidth term tends to 2 S beta"
    times = [call(fn, 1e6, n, 1e-5, 1e-9) for n in (2, 4, 8, 16)]
    assert times == sorted(times), "more ranks never cost less"


def test_ring_all_gather_time():
    fn = target("costs", "ring_all_gather_time")
    assert call(fn, 1e6, 1, 1e-5, 1e-9) == 0.0
    assert call(fn, 1e6, 2, 0.0, 1e-9) == pytest.approx(0.5e6 * 1e-9)
    assert call(fn, 0, 5, 1e-5, 1e-9) == pytest.approx(4 * 1e-5)
    all_reduce = importlib.import_module("solutions.costs").ring_all_reduce_time
    for n in (2, 3, 8):  # reduce-scatter + all-gather is one all-reduce
        assert 2 * call(fn, 3e6, n, 2e-6, 1e-9) == pytest.approx(all_reduce(3e6, n, 2e-6, 1e-9))


def test_fit_alpha_beta_recovers_the_line():
    fn = target("costs", "fit_alpha_beta")
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


def test_zero_model_state_bytes_matches_the_paper():
    fn = target("costs", "zero_model_state_bytes")
    # ZeRO paper, Figure 1: 7.5 B parameters, 64 devices, mixed-precision Adam (K = 12)
    got = [call(fn, 7.5e9, 64, stage) / 1e9 for stage in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.05), got
    assert call(fn, 1e6, 1, 3) == call(fn, 1e6, 1, 0), "one rank: sharding saves nothing"
    fp32 = [call(fn, 1e6, 4, s, param_bytes=4, grad_bytes=4, optimizer_bytes=8) for s in range(4)]
    assert fp32 == pytest.approx([16e6, 4e6 + 4e6 + 2e6, 4e6 + 3e6, 4e6])
    with pytest.raises(ValueError):
        call(fn, 1e6, 4, 4)
