"""Models and synthetic data for the course and the benchmarks.

Two models, both small enough for a laptop CPU:
- ``MLP``: ``depth`` residual Linear(width, width) + ReLU blocks and a Linear head. The default
  (width 256, depth 32) has 66 parameter tensors and 2.1 M parameters (8.04 MiB in fp32):
  many same-sized layers, so bucketing and overlap have something to work with.
- ``TinyGPT``: a GPT-style decoder (token + position embeddings, pre-norm blocks with causal
  self-attention and an MLP, a head tied to the token embedding). It exercises tied
  parameters, LayerNorm and attention.

The data have learnable structure, so the loss goes down and "equal to one process" is
checked on a run that actually trains. Batches are a pure function of (seed, step): every
rank can build the *global* batch and take its own slice, and a single process can build
the same global batch to compare against.
"""
from __future__ import annotations

import inspect
import math

import torch
from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``depth`` residual blocks ``x + relu(Linear(x)) / depth`` of size ``width``, then a Linear
    head to ``classes``.

    Why residual: a plain stack of 32 Linear+ReLU layers at torch's default initialisation
    shrinks the signal about 6x in variance per layer (weights of variance 1/(3 * width), half
    the units cut by ReLU), so after 32 layers the head sees almost nothing, the gradients of
    the early layers vanish, and the loss sits at ln 10 = 2.30 for hundreds of steps. With an
    identity path around each block the input reaches the head whatever the depth; dividing
    each block's output by ``depth`` keeps the sum of 32 blocks at the input's scale (SGD with
    momentum diverged without it). The parameters are the same tensors as the plain stack's
    (names ``layers.i.0.weight``, shapes, bytes), so every lesson on buckets and bytes holds.
    """

    def __init__(self, width: int = 256, depth: int = 32, classes: int = 10):
        super().__init__()
        if width < 1 or depth < 1 or classes < 1:
            raise ValueError(f"MLP needs width, depth, classes >= 1, got {width}, {depth}, {classes}")
        self.width = width
        self.layers = Residual(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):  # x: (batch, width) -> logits (batch, classes)
        return self.head(self.layers(x))


class Residual(nn.Sequential):
    """Blocks in sequence, each added to its input: ``x = x + block(x) / len(self)``.

    A Sequential, so parameter names (``layers.3.0.weight``) and the wrappers' view of the model
    (FSDP units, hooks on ``layers``' forward) are those of a plain stack."""

    def forward(self, x):  # (batch, width) -> (batch, width)
        scale = 1.0 / len(self)
        for block in self:  # block = Sequential(Linear, ReLU)
            x = x + block(x) * scale
        return x


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # x: (batch, seq, dim)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # (batch, heads, seq, dim/heads) for each of q, k, v
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model; ``head.weight`` is tied to ``tok.weight``."""

    def __init__(self, vocab: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        if dim % heads:
            raise ValueError(f"TinyGPT needs dim divisible by heads, got dim={dim}, heads={heads}")
        self.vocab, self.seq = vocab, seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, used twice

    def forward(self, idx):  # idx: (batch, seq) token ids -> logits (batch, seq, vocab)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln(self.blocks(x)))


# The models by name (the command line's --model, experiments, notebooks), and what each calls
# its width and depth (--width / --depth): an MLP's width and depth, TinyGPT's dim and layers.
MODELS = {"mlp": MLP, "gpt": TinyGPT}
_SIZE_NAMES = {"mlp": ("width", "depth"), "gpt": ("dim", "layers")}


def build_model(name: str = "mlp", seed: int = 0, **kwargs) -> nn.Module:
    """A freshly initialised model, the same for the same seed on every process."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](**kwargs)


def size_kwargs(name: str, width: int | None = None, depth: int | None = None) -> dict:
    """``width`` and ``depth`` in model ``name``'s own keywords (MLP: width, depth; TinyGPT: dim,
    layers), leaving out what is None (the model's default)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    return {k: v for k, v in zip(_SIZE_NAMES[name], (width, depth), strict=True) if v is not None}


def model_config(name: str, **kwargs) -> dict:
    """Model ``name``'s constructor keywords with its defaults filled in (e.g. ``{"width": 256,
    "depth": 32, "classes": 10}``): what its synthetic data depend on. TypeError for a keyword the
    model does not take."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    try:
        bound = inspect.signature(MODELS[name]).bind(**kwargs)
    except TypeError as exc:
        raise TypeError(f"model {name!r}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def make_batch(model: nn.Module, batch_size: int, step: int, seed: int = 0):
    """The global batch number ``step``: (inputs, targets), a pure function of its arguments.

    MLP: inputs x ~ N(0, 1); the target class is argmax of a fixed random linear "teacher"
    applied to x, so there is a rule to learn. TinyGPT: each sequence counts up from a random
    start with a random stride (mod vocab), so the next token is predictable from the last two.
    """
    if isinstance(model, TinyGPT):
        return synthetic_batch("gpt", step, batch_size, seed, vocab=model.vocab, seq=model.seq)
    if not isinstance(model, MLP):
        raise TypeError(f"make_batch knows MLP and TinyGPT, got {type(model).__name__} (pass the unwrapped model)")
    return synthetic_batch("mlp", step, batch_size, seed, width=model.width)


def synthetic_batch(name: str, step: int, batch_size: int, seed: int = 0, **config):
    """``make_batch`` for model ``name`` of this ``config`` (``model_config``'s keywords; the
    data read only ``width``, or ``vocab`` and ``seq``): what ``Workload.builtin``'s batch calls."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if name == "gpt":
        vocab, seq = config["vocab"], config["seq"]
        start = torch.randint(0, vocab, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        return tokens[:, :-1], tokens[:, 1:]
    width = config["width"]
    teacher = torch.randn(width, 10, generator=torch.Generator().manual_seed(seed)) / math.sqrt(width)
    x = torch.randn(batch_size, width, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def loss_fn(logits, targets):
    """Mean cross-entropy over every position (works for (B, C) and (B, T, C) logits)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def supervised_loss(model, batch):
    """A built-in workload's loss: ``loss_fn(model(inputs), targets)`` for ``batch = (inputs, targets)``."""
    inputs, targets = batch
    return loss_fn(model(inputs), targets)
