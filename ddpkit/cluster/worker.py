"""The rank side of a Cluster: ``main()``, run in one fresh interpreter per rank.

Start-up, in order:
1. read one JSON line of configuration from stdin (rank, world size, backend, the parent's
   job address and its random key, the TCPStore port, the parent's sys.path);
2. keep reading stdin in a thread: the parent holds the other end, so end-of-file means the
   parent is gone (even after SIGKILL) and the worker exits at once (no orphans);
3. connect back to the parent over loopback and prove, both ways, that each side knows the
   cluster's random key (HMAC challenges, see ``handshake``), then say hello;
4. join the process group through the parent's TCPStore, then report ready.
Then loop: receive a job (a function pickled by value with cloudpickle), run it, send back
the pickled result or the formatted traceback. With each job comes the file where this rank's
flight recorder keeps its last collectives (``ddpkit.comm.flight``), which the parent reads if the
ranks' collectives part; its watchdog reports a collective stuck during the job. On a GPU, after
each job, it also tells the parent what it held there (``gpu_memory``: ranks sharing a GPU draw on
one pool, and a rank that runs out is told what each held).

Signals: SIGINT means "stop the job you are running" (the parent sends it when the notebook's
stop button is pressed, or when another rank failed and this one may be stuck). Between jobs
a stray SIGINT is ignored, so it cannot kill an idle rank.

A worker is a whole process, so it holds a little process-wide state (``_context``): the
connection to the parent, which ``report`` (and ``ddpkit.progress()``) send through from inside a
job, and the namespace ``%%ranks`` cells run in.
"""
from __future__ import annotations

import ast
import faulthandler
import gc
import hashlib
import hmac
import io
import json
import linecache
import os
import signal
import socket
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

# ---------------------------------------------------------------------- the handshake
# Both ends of the job channel run this. Nothing is unpickled before it succeeds, so a
# process that does not know the key can connect but never get anything executed.
_NONCE = 32           # bytes of random challenge
_DIGEST = 32          # bytes of HMAC-SHA256
HANDSHAKE_TIMEOUT = 5.0  # seconds a peer gets to answer; a silent client cannot stall anyone


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        buf += chunk
    return buf


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def handshake(sock: socket.socket, key: bytes, server: bool) -> Connection:
    """Mutual HMAC challenge over a fresh socket; returns it as a multiprocessing Connection.

    The server (parent) sends a nonce; the client answers HMAC(key, b"client"+nonce) and its
    own nonce; the server checks, then answers HMAC(key, b"server"+client_nonce). The role
    prefix stops a peer from reflecting one side's challenge back at it. Raises
    ``PermissionError`` on a wrong answer, ``OSError``/``ConnectionError`` on silence.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT)
    if server:
        nonce = os.urandom(_NONCE)
        sock.sendall(nonce)
        answer, their_nonce = _recv_exact(sock, _DIGEST), _recv_exact(sock, _NONCE)
        if not hmac.compare_digest(answer, _mac(key, b"client", nonce)):
            raise PermissionError("wrong key")
        sock.sendall(_mac(key, b"server", their_nonce))
    else:
        nonce = _recv_exact(sock, _NONCE)
        mine = os.urandom(_NONCE)
        sock.sendall(_mac(key, b"client", nonce) + mine)
        if not hmac.compare_digest(_recv_exact(sock, _DIGEST), _mac(key, b"server", mine)):
            raise PermissionError("the parent did not prove it knows the key")
    sock.settimeout(None)  # from here on: blocking reads of length-prefixed pickles
    return Connection(sock.detach())


# ---------------------------------------------------------------------- the rank's context
class _Context:
    """What a running job may need from its worker: the channel back to the parent."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank = conn, rank
        self.lock = threading.Lock()  # job thread and helper threads may both print
        self.namespace: dict = {"__name__": "__ranks__"}  # %%ranks cells share this per rank
        self.running = False          # SIGINT raises KeyboardInterrupt only while True
        self.cells = 0

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


