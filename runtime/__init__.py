"""autopartition's runtime: execute a plan on torchrun ranks (GPipe / 1F1B, DDP per stage group)."""

from runtime.pipeline import Pipeline

__all__ = ["Pipeline"]
