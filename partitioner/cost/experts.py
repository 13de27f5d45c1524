"""What expert parallelism costs: the token all-to-alls, the busiest member's share, the experts' state.

With ``ep`` > 1 a stage group's ``dp`` replicas form groups of ``ep`` consecutive
replicas (the plan's contract, :mod:`partitioner.plan`); member ``j`` holds
``E / ep`` experts of every layer.  Per micro-batch and experts layer each GPU:

* **dispatches** its ``T`` tokens' ``k`` chosen rows (``T k H`` elements) to the
  members holding their experts and gets its experts' rows back from the others,
  and **combines** (sends the outputs back) the same amount; backward does both
  again for the gradients: four all-to-alls per layer and micro-batch, none
  overlapped with compute (torchtitan's and Megatron's default dispatchers);
* of each all-to-all it keeps ``1/ep`` (its own experts) and sends ``(ep-1)/ep``:
  to members on its node over NVLink, to the rest over its network port, both at
  once, so the slower of the two sets the time (:func:`all_to_all_seconds`);
* runs its experts on the tokens routed to them: on average what it would run
  alone (``T k`` rows), but the step waits for the busiest member, ``imbalance``
  times the mean (the capacity factor of GShard and Switch; 1 for a perfectly
  balanced router).  Without expert parallelism every replica runs its own tokens
  on its own experts, so the router's imbalance costs nothing.

Expert weights, gradients and optimizer state are divided by ``ep``; their
gradients are all-reduced over the expert-data-parallel group (``dp / ep``
members, ``ep`` replicas apart) instead of the ``dp`` replicas.

Example: DeepSeek-V3's layer (H 7,168, top-8) at 4,096 tokens per GPU in bf16,
EP 64 over 8 nodes of 8 H800s (NVLink 400 GB/s, 50 GB/s per GPU port)::

    >>> from partitioner.cost.comm import Link
    >>> fast, port = Link(400e9, 10e-6), Link(50e9, 15e-6)
    >>> sent = dispatch_bytes(4096, top_k=8, hidden=7168, element_bytes=2)
    >>> round(sent / 2**20, 1), round(all_to_all_seconds(sent, 64, members_per_node=8, intra=fast, inter=port) * 1e3, 2)
    (448.0, 9.06)
"""

from __future__ import annotations

import math

from partitioner.cost.comm import Link

__all__ = [
    "DEFAULT_IMBALANCE",
    "all_to_all_seconds",
    "dispatch_bytes",
    "ep_choices",
    "expert_layer_seconds",
]

# The busiest member's tokens over the mean: GShard's and Switch's training capacity factor (1.25); a router
# balanced by an auxiliary loss or DeepSeek-V3's bias sits near it.  `--expert-imbalance` sets another.
DEFAULT_IMBALANCE = 1.25


def dispatch_bytes(tokens: float, *, top_k: int, hidden: int, element_bytes: float) -> float:
    """Bytes of the rows one GPU routes in one all-to-all: each token once per chosen expert.

    >>> dispatch_bytes(1024, top_k=2, hidden=4096, element_bytes=2) / 2**20
    16.0
    """
    return tokens * top_k * hidden * element_bytes


def all_to_all_seconds(nbytes: float, group: int, *, members_per_node: int, intra: Link, inter: Link) -> float:
    """One all-to-all in which each of ``group`` members spreads ``nbytes`` evenly over all of them.

    A member keeps ``1/group``; the ``m - 1`` others on its node
    (``m = members_per_node``) get theirs over NVLink, the remaining ``group - m``
    over its network port, concurrently, so the slower part sets the time, plus one
    latency per peer on each link (the messages leave one after another).

    >>> fast, port = Link(100e9, 1e-5), Link(10e9, 1e-5)
    >>> all_to_all_seconds(8e9, 1, members_per_node=1, intra=fast, inter=port)
    0.0
    >>> round(all_to_all_seconds(8e9, 8, members_per_node=8, intra=fast, inter=port), 4)  # 7/8 over NVLink
    0.0701
    >>> round(all_to_all_seconds(8e9, 16, members_per_node=8, intra=fast, inter=port), 4)  # half over the port
    0.4001
    """
    if group <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(members_per_node, group))
    on_node = nbytes * (local - 1) / group
    off_node = nbytes * (group - local) / group
    fast = on_node / intra.bandwidth + (local - 1) * intra.latency if local > 1 else 0.0
    slow = off_node / inter.bandwidth + (group - local) * inter.latency if group > local else 0.0
    return max(fast, slow)


def expert_layer_seconds(
    tokens: float,
    *,
    top_k: int,
    hidden: int,
    element_bytes: float,
    ep: int,
    members_per_node: int,
    intra: Link,
    inter: Link,
) -> tuple[float, float]:
    """(forward, backward) all-to-all seconds of one experts layer for one micro-batch of ``tokens`` per GPU.

    Forward dispatches and combines; backward sends both gradients back the same way.

    >>> fast, port = Link(100e9, 0.0), Link(10e9, 0.0)
    >>> expert_layer_seconds(1000, top_k=2, hidden=1000, element_bytes=2, ep=2, members_per_node=2,
    ...                      intra=fast, inter=port)
    (4e-05, 4e-05)
    """
    one = all_to_all_seconds(dispatch_bytes(tokens, top_k=top_k, hidden=hidden, element_bytes=element_bytes),
                             ep, members_per_node=members_per_node, intra=intra, inter=inter)
    return 2 * one, 2 * one


def ep_choices(experts: int, dp: int, *, fixed: int | None, per_node: int | None) -> tuple[int, ...]:
    """Expert-parallel degrees to try for ``dp`` replicas of layers with ``experts`` experts each.

    ``fixed``: that degree alone where it divides both (else none).  Otherwise 1,
    the largest degree inside a node (more members there only cut memory: the
    all-to-all's NVLink share grows from 1/2 to 7/8) and every doubling beyond it
    up to 64 members (DeepSeek-V3's EP 64): past a node each doubling trades the
    experts' memory for network time, which the search weighs.

    >>> ep_choices(256, 512, fixed=None, per_node=8)
    (1, 8, 16, 32, 64)
    >>> ep_choices(8, 6, fixed=None, per_node=8), ep_choices(8, 4, fixed=4, per_node=8), ep_choices(8, 6, fixed=4, per_node=8)
    ((1, 2), (4,), ())
    """
    def allowed(e: int) -> bool:
        return e >= 1 and experts % e == 0 and dp % e == 0

    if fixed is not None:
        return (fixed,) if allowed(fixed) else ()
    divisors = [e for e in range(1, min(experts, dp) + 1) if allowed(e)]
    node = per_node or dp
    inside = max((e for e in divisors if e <= node), default=1)
    beyond = [e for e in divisors if e > inside and e <= max(64, inside) and _doubles(e, inside)]
    return tuple(sorted({1, inside, *beyond}))


def _doubles(e: int, base: int) -> bool:
    """``e`` is ``base`` times a power of two."""
    ratio = e // base
    return e % base == 0 and ratio & (ratio - 1) == 0 and math.log2(ratio) >= 1
