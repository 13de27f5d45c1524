"""A model fuzzer: random valid models from a grammar of patterns, planned under random layouts, verified.

In the spirit of NNSmith (Liu et al., ASPLOS 2023: valid models generated from small
operator specifications, checked by differential testing): :mod:`tools.fuzz.grammar`
draws a :class:`~tools.fuzz.grammar.ModelSpec` and a :class:`~tools.fuzz.grammar.Layout`
from a seed, :mod:`tools.fuzz.build` renders the spec as a standalone model file,
:mod:`tools.fuzz.run` plans it and verifies the plan on CPU ranks against the
unpartitioned model (``runtime.verify``), and :mod:`tools.fuzz.reduce` shrinks a
failing case.  The command line is ``tools/fuzz_models.py``::

    .venv/bin/python tools/fuzz_models.py --seeds 0:100 --out fuzz-out
"""

__all__ = ["build", "grammar", "reduce", "run"]
