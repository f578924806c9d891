"""ddpkit's DDP wrappers where accelerate and Lightning build torch's: one call, scoped.

    with ddpkit.frameworks.use(ddpkit.OverlappedDDP, bucket_cap_mb=5):
        model, opt, loader = accelerator.prepare(model, opt, loader)      # accelerate (the HF Trainer too)
    with ddpkit.frameworks.use(ddpkit.BucketedDDP):
        trainer.fit(lit_module, loader)                                  # Lightning: Trainer or Fabric

Frameworks build torch's ``DistributedDataParallel`` by a name (torch's own, or the one Lightning's
``strategies/ddp.py`` imported) and check ``isinstance`` against it. ``use`` rebinds those names, for
the block only, to a class made from the wrapper that takes torch's arguments
(``strategies/torch_ddp_surface.py``); the framework's code and configuration are unchanged.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import warnings

import torch

from ddpkit.strategies import BucketedDDP, NaiveDDP, OverlappedDDP
from ddpkit.strategies.torch_ddp_surface import TorchDDPSurface

# Where torch's DistributedDataParallel is looked up when a framework builds or recognises one:
# (module, attribute). torch's two names cover accelerate, the HF Trainer and any module that imports the
# class while the block runs; the others are Lightning's strategy modules, which import it once.
PLACES = (
    ("torch.nn.parallel", "DistributedDataParallel"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
    ("pytorch_lightning.strategies.ddp", "DistributedDataParallel"),   # Trainer's DDPStrategy
    ("lightning_fabric.strategies.ddp", "DistributedDataParallel"),    # Fabric's DDPStrategy
    ("lightning.pytorch.strategies.ddp", "DistributedDataParallel"),   # the same two, in the unified
    ("lightning.fabric.strategies.ddp", "DistributedDataParallel"),    # ``lightning`` package
)
WRAPPERS = (NaiveDDP, BucketedDDP, OverlappedDDP)


@contextlib.contextmanager
def use(wrapper: type, **options):
    """Inside the block, frameworks that build torch's ``DistributedDataParallel`` build ``wrapper`` instead.

    Rebinds torch's ``DistributedDataParallel`` names (``PLACES``) to a subclass of
    ``wrapper`` built with ``options`` and the framework's arguments (a clash: ValueError), and puts
    torch's back on exit; yields the class. Keep the whole training, saving included, in the block.
    It acts in this process only: Lightning's ``strategy="ddp_spawn"`` ranks build torch's."""
    torch_ddp = torch.nn.parallel.distributed.DistributedDataParallel
    if issubclass(torch_ddp, TorchDDPSurface):
        raise RuntimeError("ddpkit.frameworks.use: already inside a use(...) block; one wrapper at a time")
    stand_in = _stand_in(wrapper, options, inspect.signature(torch_ddp))
    _replace(torch_ddp, stand_in)
    try:
        yield stand_in
    finally:
        _replace(stand_in, torch_ddp)
    if not stand_in._built:
        warnings.warn(f"ddpkit.frameworks.use({wrapper.__name__}): no DistributedDataParallel was built in the "
                      "block. The framework did not wrap the model (one process?), or it started its ranks in fresh "
                      "interpreters (Lightning's strategy='ddp_spawn'), which built torch's own: launch them with "
                      "torchrun, or Lightning's strategy='ddp'", stacklevel=3)


def _replace(old: type, new: type) -> None:
    """Each name of ``PLACES`` in an imported module that holds ``old`` now holds ``new``."""
    for module_name, attribute in PLACES:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, attribute, None) is old:
            setattr(module, attribute, new)


def _stand_in(wrapper: type, options: dict, torch_signature: inspect.Signature) -> type:
    """A subclass of ``wrapper`` that a framework can build as it builds torch's DDP."""
    if not (isinstance(wrapper, type) and issubclass(wrapper, WRAPPERS)):
        raise TypeError(f"ddpkit.frameworks.use takes ddpkit's NaiveDDP, BucketedDDP or OverlappedDDP (or a subclass), "
                        f"got {wrapper!r}. ZeRO1/ZeRO2 step their own optimizer (make_optimizer), which a framework "
                        "does not build; FSDP replaces fully_shard, not DistributedDataParallel")
    # the wrapper's own keywords and torch's (which it takes through **torch_ddp): a misspelt one fails here
    known = {n for n, p in inspect.signature(wrapper).parameters.items() if p.kind is not p.VAR_KEYWORD}
    unknown = sorted(options.keys() - known - set(torch_signature.parameters) - {"module"})
    if unknown:
        raise TypeError(f"ddpkit.frameworks.use({wrapper.__name__}): unexpected option(s) {', '.join(unknown)}")
    # the surface is part of ddpkit's wrappers once the torch-compatibility layer includes it
    bases = (wrapper,) if issubclass(wrapper, TorchDDPSurface) else (TorchDDPSurface, wrapper)

    class StandIn(*bases):
        _built = 0

        def __init__(self, *args, **kwargs):
            # torch's arguments in torch's order (DistributedDataParallel(model, [0]) means device_ids=[0]);
            # an argument torch does not take is torch's TypeError
            given = torch_signature.bind(*args, **kwargs).arguments
            module = given.pop("module")
            clash = sorted(k for k in given.keys() & options.keys() if given[k] != options[k])
            if clash:
                raise ValueError(f"ddpkit.frameworks.use({wrapper.__name__}): the framework passes "
                                 + ", ".join(f"{k}={given[k]!r}" for k in clash) + " and the block "
                                 + ", ".join(f"{k}={options[k]!r}" for k in clash) + ": give it in one place")
            super().__init__(module, **{**given, **options})
            StandIn._built += 1

    StandIn.__name__ = StandIn.__qualname__ = wrapper.__name__  # ddpkit's messages name the wrapper
    return StandIn
