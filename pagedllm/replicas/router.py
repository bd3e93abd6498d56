"""Which data-parallel replica serves a request: the one whose prefix cache holds the longest
run of the prompt's blocks, unless that would load it too far past the least loaded one.

Pure Python (no torch, no Ray) so that it is unit-tested in milliseconds.  The router
knows each replica's prefix cache exactly, not by guess: every replica's block pool reports
the block keys it stored and evicted (`BlockPool.drain_events`), and the router computes a
prompt's block keys with the same hash chain (`prompt_block_keys`).  Between a request's
placement and its replica's first events, the router counts the prompt's blocks as held by
that replica (pending), so that a burst of requests sharing a new prefix lands together;
the pending keys are dropped when the request ends, by then replaced by the replica's own
events (or never cached: the replica evicted or never computed them).

The rule (`policy="prefix"`):
- load = requests the router has in flight on the replica (sent, not yet ended);
- among live replicas, take the longest hit (in blocks); ties go to the lower load, then
  the lower index;
- if that replica's load exceeds the least loaded one's by more than `max_imbalance`
  requests, or nothing hits anywhere, the least loaded replica takes the request
  (load wins: a replica that holds every prefix must not take every request).

`least-loaded` always takes the least loaded live replica; `round-robin` cycles over the
live ones.  A replica marked down takes nothing; its keys are forgotten (a restarted one
comes back with an empty cache).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import prompt_block_keys, root_key

ROUTER_POLICIES = ("prefix", "least-loaded", "round-robin")


class NoReplicaError(RuntimeError):
    """Every replica is down: nothing can take the request."""


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    live: bool = True
    in_flight: int = 0
    held: set[bytes] = field(default_factory=set)  # keys its events say it holds
    pending: dict[bytes, int] = field(default_factory=dict)  # key -> requests placed here expecting it


@dataclass(frozen=True)
class Placement:
    """Where a request went and why: its replica, the blocks that replica held of its prompt, and
    the keys counted as pending there until the request ends."""

    replica: int
    hit_blocks: int
    pending_keys: tuple[bytes, ...] = ()


class Router:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "prefix",
        max_imbalance: int = 8,
        cache_salt: bytes = b"",
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be at least 0, got {max_imbalance}")
        self.block_size, self.policy, self.max_imbalance = block_size, policy, max_imbalance
        self.cache_salt = cache_salt
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self._turn = itertools.count()
        self.num_routed = 0
        self.num_routed_by_load = 0  # prefix policy: requests where load overrode the longest hit

    # --- what the replicas report -------------------------------------------------------

    def apply_events(self, replica: int, events: list[tuple[bool, bytes]]) -> None:
        """A replica's block-pool events, in order: (True, key) stored, (False, key) evicted."""
        view = self.replicas[replica]
        for stored, key in events:
            if stored:
                view.held.add(key)
            else:
                view.held.discard(key)

    def mark_down(self, replica: int) -> None:
        """The replica died: it takes nothing until `mark_up`, and its cache is forgotten."""
        view = self.replicas[replica]
        view.live, view.held, view.pending, view.in_flight = False, set(), {}, 0

    def mark_up(self, replica: int) -> None:
        """A (re)started replica: empty cache, nothing in flight."""
        self.replicas[replica] = ReplicaView()

    # --- placing requests ---------------------------------------------------------------

    def hit_blocks(self, replica: int, keys: list[bytes]) -> int:
        """How many of `keys` from the first, without a gap, the replica holds or expects."""
        view = self.replicas[replica]
        count = 0
        for key in keys:
            if key not in view.held and key not in view.pending:
                break
            count += 1
        return count

    def route(self, token_ids: list[int], request_salt: bytes = b"", exclude: tuple[int, ...] = ()) -> Placement:
        """Place a request (not `exclude`d replicas: ones that already failed it); the caller must
        call `finished(placement)` once, when the request ends however it ends."""
        live = [i for i, view in enumerate(self.replicas) if view.live and i not in exclude]
        if not live:
            raise NoReplicaError("no replica is available to take the request (every replica is down)")
        keys = prompt_block_keys(token_ids, self.block_size, root_key(self.cache_salt, request_salt))
        least = min(live, key=lambda i: (self.replicas[i].in_flight, i))
        hits = {i: self.hit_blocks(i, keys) for i in live} if self.policy == "prefix" else {}
        if self.policy == "round-robin":
            chosen = live[next(self._turn) % len(live)]
        elif self.policy == "least-loaded":
            chosen = least
        else:
            best = min(live, key=lambda i: (-hits[i], self.replicas[i].in_flight, i))
            overloaded = self.replicas[best].in_flight > self.replicas[least].in_flight + self.max_imbalance
            chosen = best if hits[best] > 0 and not overloaded else least
            if hits[best] > 0 and overloaded:
                self.num_routed_by_load += 1
        hit = hits[chosen] if hits else self.hit_blocks(chosen, keys)  # before this request's own keys count
        view = self.replicas[chosen]
        view.in_flight += 1
        self.num_routed += 1
        for key in keys:
            view.pending[key] = view.pending.get(key, 0) + 1
        return Placement(chosen, hit, tuple(keys))

    def finished(self, placement: Placement) -> None:
        """The request ended (done, failed, aborted): its replica's load drops, its pending keys go."""
        view = self.replicas[placement.replica]
        if not view.live:
            return  # forgotten with the replica
        view.in_flight = max(0, view.in_flight - 1)
        for key in placement.pending_keys:
            count = view.pending.get(key, 0) - 1
            if count > 0:
                view.pending[key] = count
            else:
                view.pending.pop(key, None)
