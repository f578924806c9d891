"""The rank side of a Cluster: ``main()``, run in one fresh interpreter per rank.

Start-up: read its ``RankSettings`` (a JSON line on stdin), exit when stdin closes (the parent
is gone), connect back with the HMAC handshake (``admission``), join the process group
(``rank_setup``), report ready. Then loop: receive a cloudpickled job, run it, send back the
pickled result or the traceback (and, on a GPU, what it held: ``gpu_memory``). SIGINT stops a
running job and is ignored between jobs. ``_context`` is the channel ``report`` sends through.
"""
from __future__ import annotations

import ast
import faulthandler
import gc
import io
import linecache
import os
import signal
import socket
import sys
import threading
import traceback

from ddpkit.cluster.admission import HANDSHAKE_TIMEOUT, handshake
from ddpkit.cluster.rank_setup import RankSettings, join, share_the_cores


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
    """Send a side message (progress, records, ...) to the cluster; nothing outside a Cluster worker."""
    if _context is not None:
        _context.send(("event", kind, payload))


def progress(done: int, total: int) -> None:
    """Report ``done`` of ``total`` steps to the cluster widget (does nothing outside a Cluster)."""
    report("progress", done=int(done), total=int(total))


class _ChannelWriter(io.TextIOBase):
    """sys.stdout/sys.stderr of a worker: each line goes over the job channel, ahead of the result."""

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
    # an idle rank ignores a stray interrupt; one blocked in a C++ collective sees it only on return
    if _context is not None and _context.running:
        raise KeyboardInterrupt


def _exit_when_parent_dies(stdin) -> None:
    while stdin.read(65536):
        pass
    os._exit(0)


def _is_distributed_failure(exc: BaseException) -> bool:
    """Did the error come out of torch.distributed (then the parent restarts the ranks)? gloo's
    timeout is a plain RuntimeError, so any traceback frame inside torch/distributed counts too."""
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
    """Run a ``%%ranks`` cell in this rank's persistent namespace; repr of a trailing expression."""
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


def pickle_result(obj, devices=("cuda",)) -> bytes:
    """A job's result as bytes, every CUDA tensor copied to the CPU (so the notebook needs no CUDA context)."""
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


# ---------------------------------------------------------------------- start-up, step by step
def _listen_to_the_parent(stdin) -> None:
    """Exit when the parent goes; SIGINT stops a job; faulthandler's stacks (SIGUSR1 too) to stderr."""
    threading.Thread(target=_exit_when_parent_dies, args=(stdin,), daemon=True).start()
    sys.stdin = open(os.devnull)  # input() in a job gets end-of-file, not the parent's pipe
    signal.signal(signal.SIGINT, _on_sigint)
    faulthandler.enable(file=sys.__stderr__)
    if hasattr(signal, "SIGUSR1"):  # never fatal
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def _connect(settings: RankSettings):
    """The job channel: the handshake with the parent, hello, and this rank's prints over it."""
    global _context
    for path in reversed(settings.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    sock = socket.create_connection(settings.address, timeout=HANDSHAKE_TIMEOUT)
    conn = handshake(sock, bytes.fromhex(settings.authkey), server=False)
    conn.send(("hello", settings.rank, settings.generation, os.getpid()))
    _context = _Context(conn, settings.rank)
    sys.stdout, sys.stderr = _ChannelWriter("stdout"), _ChannelWriter("stderr")
    return conn


# ---------------------------------------------------------------------- each job
def before_job() -> None:
    """On a GPU: free earlier jobs' reference cycles now and count the allocator's peak afresh."""
    from ddpkit import rankside

    dev = rankside.device()
    if dev.type == "cuda":
        from ddpkit.memory import reset_cuda_peak

        gc.collect()
        reset_cuda_peak(dev)


def after_job(send, failed: BaseException | None, fraction: float | None) -> None:
    """On a GPU: tell the parent what this rank held (``GpuHeld``); after running out, free the cache."""
    import torch

    from ddpkit import rankside
    from ddpkit.cluster.gpu_memory import GpuHeld

    dev = rankside.device()
    if dev.type != "cuda":
        return
    try:  # never at the cost of the job's own answer (a GPU in an error state may refuse to tell)
        send(("event", "gpu_memory", {"held": GpuHeld.now(dev, fraction)}))
        if isinstance(failed, torch.OutOfMemoryError):
            failed.__traceback__ = None  # its frames hold the tensors that filled the GPU
            gc.collect()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def _run_job(msg, settings: RankSettings, flight):
    """One job: the pickled result, or the traceback from the job's own frame on."""
    import cloudpickle

    if len(msg) > 2:  # the file to keep this rank's last collectives in, where the parent reads them
        flight.attach(msg[2]["ring"], msg[2]["job"], report)
    try:
        _context.running = True
        before_job()
        fn, args, kwargs = cloudpickle.loads(msg[1])
        result = fn(*args, **kwargs)
        _context.running = False
        flight.end_job()
    except BaseException as exc:  # KeyboardInterrupt too: the parent asked us to stop
        _context.running = False
        flight.end_job()
        sys.stdout.flush()
        sys.stderr.flush()
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
        after_job(_context.send, exc, settings.memory_fraction)
        return ("error", tb, type(exc).__name__, _is_distributed_failure(exc))
    after_job(_context.send, None, settings.memory_fraction)
    try:
        return ("result", pickle_result(result))
    except Exception as exc:
        return ("error", f"the result of rank {settings.rank} (a {type(result).__name__}) "
                f"cannot be pickled to send back: {type(exc).__name__}: {exc}", "PicklingError", False)


def _serve(conn, settings: RankSettings) -> None:
    """Run the parent's jobs, one at a time, until it says stop or goes."""
    from ddpkit import rankside

    flight = rankside.comm().flight
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        if msg[0] != "run":
            continue
        answer = _run_job(msg, settings, flight)
        sys.stdout.flush()
        sys.stderr.flush()
        _context.send(answer)


def main() -> None:
    """A rank's life, in the order of the module docstring: told, connected, placed, joined, serving."""
    stdin = sys.stdin.buffer
    settings = RankSettings.from_json(stdin.readline())
    _listen_to_the_parent(stdin)
    conn = _connect(settings)
    share_the_cores(settings)
    try:
        device = join(settings)
        conn.send(("ready", settings.rank, {"pid": os.getpid(), "device": device}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    # what torch's import and the process group made is never garbage: keep it out of every collection
    gc.collect()
    gc.freeze()
    _serve(conn, settings)
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


if __name__ == "__main__":
    # run the importable copy's main(), whose ``_context`` ``%%ranks`` cells see (not ``__main__``'s)
    from ddpkit.cluster.worker import main as _main

    _main()
