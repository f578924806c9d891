"""The default MLP learns its teacher task, with the same parameter tensors the lessons count."""
from __future__ import annotations

import math

import pytest

from ddpkit.experiment import make_optimizer
from ddpkit.models import build_model, loss_fn, make_batch


def test_the_default_mlp_keeps_its_tensors_shapes_and_bytes():
    model = build_model("mlp")
    params = list(model.named_parameters())
    assert len(params) == 66  # 32 x (weight, bias) + the head's
    assert [tuple(p.shape) for _, p in params[:2]] == [(256, 256), (256,)]
    assert params[0][0] == "layers.0.0.weight" and params[-1][0] == "head.bias"
    assert all(tuple(p.shape) in ((256, 256), (256,)) for _, p in params[:-2])
    numel = sum(p.numel() for _, p in params)
    assert numel == 32 * (256 * 256 + 256) + 256 * 10 + 10 == 2_107_914
    assert sum(m.__class__.__name__ == "Linear" for m in model.modules()) == 33


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_default_mlp_learns(optimizer):
    """The plain 32-layer stack this replaced stayed at ln 10 = 2.30 for 300 steps; the
    residual one falls clearly within 120 (global batch 32, the course's optimizers)."""
    model = build_model("mlp")
    opt = make_optimizer(model.parameters(), optimizer)
    losses = []
    for step in range(120):
        x, y = make_batch(model, 32, step)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert first == pytest.approx(math.log(10), abs=0.4), losses[:5]
    assert last < 0.75 * math.log(10), f"{optimizer}: first {first:.2f}, last 10 steps {last:.2f}"