_context: _Context | None = None  # set once in main(); None outside a Cluster worker


def report(kind: str, **payload) -> None:
    """Send a side message (progress, records, a stuck collective, ...) to the cluster while a job
    runs; nothing happens outside a Cluster worker."""
    if _context is not None:
        _context.send(("event", kind, payload))


def progress(done: int, total: int) -> None:
    """Report ``done`` of ``total`` steps to the cluster widget (does nothing outside a Cluster)."""
    report("progress", done=int(done), total=int(total))


class _ChannelWriter(io.TextIOBase):
    """sys.stdout/sys.stderr of a worker: each line goes to the parent over the job channel.

    Sharing the channel with results keeps order: everything a job printed reaches the parent
    before the job's result does. Output written below Python (C++ warnings to fd 1/2, a
    segfault's dump) still goes to the process's pipes, which the parent also reads.
    """

    encoding = "utf-8"  # some libraries ask; the text travels as str anyway

    def __init__(self, stream: str):
        self.stream, self._buf = stream, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._buf += s
        if "\n" in self._buf:
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                _context.send(("out", self.stream, line))
        return len(s)

    def flush(self) -> None:
        if self._buf:
            line, self._buf = self._buf, ""
            _context.send(("out", self.stream, line))


def _on_sigint(signum, frame) -> None:
    # The parent interrupts a job with SIGINT; an idle rank ignores it (a stray Ctrl-C, or an
    # interrupt that arrived just after the job ended). A rank blocked inside a C++
    # collective only sees this when the call returns; the parent kills it if that is too late.
    if _context is not None and _context.running:
        raise KeyboardInterrupt


def _exit_when_parent_dies(stdin) -> None:
    while stdin.read(65536):
        pass
    os._exit(0)


def _is_distributed_failure(exc: BaseException) -> bool:
    """Did the error come out of torch.distributed (a timed-out or broken collective)?

    Then the process group is suspect and the parent restarts the ranks. gloo reports a
    timeout as a plain RuntimeError, so besides ``DistError`` look at where it was raised:
    any frame of the traceback inside torch/distributed (an interrupt that landed there too).
    """
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    marker = os.sep + os.path.join("torch", "distributed") + os.sep
    tb = exc.__traceback__
    while tb is not None:
        if marker in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def run_cell(source: str):
    """Run a ``%%ranks`` cell in this rank's persistent namespace; repr of a trailing expression.

    Like IPython: the statements run in order, and if the last one is an expression its
    value comes back (as text, so any object can be shown, picklable or not).
    """
    _context.cells += 1
    filename = f"<%%ranks cell {_context.cells}>"
    # linecache lets tracebacks show the cell's lines, as they do for files.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename, "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    ns = _context.namespace
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
    return None if value is None else repr(value)


def _pickle(obj, devices=("cuda",)) -> bytes:
    """A job's result as bytes for the notebook, every tensor on ``devices`` (CUDA) in it copied
    to the CPU: the notebook holds results on the CPU, so unpickling them there creates no CUDA
    context of its own (hundreds of MiB, on GPU 0 of a shared machine) and works on a machine
    without a GPU."""
    import cloudpickle
    import torch

    class ResultPickler(cloudpickle.Pickler):
        def reducer_override(self, o):
            # plain tensors and parameters (a DTensor or another subclass is left as it is)
            if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type in devices:
                cpu = o.detach().to("cpu", copy=True)  # just its elements, not a view's whole storage
                if type(o) is torch.nn.Parameter:
                    return torch.nn.Parameter, (cpu, o.requires_grad)
                return cpu.requires_grad_(o.requires_grad and o.is_leaf).__reduce_ex__(self.proto)
            return super().reducer_override(o)

    buf = io.BytesIO()
    ResultPickler(buf).dump(obj)
    return buf.getvalue()


