"""Export: a plan in the terms of another training framework, for people who keep their own trainer.

Takes a :class:`~partitioner.plan.Plan`; gives that framework's settings and, for
each thing the framework cannot express, a note naming the nearest setting it
can.  :mod:`~partitioner.export.torchtitan` writes torchtitan's ``[parallelism]``,
``[training]`` and ``[activation_checkpoint]`` sections (TOML) and the same as
torchtitan 0.3's command-line flags.

May import: ``plan``, ``orders``, ``defaults``, ``errors``, ``units`` (and ``report``);
never ``search`` or ``cli``.  Imports no torch and no torchtitan: it writes text.
"""

__all__: list[str] = []
