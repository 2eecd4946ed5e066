"""Which engine gets the next request: the policies, as functions of what the coordinator knows.

* ``round-robin``: request k goes to the k-th routable engine in turn (reproducible);
* ``least-outstanding``: fewest outstanding requests relative to capacity;
* ``prefix-aware`` (the default): the cost of sending a request to an engine is, in prompt
  tokens, what it would have to prefill (those its cache does not hold, from the prefix index),
  plus the prefill already queued there (uncached tokens of requests sent to it that have not
  produced a token yet), plus ``request_cost_tokens`` per request in flight there (decoding
  ones slow every step a little) — NVIDIA Dynamo's KV-router cost (prefill blocks + active
  load), plus the wait for a slot where the engine already holds as many requests as it
  decodes together (each request ahead priced at that engine's measured pace,
  ``engine_pace``: on a slow engine one more request queued is seconds of prefill), plus
  ``eviction_cost`` per token it would have to evict to store the uncached part (beyond the
  engine's empty blocks, as its last heartbeat reported them, less the prefill already sent
  there): on a warm, full pool a miss also costs a cached prefix that later requests would
  have found, so a busy engine that holds the prefix is not given up for an idle one as
  readily. The cheapest wins. A hot-spot guard passes over an engine with far more
  outstanding requests than the least busy one, so even one very popular prefix spreads over
  every engine (each then caches it too). A request for a LoRA adapter also costs
  ``adapter_load_cost_tokens`` on an engine that does not hold the adapter in a slot (it must
  read it from disk and may evict another one that later requests need): a holding engine is
  preferred, and the adapter is loaded elsewhere only when the holders are busier by more than
  that (vLLM's and Dynamo's adapter-affinity routing, in the same cost).

``choose_by_prefix`` is pure: candidates in, a ``Decision`` (engine and reason) out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, NamedTuple

from dpserve.coordinator.registry import EngineRegistry


class RoutingPolicy(StrEnum):
    # Reproducible assignment: request k goes to the k-th routable engine in turn.
    ROUND_ROBIN = "round-robin"
    # Fewest outstanding requests relative to the engine's capacity; adapts to slow engines.
    LEAST_OUTSTANDING = "least-outstanding"
    # Cached prefix against load (see the module's docstring).
    PREFIX_AWARE = "prefix-aware"


class Reason(StrEnum):
    """Why ``choose_by_prefix`` picked an engine (a label of the routing metrics)."""

    PREFIX = "prefix"  # it holds the longest cached prefix of the prompt
    LOAD = "load"  # no engine holds any of the prompt: the least loaded
    BALANCE = "balance"  # another holds more of it, but is busier by more than that is worth
    HOT_SPOT = "hot_spot"  # the best-cached engine was passed over by the hot-spot guard


@dataclass(frozen=True, slots=True)
class PrefixRouting:
    """The prefix-aware policy's weights."""

    # What one more request in flight on an engine costs, in prompt tokens to prefill.
    request_cost_tokens: float = 16.0
    # What evicting one cached token costs, in prompt tokens to prefill (once, later).
    eviction_cost: float = 1.0
    # An engine with more than factor x (fewest outstanding of any engine) + slack
    # outstanding requests is passed over while another is under that bound. A slack of 4
    # moved requests on ordinary Poisson bursts at saturation (bench/prefix.py, 8 req/s), and
    # each move cost a full prefill plus the cached prefixes it evicted on a full pool; SGLang's
    # and vLLM's routers balance only past 64 more requests and 1.5x as many.
    hot_spot_factor: float = 2.0
    hot_spot_slack: int = 8
    # What loading the request's LoRA adapter on an engine that does not hold it costs, in
    # prompt tokens to prefill: reading a rank-16 adapter of an 8B model (~40 MB) takes
    # ~50-100 ms, a few hundred to a thousand prompt tokens of prefill on a GPU, and the slot
    # it takes may hold another adapter that then has to be read again.
    adapter_load_cost_tokens: float = 512.0


DEFAULT_PREFIX_ROUTING: Final = PrefixRouting()


class Candidate(NamedTuple):
    """One engine as ``choose_by_prefix`` weighs it (a tuple: the router builds one per
    routable engine for every request it routes)."""

    identity: bytes
    cached_tokens: int  # prompt tokens its cache holds (or is predicted to)
    outstanding: int  # requests in flight there
    queued_prefill_tokens: int = 0  # uncached prompt tokens sent there, not yet computed
    # Blocks its cache holds: among equal costs the emptiest cache takes a new prefix (it
    # evicts least); the candidates' order breaks the remaining ties.
    held_blocks: int = 0
    # Tokens it can store without evicting cached blocks; None: unknown (no eviction cost).
    free_tokens: int | None = None
    # Whether it must load the request's LoRA adapter first (False: it holds it, or the
    # request is for the base model).
    loads_adapter: bool = False
    # What waiting for a free slot there costs, in prompt tokens (engine_pace.slot_wait_tokens).
    slot_wait_tokens: float = 0.0


class Decision(NamedTuple):
    identity: bytes
    reason: Reason
    predicted_cached_tokens: int
    cost: float


def choose_by_prefix(
    candidates: list[Candidate],
    prompt_tokens: int,
    weights: PrefixRouting = DEFAULT_PREFIX_ROUTING,
) -> Decision | None:
    """The cheapest candidate (ties: the emptiest cache, then the first), or None. One pass
    over the candidates after the hot-spot bound: this runs for every request routed."""
    if not candidates:
        return None
    fewest = min([c.outstanding for c in candidates])
    # The idlest engine is always within the bound, whatever the weights.
    bound = max(fewest, weights.hot_spot_factor * fewest + weights.hot_spot_slack)
    per_request, per_evicted = weights.request_cost_tokens, weights.eviction_cost
    per_load = weights.adapter_load_cost_tokens
    chosen: Candidate | None = None
    chosen_cost = 0.0
    best_cached = candidates[0]  # the first with the most cached tokens, eligible or not
    for candidate in candidates:
        _, cached, outstanding, queued, held, free, loads_adapter, slot_wait = candidate
        if cached > best_cached.cached_tokens:
            best_cached = candidate
        if outstanding > bound:
            continue
        uncached = prompt_tokens - cached
        cost = uncached + queued + per_request * outstanding + slot_wait
        if free is not None and uncached > free:
            cost += per_evicted * (uncached - free)
        if loads_adapter:
            cost += per_load
        if (
            chosen is None
            or cost < chosen_cost
            or (cost == chosen_cost and held < chosen.held_blocks)
        ):
            chosen, chosen_cost = candidate, cost
    assert chosen is not None  # the idlest was within the bound
    if best_cached.cached_tokens == 0:
        reason = Reason.LOAD
    elif chosen.cached_tokens >= best_cached.cached_tokens:
        reason = Reason.PREFIX
    elif best_cached.outstanding > bound:
        reason = Reason.HOT_SPOT
    else:
        reason = Reason.BALANCE
    return Decision(chosen.identity, reason, chosen.cached_tokens, chosen_cost)


def choose_engine(registry: EngineRegistry, policy: RoutingPolicy) -> bytes | None:
    """The identity of the engine for the next request by load alone (round-robin or least
    outstanding; prefix-aware without a prompt is least outstanding), or None when none can
    take work."""
    routable = registry.routable
    if not routable:
        return None
    if policy is RoutingPolicy.ROUND_ROBIN:
        identity = routable[0]
        routable.rotate(-1)
        return identity
    engines = registry.engines
    return min(routable, key=lambda identity: engines[identity].load)