def _join_device(cfg: dict) -> str:
    """This rank's GPU, before it joins the process group (NCCL binds to the current device, and the
    transports of ranks sharing a GPU put their buffers there): ``cfg["gpu"]`` is the index the
    Cluster gave it (``gpus=``); None on the CPU. Its cap, if the Cluster set one
    (``memory_fraction``), goes on the caching allocator before anything is allocated. Returns the
    device's name for the cluster ("cuda:5", "cpu")."""
    from ddpkit import rankside

    if cfg.get("gpu") is None:
        return "cpu"
    rankside.set_device(cfg["gpu"])
    if cfg.get("memory_fraction") is not None:
        import torch

        torch.cuda.set_per_process_memory_fraction(cfg["memory_fraction"], rankside.device())
    return str(rankside.device())


def _after_job(failed: BaseException | None, fraction: float | None) -> None:
    """On a GPU, after every job: tell the parent what this rank held there (``GpuHeld``), so that a
    rank out of memory can be told what each rank sharing its GPU held (``jobs``). A rank that ran
    out gives back what its allocator cached: ranks sharing the GPU may need it."""
    import torch

    from ddpkit import rankside
    from ddpkit.cluster.gpu_memory import GpuHeld

    dev = rankside.device()
    if dev.type != "cuda":
        return
    try:  # never at the cost of the job's own answer (a GPU in an error state may refuse to tell)
        _context.send(("event", "gpu_memory", {"held": GpuHeld.now(dev, fraction)}))
        if isinstance(failed, torch.OutOfMemoryError):
            failed.__traceback__ = None  # its frames hold the tensors that filled the GPU
            gc.collect()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def _pin(cores: list[int]) -> None:
    """Bind this process, every thread it has and (inherited) every one it starts, to ``cores``
    (``Cluster(pin_cores=True)``)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def _keep_freed_memory() -> None:
    """Keep the memory a step frees in this process, for the next step to reuse.

    glibc's malloc hands big freed blocks back to the kernel (a gradient or an activation of the
    course's MLP is 256 KiB) and adapts that threshold as it goes; a training step that frees
    and reallocates the same tensors then faults every page in again, zeroed by the kernel.
    On a small machine that came and went from run to run: the slow runs took several times the
    page faults, and a slower step (a rank's ``resource.getrusage(RUSAGE_SELF).ru_minflt`` counts
    them). Fixed thresholds (freed memory up
    to 1 GiB stays, blocks below 32 MiB come from the heap) make every run the fast one. glibc
    only (Linux); elsewhere nothing changes."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3   # mallopt's parameter numbers (malloc.h)
        libc.mallopt(m_trim_threshold, 1 << 30)
        libc.mallopt(m_mmap_threshold, 32 << 20)      # glibc's largest allowed on 64-bit
    except (OSError, AttributeError):                 # not glibc (musl has no mallopt)
        pass


def _before_job() -> None:
    """What each job starts from, on a GPU: what earlier jobs left in reference cycles (a wrapper
    and its model) freed now rather than at the garbage collector's next pass, and the allocator's
    peak counted afresh (a rank outlives its jobs; ``memory.reset_cuda_peak``): each run's
    allocator figures are its own. On the CPU the figures are counted by category, and the
    collector's own passes free those cycles."""
    from ddpkit import rankside

    dev = rankside.device()
    if dev.type == "cuda":
        from ddpkit.memory import reset_cuda_peak

        gc.collect()
        reset_cuda_peak(dev)


