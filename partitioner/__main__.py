"""``python -m partitioner``: the ``autopartition`` command line."""

from partitioner.cli import main

__all__: list[str] = []

raise SystemExit(main())
