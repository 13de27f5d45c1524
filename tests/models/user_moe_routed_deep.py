"""user_moe_routed.py with eight MoE layers: four stages of two layers each cut between layers (interleaved tests)."""

from torch import nn
from user_moe_routed import MoELayer, MoENet, example_inputs, example_target, loss_fn

__all__ = ["build_model", "example_inputs", "example_target", "loss_fn"]

LAYERS = 8


def build_model() -> MoENet:
    import torch

    torch.manual_seed(0)
    model = MoENet()
    model.layers = nn.Sequential(*(MoELayer() for _ in range(LAYERS)))
    return model