def main() -> None:
    global _context
    stdin = sys.stdin.buffer
    cfg = json.loads(stdin.readline())
    threading.Thread(target=_exit_when_parent_dies, args=(stdin,), daemon=True).start()
    sys.stdin = open(os.devnull)  # input() in a job gets end-of-file, not the parent's pipe
    signal.signal(signal.SIGINT, _on_sigint)
    faulthandler.enable(file=sys.__stderr__)  # a segfault's Python stack goes to the stderr pipe
    if hasattr(signal, "SIGUSR1"):  # the parent asks for stacks this way (ddpkit.comm.flight); never fatal
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    for path in reversed(cfg["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    rank, world_size = cfg["rank"], cfg["world_size"]

    sock = socket.create_connection(tuple(cfg["address"]), timeout=HANDSHAKE_TIMEOUT)
    conn = handshake(sock, bytes.fromhex(cfg["authkey"]), server=False)
    conn.send(("hello", rank, cfg["generation"], os.getpid()))
    _context = _Context(conn, rank)
    from ddpkit import rankside

    sys.stdout, sys.stderr = _ChannelWriter("stdout"), _ChannelWriter("stderr")

    import torch
    import torch.distributed as dist

    _keep_freed_memory()
    if cfg.get("cores"):
        _pin(cfg["cores"])
    if cfg["threads"]:  # 0: keep torch's default (one thread per core)
        torch.set_num_threads(cfg["threads"])
    try:
        device = _join_device(cfg)
        # The store waits longer than a collective does: ranks that import torch at
        # different speeds on a loaded machine must still meet.
        store = dist.TCPStore(cfg["store_host"], cfg["store_port"], is_master=False,
                              timeout=timedelta(seconds=max(cfg["timeout"], 60.0)))
        # ddpkit's own process group over the real backend: it counts, records and (on an
        # emulated network) delays every collective, torch's wrappers' included
        from ddpkit.comm import process_group

        real = cfg.get("transport") or cfg["backend"]  # "shm", "cuda-ipc", "gloo" or "nccl" (cluster.placement)
        process_group.install(cfg["network"], real, shm_prefix=cfg.get("shm_prefix"))
        dist.init_process_group("ddpkit", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg["timeout"]))
        conn.send(("ready", rank, {"pid": os.getpid(), "device": device}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None

    import cloudpickle

    # What the rank holds from its start (torch, the process group) is never garbage: frozen out
    # of every collection (_before_job's on a GPU, the collector's own passes), which then walk
    # only what jobs made, not the hundreds of thousands of objects torch's import left
    gc.collect()
    gc.freeze()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        if msg[0] != "run":
            continue
        flight = rankside.comm().flight
        if len(msg) > 2:  # the file to keep this rank's last collectives in, where the parent reads them
            flight.attach(msg[2]["ring"], msg[2]["job"], report)
        try:
            _context.running = True
            _before_job()
            fn, args, kwargs = cloudpickle.loads(msg[1])
            result = fn(*args, **kwargs)
            _context.running = False
            flight.end_job()
        except BaseException as exc:  # KeyboardInterrupt too: the parent asked us to stop
            _context.running = False
            flight.end_job()
            sys.stdout.flush()
            sys.stderr.flush()
            # The traceback starts at the job's own frame: this loop's frame is noise to a learner.
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            conn_msg = ("error", tb, type(exc).__name__, _is_distributed_failure(exc))
            _after_job(exc, cfg.get("memory_fraction"))
        else:
            _after_job(None, cfg.get("memory_fraction"))
            try:
                conn_msg = ("result", _pickle(result))
            except Exception as exc:
                conn_msg = ("error", f"the result of rank {rank} (a {type(result).__name__}) "
                            f"cannot be pickled to send back: {type(exc).__name__}: {exc}",
                            "PicklingError", False)
        sys.stdout.flush()
        sys.stderr.flush()
        _context.send(conn_msg)

    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


if __name__ == "__main__":
    # The Cluster starts workers with ``-c "from ddpkit.cluster.worker import main; main()"``; under
    # ``python -m`` this file would be ``__main__``, a second copy of the module, so run the
    # importable copy's main(), whose ``_context`` ``%%ranks`` cells see.
    from ddpkit.cluster.worker import main as _main

    _main()
