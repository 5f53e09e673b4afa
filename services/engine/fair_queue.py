"""Tenant-fair ordering inside a priority class: weighted fair queuing on tokens.

Every tenant has a virtual clock: the tokens the engine computed for it (prefill chunks and decodes,
charged when scheduled) divided by its weight. The waiting request admitted next is the oldest one of the
tenant whose clock is furthest behind, so a tenant with 300 queued requests and a tenant with one both get
served, in proportion to their weights. A tenant that goes idle does not bank credit: when it becomes
active again its clock is moved up to the least clock among the active tenants (start-time fair queuing).

Fair shares of the running batch are by weight among the tenants that have work (running or waiting):
the scheduler preempts a sequence of the tenant furthest over its share to seat a tenant under its share.
With `policy="fcfs"` every request counts as one tenant: plain arrival order (the baseline).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.engine.sequence import Sequence

FCFS_TENANT = "*"


@dataclass(slots=True)
class TenantState:
    """One tenant's accounting. `running` counts its sequences in the batch, `waiting` its queued ones (any class)."""

    weight: float = 1.0
    vtime: float = 0.0
    running: int = 0
    waiting: int = 0

    @property
    def active(self) -> bool:
        return self.running > 0 or self.waiting > 0


@dataclass
class Tenants:
    """Virtual clocks and running/waiting counts of every tenant with work (idle ones are dropped)."""

    fair: bool = True
    states: dict[str, TenantState] = field(default_factory=dict)

    def key(self, seq: Sequence) -> str:
        return seq.tenant if self.fair else FCFS_TENANT

    def state(self, seq: Sequence) -> TenantState:
        key = self.key(seq)
        st = self.states.get(key)
        if st is None:
            floor = min((s.vtime for s in self.states.values()), default=0.0)
            st = self.states[key] = TenantState(weight=seq.weight, vtime=floor)
        st.weight = seq.weight  # the gateway's latest word (a plan change applies at once)
        return st

    def charge(self, seq: Sequence, tokens: int) -> None:
        st = self.state(seq)
        st.vtime += tokens / st.weight

    def arrived(self, seq: Sequence) -> None:
        self.state(seq).waiting += 1

    def admitted(self, seq: Sequence) -> None:
        st = self.state(seq)
        st.waiting -= 1
        st.running += 1

    def preempted(self, seq: Sequence) -> None:
        st = self.state(seq)
        st.running -= 1
        st.waiting += 1

    def left(self, seq: Sequence, was_running: bool) -> None:
        key = self.key(seq)
        st = self.states[key]
        if was_running:
            st.running -= 1
        else:
            st.waiting -= 1
        if not st.active:
            del self.states[key]

    def share(self, seq: Sequence, capacity: int) -> float:
        """Seats of the running batch this sequence's tenant is entitled to now (by weight among active tenants)."""
        total = sum(s.weight for s in self.states.values() if s.active)
        st = self.state(seq)
        return capacity * st.weight / total if total else float(capacity)

    def over_share(self, capacity: int) -> dict[str, float]:
        """running / share for every tenant with running sequences: above 1 is over its fair share."""
        total = sum(s.weight for s in self.states.values() if s.active)
        return {k: s.running / (capacity * s.weight / total) for k, s in self.states.items() if s.running and total}

    def check_integrity(self, running: list[Sequence], waiting: Iterator[Sequence]) -> None:
        counts: dict[str, list[int]] = {}
        for s in running:
            counts.setdefault(self.key(s), [0, 0])[0] += 1
        for s in waiting:
            counts.setdefault(self.key(s), [0, 0])[1] += 1
        got = {k: [st.running, st.waiting] for k, st in self.states.items()}
        assert got == counts, (got, counts)


class WaitQueue:
    """The waiting sequences of one priority class: a FIFO per tenant. Iteration is in arrival order per
    tenant, tenants in fair order; `admission()` walks it as the scheduler admits."""

    def __init__(self, tenants: Tenants):
        self.tenants = tenants
        self._by_tenant: dict[str, deque[Sequence]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        order = sorted(self._by_tenant, key=lambda k: self.tenants.states[k].vtime)
        for k in order:
            yield from self._by_tenant[k]

    def __getitem__(self, i: int) -> Sequence:  # tests and diagnostics: the i-th in iteration order
        for j, s in enumerate(self):
            if j == i:
                return s
        raise IndexError(i)

    def append(self, seq: Sequence) -> None:
        self._by_tenant.setdefault(self.tenants.key(seq), deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the front of its tenant's queue."""
        self._by_tenant.setdefault(self.tenants.key(seq), deque()).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        key = self.tenants.key(seq)
        q = self._by_tenant[key]
        q.remove(seq)
        self._len -= 1
        if not q:
            del self._by_tenant[key]

    def tenant_keys(self) -> list[str]:
        return list(self._by_tenant)

    def oldest_arrival(self, tenant_key: str) -> float | None:
        """Arrival time (monotonic) of the tenant's longest-waiting request in this class."""
        q = self._by_tenant.get(tenant_key)
        return min(s.arrival_time for s in (q[0], q[-1])) if q else None  # a preempted one goes back to the front

    def count(self, tenant_key: str) -> int:
        q = self._by_tenant.get(tenant_key)
        return len(q) if q else 0

    def admission(self) -> Admission:
        return Admission(self)


class Admission:
    """One admission pass over a WaitQueue: `peek()` the next candidate (the oldest not-yet-skipped request
    of the tenant furthest behind), then `take()` it or `skip()` it for this pass. Clocks move as the
    scheduler charges admitted work, so the next candidate reflects what was just admitted."""

    def __init__(self, queue: WaitQueue):
        self.queue = queue
        self._skipped: dict[str, int] = {}  # per tenant: how many at the head of its queue were skipped

    def peek(self) -> Sequence | None:
        best, best_v = None, 0.0
        states = self.queue.tenants.states
        for key, q in self.queue._by_tenant.items():
            i = self._skipped.get(key, 0)
            if i < len(q) and (best is None or states[key].vtime < best_v):
                best, best_v = q[i], states[key].vtime
        return best

    def skip(self, seq: Sequence) -> None:
        key = self.queue.tenants.key(seq)
        self._skipped[key] = self._skipped.get(key, 0) + 1

    def take(self, seq: Sequence) -> None:
        key = self.queue.tenants.key(seq)
        q = self.queue._by_tenant[key]
        i = self._skipped.get(key, 0)
        assert q[i] is seq
        del q[i]
        self.queue._len -= 1
        if not q:
            del self.queue._by_tenant[key]
