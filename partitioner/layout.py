"""The layout: every parallel degree a named axis of one object, and every rank and rank group read from it.

One :class:`Layout` owns the degrees of a plan (torch-free, checked once when made) and is
the only place that turns coordinates into global ranks and back, as torchtitan's
``ParallelDims`` and Megatron's ``RankGenerator`` do.  The runtime builds every process
group and mesh from :meth:`Layout.ranks`, :meth:`Layout.groups` and :meth:`Layout.mesh`;
nothing else writes rank arithmetic (``tests/test_layout.py`` greps for it).

Global ranks are mixed-radix numbers over the *rank axes*, outermost first::

    pp  (pipeline rank)  >  dp  (replica)  >  cp  (context)  >  tp  (tensor)

so a tensor-parallel group is ``tp`` consecutive ranks, a pipeline rank's replicas are
consecutive groups of ``cp x tp``, and (with ``cp = 1``) the rank is ``(p x dp + r) x tp + t``,
the order plans have always used.  Some axes are *parts* of another: the replicas factor two
ways, into ``edp x ep`` (expert parallelism: ``ep`` consecutive replicas exchange tokens,
every ``ep``-th replica holds the same experts) and into ``dp_replicate x dp_shard`` (HSDP:
``dp_shard`` consecutive replicas shard their state, the outer ``dp_replicate`` copies it).
``chunks`` (virtual stages per pipeline rank) is a degree but no rank axis.

>>> layout = Layout(pp=2, dp=4, tp=2, ep=2)
>>> layout.world
16
>>> layout.coords(13)
{'pp': 1, 'dp': 2, 'cp': 0, 'tp': 1, 'edp': 1, 'ep': 0, 'dp_replicate': 0, 'dp_shard': 2}
>>> layout.ranks("ep", at=13), layout.ranks("tp", at=13), layout.ranks("pp", at=13)
((13, 15), (12, 13), (5, 13))
>>> layout.group(13)  # the tensor-parallel group's index: what a stage's ``ranks`` lists
6
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["AXES", "PARTS", "RANK_AXES", "Layout"]

# The rank axes, outermost first: a global rank is a mixed-radix number over them.
RANK_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")

# Axes that are a factor of a rank axis: name -> (rank axis, inner). The inner part of a factorisation
# holds consecutive coordinates (its stride is 1); the outer part steps by the inner's size.
PARTS: dict[str, tuple[str, bool]] = {
    "edp": ("dp", False), "ep": ("dp", True),
    "dp_replicate": ("dp", False), "dp_shard": ("dp", True),
}

AXES: tuple[str, ...] = (*RANK_AXES, *PARTS)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every parallel degree of a plan, checked once; global ranks and their groups by axis name.

    Args:
        pp: pipeline ranks per replica.
        dp: replicas of each pipeline rank (data parallelism, sharded or not).
        cp: ranks splitting each attention's sequence (context parallelism).
        tp: ranks splitting each layer (tensor parallelism).
        ep: consecutive replicas exchanging tokens of each experts layer; divides ``dp``.
        dp_shard: consecutive replicas sharding their state (HSDP's shard span); divides ``dp``.
            ``dp`` (the default, 0 meaning "all of them") shards over every replica.
        chunks: stages per pipeline rank (virtual stages: interleaved 1F1B, ZB-V).

    Raises:
        ValueError: a degree below 1, or ``ep`` / ``dp_shard`` not dividing ``dp``.

    >>> Layout(pp=2, dp=3, ep=2)
    Traceback (most recent call last):
    ...
    ValueError: layout ep=2 must divide dp=3: expert-parallel groups are whole sets of replicas; choose an ep that divides dp
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    dp_shard: int = 0
    chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "cp", "tp", "ep", "chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {name}={value!r}: every degree is a whole number of at least 1")
        if not isinstance(self.dp_shard, int) or self.dp_shard < 0:
            raise ValueError(f"layout dp_shard={self.dp_shard!r}: expected 0 (every replica) or a divisor of dp")
        if self.dp % self.ep:
            raise ValueError(f"layout ep={self.ep} must divide dp={self.dp}: expert-parallel groups are whole sets of "
                             "replicas; choose an ep that divides dp")
        if self.dp % self.shards:
            raise ValueError(f"layout dp_shard={self.dp_shard} must divide dp={self.dp}: a shard group is a whole set "
                             "of replicas; choose a span that divides dp")

    @property
    def shards(self) -> int:
        """Replicas per shard group (``dp_shard``, 0 read as every replica)."""
        return self.dp_shard or self.dp

    @property
    def world(self) -> int:
        """Global ranks: the product of the rank axes."""
        return self.pp * self.dp * self.cp * self.tp

    def size(self, axis: str) -> int:
        """How many coordinates ``axis`` has.

        >>> Layout(dp=8, ep=2, dp_shard=4).size("edp"), Layout(dp=8, dp_shard=4).size("dp_replicate")
        (4, 2)
        """
        if axis in RANK_AXES:
            return int(getattr(self, axis))
        _, inner = _part(axis)
        size = self.ep if _is_expert(axis) else self.shards
        return size if inner else self.dp // size

    @functools.cached_property
    def _strides(self) -> dict[str, int]:
        """The rank step between neighbours along each axis (made once: the runtime asks per group)."""
        out = {a: _product(self.size(b) for b in RANK_AXES[RANK_AXES.index(a) + 1:]) for a in RANK_AXES}
        for axis, (base, inner) in PARTS.items():
            out[axis] = out[base] * (1 if inner else (self.ep if _is_expert(axis) else self.shards))
        return out

    def _stride(self, axis: str) -> int:
        return self._strides[axis]

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is outside the layout's {self.world} ranks "
                             f"(pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp})")

    def coord(self, rank: int, axis: str) -> int:
        """``rank``'s coordinate along ``axis``.

        >>> Layout(pp=2, dp=2, tp=2).coord(6, "dp")
        1
        """
        self._check_rank(rank)
        return (rank // self._stride(axis)) % self.size(_known(axis))

    def coords(self, rank: int) -> dict[str, int]:
        """Every axis' coordinate of ``rank`` (the parts of ``dp`` too)."""
        return {axis: self.coord(rank, axis) for axis in AXES}

    def rank(self, **coords: int) -> int:
        """The global rank at ``coords`` (rank axes, or parts of ``dp`` in place of ``dp``); missing axes are 0.

        >>> Layout(pp=2, dp=4, tp=2, ep=2).rank(pp=1, edp=1, ep=1, tp=1)
        15
        """
        _disjoint(tuple(coords))
        total = 0
        for axis, value in coords.items():
            if not 0 <= value < self.size(_known(axis)):
                raise ValueError(f"{axis}={value} is outside 0 .. {self.size(axis) - 1}")
            total += value * self._stride(axis)
        return total

    def moved(self, rank: int, **coords: int) -> int:
        """``rank`` with some coordinates replaced: its peer at another pipeline rank, replica, ...

        >>> Layout(pp=2, dp=2, tp=2).moved(5, pp=0)  # pp 1, replica 0, tp 1 -> its peer on pipeline rank 0
        1
        """
        self._check_rank(rank)
        _disjoint(tuple(coords))
        for axis, value in coords.items():
            if not 0 <= value < self.size(_known(axis)):
                raise ValueError(f"{axis}={value} is outside 0 .. {self.size(axis) - 1}")
            rank += (value - self.coord(rank, axis)) * self._stride(axis)
        return rank

    def ranks(self, axes: str | Sequence[str], *, at: int) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``at`` except those of ``axes``, the first axis outermost.

        >>> Layout(pp=2, dp=2, tp=2).ranks(("dp", "tp"), at=5)
        (4, 5, 6, 7)
        """
        names = _axes(axes)
        self._check_rank(at)
        base = self.moved(at, **{a: 0 for a in names})
        steps = [[i * self._stride(a) for i in range(self.size(a))] for a in names]
        return tuple(base + sum(offsets) for offsets in itertools.product(*steps))

    def line(self, axis: str, *, at: int) -> range:
        """:meth:`ranks` along one axis as a ``range`` (no list built: the cost model walks wide replica groups).

        >>> Layout(pp=2, dp=3, tp=2).line("dp", at=7)
        range(7, 13, 2)
        """
        start = self.moved(at, **{_known(axis): 0})
        stride = self._stride(axis)
        return range(start, start + self.size(axis) * stride, stride)

    def groups(self, axes: str | Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Every group of ``axes`` (:meth:`ranks`), by its first rank: the order every rank creates them in.

        >>> Layout(pp=2, dp=2).groups("pp")
        ((0, 2), (1, 3))
        """
        names = _axes(axes)
        return tuple(self.ranks(names, at=rank) for rank in range(self.world)
                     if all(self.coord(rank, a) == 0 for a in names))

    def mesh(self, axes: Sequence[str], *, at: int) -> list[list[int]]:
        """``at``'s 2-D grid over two axes: a row per coordinate of the first, a column per the second.

        >>> Layout(dp=4, dp_shard=2).mesh(("dp_replicate", "dp_shard"), at=3)
        [[0, 1], [2, 3]]
        """
        if len(axes) != 2:
            raise ValueError(f"mesh takes two axes, got {list(axes)}")
        flat = self.ranks(axes, at=at)
        width = self.size(_known(axes[1]))
        return [list(flat[i:i + width]) for i in range(0, len(flat), width)]

    def meshes(self, axes: Sequence[str]) -> Iterator[list[list[int]]]:
        """Every grid of :meth:`mesh`, in :meth:`groups`' order."""
        for group in self.groups(axes):
            yield self.mesh(axes, at=group[0])

    def shape(self, axes: Sequence[str]) -> tuple[int, ...]:
        """The sizes of ``axes`` for one mesh over every rank (``init_device_mesh``); they must cover the world
        in rank order, outermost first.

        >>> Layout(pp=2, dp=4, tp=2, dp_shard=2).shape(("pp", "dp_replicate", "dp_shard", "tp"))
        (2, 2, 2, 2)
        """
        names = _axes(axes)
        strides = [self._stride(a) for a in names]
        sizes = [self.size(a) for a in names]
        covered = all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(len(names) - 1))
        if not names or not covered or strides[-1] != 1 or sizes[0] * strides[0] != self.world:
            raise ValueError(f"axes {list(names)} do not cover the layout's ranks in order; name them outermost first, "
                             f"every rank axis of size above 1 or its parts ({', '.join(RANK_AXES)})")
        return tuple(sizes)

    def group(self, rank: int) -> int:
        """The index of ``rank``'s tensor-parallel group (every rank axis but ``tp``): a stage's ``ranks`` entry.

        >>> [Layout(pp=2, dp=2, tp=2).group(r) for r in range(8)]
        [0, 0, 1, 1, 2, 2, 3, 3]
        """
        self._check_rank(rank)
        return rank // self.tp

    def stage_groups(self, pipeline_rank: int) -> tuple[int, ...]:
        """The tensor-parallel group of each replica of ``pipeline_rank`` (a stage's ``ranks``, cp = 1).

        >>> Layout(pp=2, dp=3).stage_groups(1)
        (3, 4, 5)
        """
        return tuple(self.group(rank) for rank in self.line("dp", at=self.rank(pp=pipeline_rank)))


def _is_expert(axis: str) -> bool:
    """Whether ``axis`` is a part of the expert factoring of dp (else of the sharding one)."""
    return axis in ("ep", "edp")


def _part(axis: str) -> tuple[str, bool]:
    found = PARTS.get(axis)
    if found is None:
        raise ValueError(f"axis {axis!r} is not a part of another; axes are {', '.join(AXES)}")
    return found


def _known(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; axes are {', '.join(AXES)}")
    return axis


def _axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        _known(a)
    _disjoint(names)
    return names


def _disjoint(names: tuple[str, ...]) -> None:
    """Axes named together must not overlap: dp once, or one factoring of it (edp/ep or dp_replicate/dp_shard)."""
    ways = {"dp" if a == "dp" else ("ep" if _is_expert(a) else "shard") for a in names if a == "dp" or a in PARTS}
    if len(ways) > 1 or len(set(names)) != len(names):
        raise ValueError(f"axes {list(names)} overlap: name dp once, or one factoring of it (edp and ep, or "
                         "dp_replicate and dp_shard)")


def _product(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out
