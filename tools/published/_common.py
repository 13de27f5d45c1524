"""Helpers the source modules share: layouts and shapes."""

from __future__ import annotations

from typing import Any

from tools.published.run import ModelShape
from tools.published_models import SHAPES

__all__ = ["gpt_shape", "layout", "llama_shape"]

# ZeRO-2 is priced as ZeRO-1; ZeRO-3 (DeepSpeed stage 3, FSDP FULL_SHARD) reshards after every forward.
_SHARD = {0: "none", 1: "optimizer", 2: "optimizer", 3: "zero3"}


def layout(name: str, *, tp: int, pp: int, dp: int, microbatches: int, schedule: str = "1f1b",
           chunks: int | None = None, zero: int = 0, recompute: str = "full", ep: int = 1) -> dict[str, Any]:
    """:class:`partitioner.search.price.Layout` keywords (``gpus`` aside) for a published layout.

    ``ep``: the expert-parallel degree over the ``dp`` replicas (left out at 1, as for dense models).

    >>> layout("x", tp=8, pp=1, dp=4, microbatches=2, zero=2)["shard"]
    'optimizer'
    >>> layout("x", tp=2, pp=8, dp=16, microbatches=128, ep=16)["ep"]
    16
    """
    out: dict[str, Any] = {"name": name, "tp": tp, "pp": pp, "dp": dp, "microbatches": microbatches,
                           "schedule": schedule, "shard": _SHARD[zero], "recompute": recompute}
    if chunks is not None:
        out["chunks"] = chunks
    if ep != 1:
        out["ep"] = ep
    return out


def gpt_shape(name: str, seq: int | None = None) -> ModelShape:
    """The :class:`ModelShape` of ``tools/published_models.py``'s shape ``name``."""
    s = SHAPES[name]
    return ModelShape(layers=s.layers, hidden=s.hidden, heads=s.heads, kv_heads=s.heads, ffn=s.ffn_width,
                      vocab=s.vocab, seq=seq or s.seq)


# Llama 3 paper (arXiv:2407.21783), Table 3; vocabulary 128,256 as released (examples/llama.py).
_LLAMA = {"8b": (32, 4096, 32, 8, 14336), "70b": (80, 8192, 64, 8, 28672), "405b": (126, 16384, 128, 8, 53248)}


def llama_shape(size: str, seq: int) -> ModelShape:
    layers, hidden, heads, kv, ffn = _LLAMA[size]
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=128256, seq=seq)
