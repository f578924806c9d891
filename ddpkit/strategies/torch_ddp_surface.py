"""What torch's ``DistributedDataParallel`` shows the frameworks, on ddpkit's DDP wrappers.

accelerate (so the HF Trainer) and Lightning read or call more of torch's DDP than a script does;
``TorchDDPSurface`` answers each with torch's meaning, or refuses it naming what to do instead (who
touches what: ``docs/own_script.md``, "In the frameworks"; ``ddpkit.frameworks.use`` swaps it in).

    static_graph, _set_static_graph()   torch's flag (accepted, changes nothing here: torch_ddp_args.py)
    require_forward_param_sync          the last forward synchronised, so the next broadcasts buffers
    reducer.prepare_for_backward(...)   the next backward synchronises (accelerate, Lightning)
    reducer._rebuild_buckets()          False: ours never rebuilds
    reducer._delay_all_reduce()         reduce what is pending now (Lightning, static graph)
    _get_ddp_logging_data()             torch's keys: world size, backend, bucket sizes, ...
    register_comm_hook(state, hook)     torch's default hooks mapped onto ours; any other refused
    _ddp_params_and_buffers_to_ignore   refused: every trainable parameter is reduced here

It reads the DDP core's state: it is a base of ``ddp_compat.TorchDDPCompat``.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch.distributed as dist
from torch import nn

from ddpkit.strategies.buckets import bucket_cap_bytes
from ddpkit.strategies.comm_hooks import COMM_HOOKS

# torch's default hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks) and ddpkit's hook of
# the same meaning (comm_hooks.COMM_HOOKS): torch divides the bucket by the world size and then sums,
# ours gets the bucket already divided; both cast to 16 bits before the sum, where they cast
TORCH_DEFAULT_HOOKS = {"allreduce_hook": "allreduce", "fp16_compress_hook": "fp16_compress",
                       "bf16_compress_hook": "bf16_compress"}


class TorchDDPSurface:
    """torch DDP's attributes that accelerate and Lightning read, for a ddpkit DDP wrapper."""

    def __init__(self, module, *args, **kwargs):
        ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
        if ignored:  # torch's DDP neither broadcasts nor reduces these; ours would, silently
            raise ValueError(
                f"{type(self).__name__}: the module names parameters and buffers for torch's DDP to ignore "
                f"(_ddp_params_and_buffers_to_ignore: {', '.join(sorted(ignored)[:5])}); ddpkit's wrappers broadcast "
                "and reduce every trainable parameter. Wrap only the part to keep in step, or leave them out "
                "of the attribute")
        super().__init__(module, *args, **kwargs)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """torch's way to name that attribute: refused here, at once (see ``__init__``)."""
        raise ValueError("_set_params_and_buffers_to_ignore_for_model: ddpkit's DDP wrappers broadcast and reduce "
                         "every trainable parameter; wrap only the part to keep in step instead")

    # ------------------------------------------------------------------ flags
    @property
    def static_graph(self) -> bool:
        """torch's ``static_graph`` (accepted: buckets are never rebuilt, a missing gradient handled every step)."""
        return self.torch_args.static_graph

    def _set_static_graph(self) -> None:
        """torch's private setter of ``static_graph`` (the constructor's argument is the public way)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.torch_args = dataclasses.replace(self.torch_args, static_graph=True)

    @property
    def require_forward_param_sync(self) -> bool:
        """torch's: the last training forward synchronised, so the next broadcasts rank 0's buffers."""
        return self._sync_buffers_next

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self._sync_buffers_next = bool(value)

    @property
    def reducer(self) -> _Reducer:
        """What the frameworks call on torch's C++ reducer; anything else is refused by name."""
        return _Reducer(self)

    # ------------------------------------------------------------------ logging data
    def _get_ddp_logging_data(self) -> dict:
        """torch's construction-time logging data, its keys with this wrapper's values (Lightning reads it)."""
        params = [p for _, p in self.named_grads]
        if self.buckets:  # in the order they fill, as torch lists them
            sizes = [b.nbytes for b in self.buckets]
            cap = bucket_cap_bytes(self.bucket_cap_mb)
        else:  # NaiveDDP: every gradient its own "bucket", torch's bucket_cap_mb=0
            sizes, cap = [p.numel() * p.element_size() for p in params], 0
        device = self.torch_args.device
        data = {
            "module_name": type(self.module).__name__,
            "world_size": self.world_size,
            "rank": dist.get_rank(self.process_group),
            "backend_name": dist.get_backend(self.process_group),
            "device_ids": "" if device is None else str(device.index),
            "output_device": -1 if self.torch_args.output_device is None else self.torch_args.output_device,
            "broadcast_buffers": int(self.torch_args.forward_sync_buffers),
            "bucket_cap_bytes": int(cap) if cap != float("inf") else -1,
            "bucket_sizes": ", ".join(str(s) for s in sizes),
            "dtypes": ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(bool(getattr(self, "gradient_as_bucket_view", False))),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        }
        if self.static_graph:
            data["static_graph"] = 1
        if self._comm_hook is not None:  # torch: the hook function's name; here its name in COMM_HOOKS
            data["comm_hook"] = next((name for name, h in COMM_HOOKS.items() if h.hook is self._comm_hook),
                                     getattr(self._comm_hook, "__qualname__", type(self._comm_hook).__name__))
        return data

    # ------------------------------------------------------------------ communication hooks
    def register_comm_hook(self, *args, **kwargs) -> None:
        """ddpkit's ``register_comm_hook(hook)`` (a ``comm_hooks.py`` hook or name), or torch's
        ``(state, hook)``: its allreduce, fp16 and bf16 hooks become ours; any other is refused."""
        if "state" not in kwargs and len(args) + len(kwargs) == 1:
            return self._register_hook(*args, **kwargs)  # ddpkit's own form
        try:
            state, hook = _bind_torch_form(*args, **kwargs)
        except TypeError:
            raise TypeError(f"{type(self).__name__}.register_comm_hook takes ddpkit's (hook) or torch's (state, "
                            f"hook), got {len(args)} positional and {sorted(kwargs)} keyword arguments") from None
        name = _ddpkit_name_of(hook)
        if name is None:
            what = getattr(hook, "__qualname__", type(hook).__name__)
            raise ValueError(
                f"{type(self).__name__}.register_comm_hook: torch's hook {what!r} has no ddpkit counterpart. "
                "ddpkit reduces a bucket with hook(bucket, process_group, recorder); torch's "
                f"{', '.join(TORCH_DEFAULT_HOOKS)} map onto ddpkit's {', '.join(TORCH_DEFAULT_HOOKS.values())}. "
                "Leave the hook out (accelerate: DistributedDataParallelKwargs(comm_hook=...); Lightning: "
                "DDPStrategy(ddp_comm_hook=...)), pick one of those, or write one as in ddpkit.strategies.comm_hooks")
        group = dist.group.WORLD if self.process_group is None else self.process_group
        if state is not None and state is not group:  # torch's default hooks: the state is the group
            raise ValueError(f"{type(self).__name__}.register_comm_hook: torch's {hook.__name__} with state="
                             f"{state!r} reduces over that process group; ddpkit's hooks reduce over the wrapper's "
                             "own (its process_group=): give state=None")
        return self._register_hook(name)


