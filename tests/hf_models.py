"""Real third-party models as ddpkit Workloads, for the tests (and the command line's
``--model tests.hf_models:gpt2_tiny``): Hugging Face's GPT-2 (tied embeddings) and ResNet
(BatchNorm), tiny configs, built from a config: nothing is downloaded (``HF_HUB_OFFLINE=1``).

Dropout is off (it would draw different masks on each rank and in one process); the data are a
pure function of the step, so every rank and a single process build the same global batch.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny config needs no hub; never reach for it

import torch  # noqa: E402

import ddpkit  # noqa: E402

VOCAB, SEQ = 32, 8


def gpt2_config(layers: int = 4):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=layers, n_head=2,
                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _quiet():
    """transformers' notices (e.g. which loss a config without ``loss_type`` gets) off, errors on."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def _gpt2():
    from transformers import GPT2LMHeadModel

    _quiet()
    return GPT2LMHeadModel(gpt2_config())


def _tokens(step: int, size: int):
    """(size, SEQ) token ids counting up from a random start with a random stride (mod VOCAB)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def _lm_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def gpt2_tiny() -> ddpkit.Workload:
    """GPT2LMHeadModel, 4 blocks of width 16 (lm_head tied to wte), a dict batch as HF takes it."""
    return ddpkit.Workload(model=_gpt2, batch=lambda step, size: {"input_ids": _tokens(step, size)},
                           loss=_lm_loss, name="gpt2-tiny")


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    _quiet()
    return ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                     depths=[1, 1], layer_type="basic", num_labels=4))


def _images(step: int, size: int):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(size, 3, 16, 16, generator=g), torch.randint(0, 4, (size,), generator=g)


def _classify(model, batch):
    pixels, labels = batch
    return model(pixel_values=pixels, labels=labels).loss


def resnet_tiny() -> ddpkit.Workload:
    """ResNetForImageClassification, two stages of BasicBlocks with BatchNorm, 16x16 images."""
    return ddpkit.Workload(model=_resnet, batch=_images, loss=_classify, name="resnet-tiny")


def not_a_workload():
    """For the command line's check: returns something that is not a Workload."""
    return {"model": _gpt2}
