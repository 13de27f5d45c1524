"""``user_moe_routed.py`` built on the meta device, with ``init_weights`` (expert parallelism of a meta model)."""

import torch
from torch import nn
from user_moe_routed import MoENet, example_inputs, example_target, loss_fn

__all__ = ["build_model", "example_inputs", "example_target", "init_weights", "loss_fn"]


def build_model() -> nn.Module:
    with torch.device("meta"):
        return MoENet()


def init_weights(module: nn.Module, name: str) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.2)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