def _bind_torch_form(state, hook):
    """torch's signature ``register_comm_hook(state, hook)``: a TypeError unless the call fits it."""
    return state, hook


def _ddpkit_name_of(hook) -> str | None:
    """The name in ``comm_hooks.COMM_HOOKS`` of the hook that means what torch's ``hook`` means, or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return next((ours for theirs, ours in TORCH_DEFAULT_HOOKS.items() if hook is getattr(default_hooks, theirs)), None)


class _Reducer:
    """``wrapper.reducer``: the calls accelerate and Lightning make on torch's C++ reducer, with its meaning."""

    def __init__(self, ddp):
        self._ddp = ddp

    def prepare_for_backward(self, outputs=()) -> None:
        """torch's: the next backward synchronises (accelerate's ``trigger_sync_in_backward``, Lightning)."""
        self._ddp._start_step(sync=True)

    def _rebuild_buckets(self) -> bool:
        """torch's: rebuild the buckets once, in the order gradients arrived; False: ours never rebuild."""
        return False

    def _delay_all_reduce(self) -> None:
        """torch's (static graph, first step): reduce every gradient now; here what is still pending."""
        self._ddp.finish_gradient_synchronization()

    def __getattr__(self, name: str):
        raise AttributeError(
            f"{type(self._ddp).__name__}.reducer.{name}: ddpkit's DDP wrappers have no C++ reducer; it answers "
            "prepare_for_backward, _rebuild_buckets and _delay_all_reduce (what accelerate and Lightning call). "
            "Use the wrapper's own: finish_gradient_synchronization(), no_sync(), require_backward_grad_sync, buckets")
