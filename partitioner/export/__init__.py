"""Export: a plan in the terms of another training framework, for people who keep their own trainer.

Takes a :class:`~partitioner.plan.Plan`; gives that framework's settings and, for
each thing the framework cannot express, a note naming the nearest setting it
can.  :mod:`~partitioner.export.blocks` turns the plan's stages into whole
top-level blocks (what every framework's pipeline split keeps whole), placed by
parameter counts; :mod:`~partitioner.export.torchtitan` writes torchtitan 0.3's
command line and the same settings as ``[parallelism]``, ``[training]`` and
``[activation_checkpoint]`` TOML; :mod:`~partitioner.export.megatron` writes
Megatron-LM's arguments and a Megatron-Bridge recipe override (YAML).
docs/exports.md says what each maps and what it cannot.

May import: ``plan``, ``orders``, ``defaults``, ``errors``, ``units`` (and ``report``);
never ``search`` or ``cli``.  Imports no torch, no torchtitan and no megatron: it
writes text.  The one exception is :mod:`~partitioner.export.sizes`, which, when
called, builds the plan's model on the meta device (torch, ``modelfile``) for the
parameter sizes plan.json does not record.
"""

__all__: list[str] = []
