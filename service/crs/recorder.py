"""Records one scheduling outcome: classify it, count it, and claim a slot for the VM.

The behaviour is the reference recorder's (see SEMANTICS.md), with one deliberate
difference: the slot write is a merge patch guarded by the resourceVersion the decision
was made on. Two writers racing for the same slot cannot both win; the loser re-reads,
re-checks idempotency and re-picks on fresh data, so no slot is overfilled and no VM
lands in two slots. A write whose answer was lost (it may still land) is settled by the
event's retry before it decides anew (``Recorder._claim_slot``).

The Recorder sees the cluster only through :class:`~service.crs.ports.ClusterState`; it
imports no Kubernetes or Kafka client, so it runs unchanged on list reads, a watch cache
or an in-memory fake.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Protocol

import structlog

from service import backoff
from service.crs.classify import CrSlot, classify_no_host_found, classify_placement
from service.crs.commitments import active_commitments
from service.crs.evaluator import is_slot, pick_slot, reservation_remaining_memory
from service.crs.flavors import (
    FlavorGroupLookupError,
    FlavorGroups,
    FlavorMatch,
    parse_flavor_groups,
)
from service.crs.intent import resolve_intent
from service.crs.outcome import AllocationStatus, Outcome, OutcomeKind
from service.crs.ports import (
    OUTCOME_HOOK,
    ClusterState,
    ConflictError,
    NotFoundError,
    Snapshot,
    UnavailableError,
)
from service.model import Decision, ExternalSchedulerRequest, Knowledge, Reservation
from service.quantity import format_binary_si, format_decimal_si
from service.tasks import all_or_none

__all__ = ["Recorder"]

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger(__name__)

UNKNOWN_FLAVOR_GROUP = "unknown"

# Writes of unknown outcome remembered at most (oldest forgotten first). An entry goes
# when its event is retried here and settles; one whose event is never retried here (its
# partition moved to another replica) would otherwise stay for the process's lifetime.
_MAX_UNSETTLED: Final = 10_000
# How long a request its client gave up on may still be applied: the API server's own
# request timeout (kube-apiserver --request-timeout, 60 s by default), with a margin.
_UNSETTLED_FOR_S: Final = 300.0


class _Counter(Protocol):
    """The part of a prometheus_client Counter the Recorder uses."""

    def labels(self, *args: str, **kwargs: str) -> _Counter: ...

    def inc(self, amount: float = 1) -> None: ...


def _utc_now() -> datetime:
    return datetime.now(UTC)


def rfc3339(ts: datetime) -> str:
    """Seconds-precision RFC 3339 in UTC, as ``metav1.Time`` serialises."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _FlavorGroupsMemo:
    """Parsed flavor groups of the last Knowledge version seen.

    Parsing is cheap but not free (hundreds of flavors); Knowledge changes rarely, so
    the result is reused while ``(uid, resourceVersion)`` stays the same. Objects without
    a resourceVersion (fakes) are parsed every time.
    """

    __slots__ = ("_groups", "_key")

    def __init__(self) -> None:
        self._key: tuple[str | None, str] | None = None
        self._groups: FlavorGroups | None = None

    def get(self, knowledge: Knowledge | None) -> FlavorGroups:
        rv = knowledge.metadata.resource_version if knowledge is not None else None
        if knowledge is None or not rv:
            return parse_flavor_groups(knowledge)
        key = (knowledge.metadata.uid, rv)
        if key != self._key or self._groups is None:
            # Errors are not memoised: the next event re-checks (a rare, cheap path).
            self._groups = parse_flavor_groups(knowledge)
            self._key = key
        return self._groups


@dataclass(frozen=True, slots=True)
class _UnsettledWrite:
    """A slot write that ended without an answer (timed out, cancelled, connection lost).

    The request may still be on its way to the API server and land later, on exactly
    this ``resource_version`` of ``reservation``. Kept so the event's retry can make sure
    the VM does not end up in this slot and a sibling (see ``Recorder._claim_slot``).
    """

    reservation: str
    resource_version: str
    allocation: dict[str, object]
    at: float  # monotonic: when the write was sent


def _holds(slot: Reservation, instance_uuid: str) -> bool:
    """Whether ``slot`` already holds an allocation for the VM."""
    crr = slot.spec.committed_resource_reservation
    return crr is not None and crr.allocations is not None and instance_uuid in crr.allocations


def _matches(slot: Reservation, target: str, project_id: str, flavor_group: str) -> bool:
    """Whether ``slot`` is a slot of ``project_id``'s ``flavor_group`` on ``target``."""
    crr = slot.spec.committed_resource_reservation
    return (
        is_slot(slot)
        and slot.spec.target_host == target
        and crr is not None
        and crr.matches_group(project_id, flavor_group)
    )


class Recorder:
    """Classifies Nova scheduling outcomes against committed resources and records them.

    ``placement_counter`` / ``no_host_found_counter`` are the counters from
    :mod:`service.crs.metrics` (or None to count nothing). After a 409/404 on the slot
    write the Recorder re-reads and re-decides until the placement is decided (written,
    already present, no slot): a conflict means another writer made progress, so giving
    up after a few quick tries (the reference's ``retry.DefaultRetry``: 5 x 10 ms) would
    record ``failed`` for placements that simply lost a race in a storm. The bound is
    time, ``conflict_timeout_s``; ``max_conflict_retries`` optionally bounds the count
    too. Between rounds it waits ``backoff_s`` doubling per conflict up to
    ``backoff_max_s``, plus up to ``jitter`` times that, so racing replicas spread out.
    ``clock`` supplies the allocation's creationTimestamp (UTC ``datetime``).
    """

    def __init__(
        self,
        state: ClusterState,
        placement_counter: _Counter | None = None,
        no_host_found_counter: _Counter | None = None,
        *,
        serialize_per_host: bool = True,
        max_conflict_retries: int | None = None,
        conflict_timeout_s: float = 30.0,
        backoff_s: float = 0.01,
        backoff_max_s: float = 0.5,
        jitter: float = 0.5,
        clock: Callable[[], datetime] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_conflict_retries is not None and max_conflict_retries < 0:
            raise ValueError("max_conflict_retries must be >= 0")
        self._state = state
        self._placement_counter = placement_counter
        self._no_host_found_counter = no_host_found_counter
        self._max_conflict_retries = max_conflict_retries
        self._conflict_timeout_s = conflict_timeout_s
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._jitter = jitter
        self._monotonic = monotonic
        self._clock = clock or _utc_now
        self._random = random.Random()
        self._flavor_groups = _FlavorGroupsMemo()
        self._serialize = serialize_per_host
        # Slot writes that ended without an answer, by (target host, instance UUID): the
        # write may have landed unseen, or may still land (see _claim_slot).
        self._unsettled: dict[tuple[str, str], _UnsettledWrite] = {}
        # Weak values: a host's lock lives only while a placement holds or awaits it.
        self._host_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    async def record(
        self,
        decision: Decision,
        request: ExternalSchedulerRequest,
        *,
        replay: bool = False,
        placed_at: datetime | None = None,
    ) -> Outcome:
        """Dispatch on the decision: a target host is a placement, none is no-host-found.

        As in the reference, only an absent/null target is "no host found"; "" is a
        placement (onto the host named ""), so the skip option applies to it. ``replay``:
        the event may have been handled before; ``placed_at``: when the placement
        happened (see :meth:`record_placement`).
        """
        if decision.result.target_host is None:
            return await self.record_no_host_found(decision, request)
        return await self.record_placement(decision, request, replay=replay, placed_at=placed_at)

    # --- placement ------------------------------------------------------------------

    async def record_placement(
        self,
        decision: Decision,
        request: ExternalSchedulerRequest,
        *,
        replay: bool = False,
        placed_at: datetime | None = None,
    ) -> Outcome:
        """Classify and count a successful placement; claim a slot when it is slot_used.

        ``replay``: the event may have been handled before, by a replica that has since
        lost its partition or died, whose write may not be visible yet or may still be
        in flight. The candidate slots are then fenced before one is claimed (see
        :meth:`_claim_slot`).

        ``placed_at``: when Nova placed the VM (the outcome's CloudEvents ``time``). The
        allocation's ``creationTimestamp`` is that moment, clamped to the clock when the
        producer's clock is ahead; None (no time in the event) stamps the clock. Cortex's
        reservation controller counts its grace period from this stamp (it leaves a
        younger unconfirmed allocation alone, then drops it unless the VM is on the
        host): the reference stamps ``metav1.Now()`` in-process at the placement, and a
        late-processed outcome stamped with the processing time would re-add a VM that
        Cortex already removed with a fresh grace period, holding the slot's memory
        for it meanwhile.

        Raises :class:`~service.crs.ports.ApiError` when the cluster cannot be read (or
        the write fails for a reason other than a resolvable conflict): the caller
        retries the whole event, which is safe because the write is idempotent.
        """
        target = decision.result.target_host
        if target is None:
            raise ValueError("record_placement needs a decision with a target host")
        intent = resolve_intent(decision.intent, request)
        instance_uuid = request.instance_uuid
        project_id = request.project_id
        flavor_name = request.flavor_name
        log = _log.bind(
            instance_uuid=instance_uuid, project_id=project_id, host=target, intent=intent
        )

        def outcome(
            cr_slot: CrSlot,
            flavor_group: str | None,
            *,
            reservation: str | None = None,
            allocation: AllocationStatus = AllocationStatus.NOT_APPLICABLE,
            vm_memory_bytes: int | None = None,
            conflicts: int = 0,
        ) -> Outcome:
            return Outcome(
                kind=OutcomeKind.PLACEMENT,
                cr_slot=cr_slot,
                intent=intent,
                instance_uuid=instance_uuid,
                project_id=project_id,
                flavor_name=flavor_name,
                flavor_group=flavor_group,
                target_host=target,
                reservation=reservation,
                allocation=allocation,
                vm_memory_bytes=vm_memory_bytes,
                conflicts=conflicts,
            )

        # The controller checks the option before it calls the recorder: nothing is read.
        if request.options.skip_committed_resource_tracking:
            log.debug("cr_tracking_skipped")
            return outcome(CrSlot.SKIPPED, None)

        hosts = [*decision.result.ordered_hosts, target]

        async def classify() -> Outcome | tuple[CrSlot, FlavorMatch, Snapshot]:
            """The placement's class on a fresh snapshot: a final Outcome, or slot_used."""
            snapshot = await self._state.snapshot(hosts, project_id)
            try:
                match = self._flavor_groups.get(snapshot.knowledge).lookup(flavor_name)
            except FlavorGroupLookupError as exc:
                log.error("flavor_group_lookup_failed", flavor=flavor_name, error=str(exc))
                self._count_placement(UNKNOWN_FLAVOR_GROUP, intent, CrSlot.ERROR)
                return outcome(CrSlot.ERROR, UNKNOWN_FLAVOR_GROUP)
            if match is None:
                log.debug("payg_placement", flavor=flavor_name)
                return outcome(CrSlot.PAYG, None)
            group = match.group
            active = active_commitments(snapshot.committed_resources, project_id, group)
            cr_slot = classify_placement(
                snapshot.evaluator, active, decision.result.ordered_hosts, project_id, group
            )
            log.debug("placement_classified", flavor_group=group, cr_slot=cr_slot)
            if cr_slot != CrSlot.SLOT_USED:
                self._count_placement(group, intent, cr_slot)
                return outcome(cr_slot, group, vm_memory_bytes=match.vm_memory_bytes)
            return cr_slot, match, snapshot

        # Classified first without the host lock: only a slot_used placement writes, so
        # only it waits for the host. Everything else (no_cr, slot_missed, payg, error) is
        # decided at once even while a write to the same host hangs on a slow API server.
        first = await classify()
        if isinstance(first, Outcome):
            return first
        # One write per host at a time in this replica (see _host_lock); decided again
        # under the lock, on a snapshot that includes the writes it waited for.
        async with self._host_lock(target):
            decided = await classify()
            if isinstance(decided, Outcome):
                return decided
            cr_slot, match, snapshot = decided
            group = match.group
            vm_mem = match.vm_memory_bytes
            log = log.bind(flavor_group=group, cr_slot=cr_slot)
            allocation: dict[str, object] = {
                "creationTimestamp": rfc3339(self._placement_time(placed_at)),
                "resources": {
                    # The reference's NewQuantity(n, BinarySI / DecimalSI) canonical text.
                    "memory": format_binary_si(vm_mem),
                    "cpu": format_decimal_si(match.vcpus),
                },
            }
            hook = OUTCOME_HOOK.get()

            def expect(reservation: str) -> None:
                if hook is not None:
                    hook(
                        outcome(
                            cr_slot,
                            group,
                            reservation=reservation,
                            allocation=AllocationStatus.WRITTEN,
                            vm_memory_bytes=vm_mem,
                        )
                    )

            status, reservation, conflicts = await self._claim_slot(
                snapshot.evaluator.slots_for_host(target, project_id, group),
                target=target,
                project_id=project_id,
                flavor_group=group,
                instance_uuid=instance_uuid,
                vm_mem=vm_mem,
                allocation=allocation,
                log=log,
                replay=replay,
                expect=expect,
            )
            # Counted once the write is settled (the reference counts just before it): a
            # write that fails with an outage makes the caller retry the event, and counting
            # first would count that event once per attempt.
            self._count_placement(group, intent, cr_slot)
            return outcome(
                cr_slot,
                group,
                reservation=reservation,
                allocation=status,
                vm_memory_bytes=vm_mem,
                conflicts=conflicts,
            )

    async def _claim_slot(
        self,
        slots: Sequence[Reservation],
        *,
        target: str,
        project_id: str,
        flavor_group: str,
        instance_uuid: str,
        vm_mem: int,
        allocation: dict[str, object],
        log: structlog.typing.FilteringBoundLogger,
        replay: bool = False,
        expect: Callable[[str], None] | None = None,
    ) -> tuple[AllocationStatus, str | None, int]:
        """Idempotency check, slot choice and guarded write, re-decided after a conflict.

        Returns (status, reservation name, number of conflicts met). ``expect`` is told
        the slot of a first write before it is sent (see ports.OUTCOME_HOOK).

        A write that ended without an answer may still land: the client gave up, but
        the request can be in flight at the API server, and its guard (the
        resourceVersion it was decided on) still holds there as long as that slot has
        not changed. So when this VM's event comes back here after such a write, the
        remembered slot is read fresh first: the VM is in it (already present); or it
        is still at the remembered version, and the identical guarded PATCH is sent
        again (of the original and the re-send only one can land, the other gets a 409,
        and the next round finds the VM); or it has moved on without the VM, and then the
        original can never land and the slot is chosen freely. Deciding freely at once
        could pick a sibling slot and the original could still land: the VM in two.

        The memory is this Recorder's, i.e. one replica's for its lifetime, and holds the
        latest ``_MAX_UNSETTLED`` such writes: if the event is retried by another replica
        (its partition moved), after a restart, or after its entry was evicted, while the
        original is still in flight at the API server, that retry decides without it and
        the VM can still end up in two slots. The window is how long the API server may
        still apply a request its client gave up on (its own request timeout).
        """
        key = (target, instance_uuid)
        unsettled = self._unsettled.get(key)
        if unsettled is not None and self._monotonic() - unsettled.at > _UNSETTLED_FOR_S:
            # It can no longer land; kept, it would re-send its body for a later event of
            # the VM (a resize on the same host: another flavor group, another size).
            del self._unsettled[key]
            unsettled = None
        current = list(slots)
        conflicts = 0
        deadline = self._monotonic() + self._conflict_timeout_s
        if replay:
            # The partition's previous owner may have written this VM (a watch cache may
            # not show it yet), or its write may still be on its way: a paused process, a
            # held connection, a slow API server. Decided on what is visible now, the
            # replay could pick a sibling slot and the late write still land on the slot
            # it was guarded for: the VM in two slots. Fencing every candidate first
            # settles both: the fences' answers are fresh reads (a write that landed is
            # seen), and a write guarded by an older version can no longer land. Only the
            # candidates, not every slot on the host: a backlog's replays took twice as
            # long to drain with reads of every slot.
            current = await self._fence(
                current, target, project_id, flavor_group, deadline=deadline, log=log
            )
        while True:
            chosen: Reservation | None = None  # set: re-send the unsettled write
            body = allocation
            if unsettled is not None:
                fresh = await self._state.get_reservation(unsettled.reservation)
                if fresh is not None and _holds(fresh, instance_uuid):
                    log.info("allocation_already_present", reservation=fresh.name)
                    self._unsettled.pop(key, None)
                    return AllocationStatus.ALREADY_PRESENT, fresh.name, conflicts
                if fresh is not None and fresh.metadata.resource_version == (
                    unsettled.resource_version
                ):
                    chosen, body = fresh, unsettled.allocation
                else:
                    # Changed without the VM, or gone: the lost write can never land.
                    self._unsettled.pop(key, None)
                    unsettled = None
            for slot in current:
                if _holds(slot, instance_uuid):
                    log.info("allocation_already_present", reservation=slot.name)
                    self._unsettled.pop(key, None)
                    return AllocationStatus.ALREADY_PRESENT, slot.name, conflicts
            if chosen is None:
                name = pick_slot(current, vm_mem)
                if not name:
                    log.info("no_slot_on_target_host", conflicts=conflicts)
                    return AllocationStatus.NO_SLOT, None, conflicts
                chosen = next(s for s in current if s.name == name)
            else:
                log.info("allocation_resent", reservation=chosen.name)
            name = chosen.name
            if expect is not None and not conflicts and body is allocation:
                expect(name)  # the outcome if this write succeeds: WRITTEN, no conflict
            try:
                await self._state.patch_allocation(chosen, instance_uuid, body)
            except (ConflictError, NotFoundError) as exc:
                conflicts += 1
                gone = isinstance(exc, NotFoundError)
                exhausted = self._monotonic() >= deadline or (
                    self._max_conflict_retries is not None
                    and conflicts > self._max_conflict_retries
                )
                if exhausted:
                    log.error(
                        "allocation_conflicts_exhausted",
                        reservation=name,
                        conflicts=conflicts,
                        last_error="not_found" if gone else "conflict",
                    )
                    return AllocationStatus.FAILED, name, conflicts
                log.info("allocation_conflict", reservation=name, gone=gone, conflicts=conflicts)
                await asyncio.sleep(self._backoff(conflicts))
                current = await self._refresh(
                    current, name, target=target, project_id=project_id, flavor_group=flavor_group
                )
                continue
            except BaseException:
                # No answer: it may have landed, or may still land.
                self._remember_unsettled(key, chosen, body)
                raise
            self._unsettled.pop(key, None)
            # At debug: the processor's one info line per written allocation ("classified")
            # names the event, the slot, the host and the conflicts.
            log.debug("allocation_written", reservation=name, conflicts=conflicts)
            return AllocationStatus.WRITTEN, name, conflicts

    def _remember_unsettled(
        self, key: tuple[str, str], written: Reservation, allocation: dict[str, object]
    ) -> None:
        self._unsettled.pop(key, None)  # re-inserted last: eviction goes oldest first
        self._unsettled[key] = _UnsettledWrite(
            written.name, written.metadata.resource_version or "", allocation, self._monotonic()
        )
        if len(self._unsettled) > _MAX_UNSETTLED:
            del self._unsettled[next(iter(self._unsettled))]

    async def _refresh(
        self,
        current: Sequence[Reservation],
        name: str,
        *,
        target: str,
        project_id: str,
        flavor_group: str,
    ) -> list[Reservation]:
        """Fresh slots to re-decide on after a failed write to ``name``.

        The cheap path re-reads the candidates; if ``name`` vanished, stopped matching,
        or has nothing left, the host's whole slot list is re-read (someone else may have
        written this VM elsewhere, or a new slot may have appeared).
        """

        # Every candidate is re-read, not only the one that conflicted: another writer may
        # have put this very VM into a sibling slot, and the idempotency check must see it.
        kept = await self._reread(current, target, project_id, flavor_group)
        if any(r.name == name and reservation_remaining_memory(r) > 0 for r in kept):
            return kept
        on_host = await self._state.reservations_on_host(target)
        return [r for r in on_host if _matches(r, target, project_id, flavor_group)]

    async def _fence(
        self,
        slots: Sequence[Reservation],
        target: str,
        project_id: str,
        flavor_group: str,
        *,
        deadline: float,
        log: structlog.typing.FilteringBoundLogger,
    ) -> list[Reservation]:
        """``slots`` fenced (see :meth:`ClusterState.fence_reservation`), as the fences
        returned them, those still slots of ``project_id``'s ``flavor_group`` on
        ``target``; one failed fence cancels the rest.

        A fence refused because the slot changed is retried on a fresh read: every
        candidate must be fenced, whatever else writes to it meanwhile (Cortex, other
        replicas). Past ``deadline`` the event fails as an outage, to be retried whole.
        """

        async def fence(slot: Reservation) -> Reservation | None:
            refused = 0
            while True:
                try:
                    return await self._state.fence_reservation(slot)
                except NotFoundError:
                    return None  # deleted: nothing can land on it any more
                except ConflictError:
                    refused += 1
                    if self._monotonic() >= deadline:
                        raise UnavailableError(
                            f"reservation {slot.name!r} kept changing while being fenced",
                            kind="reservations",
                        ) from None
                    await asyncio.sleep(self._backoff(refused))
                fresh = await self._state.get_reservation(slot.name)
                if fresh is None:
                    return None
                slot = fresh

        fenced = await all_or_none([fence(s) for s in slots])
        log.debug("candidates_fenced", slots=len(slots))
        return [
            r for r in fenced if r is not None and _matches(r, target, project_id, flavor_group)
        ]

    async def _reread(
        self, slots: Sequence[Reservation], target: str, project_id: str, flavor_group: str
    ) -> list[Reservation]:
        """``slots`` read fresh by name, those still slots of ``project_id``'s
        ``flavor_group`` on ``target`` (one failed read cancels the rest)."""
        fresh = await all_or_none([self._state.get_reservation(r.name) for r in slots])
        return [r for r in fresh if r is not None and _matches(r, target, project_id, flavor_group)]

    def _host_lock(self, host: str) -> contextlib.AbstractAsyncContextManager[object]:
        """Placements onto one host, decided and written one at a time in this process.

        Partitions run concurrently, so a burst of VMs for one host (a multi-create) would
        otherwise race for the same slot inside one replica, each round letting one
        writer win and the rest retry, until the retry budget runs out. Serialised, each
        decision sees the previous write (read-your-writes) and no conflict arises; the
        resourceVersion guard still settles races between replicas.
        """
        if not self._serialize:
            return contextlib.nullcontext()
        lock = self._host_locks.get(host)
        if lock is None:
            lock = self._host_locks[host] = asyncio.Lock()
        return lock

    def _placement_time(self, placed_at: datetime | None) -> datetime:
        """``placed_at``, or the clock when it is absent or ahead of the clock."""
        now = self._clock()
        if placed_at is None:
            return now
        if placed_at.tzinfo is None:  # the input schema requires an offset; fakes may not
            placed_at = placed_at.replace(tzinfo=UTC)
        return min(placed_at, now)

    def _backoff(self, conflicts: int) -> float:
        base = backoff.exponential(conflicts, self._backoff_s, self._backoff_max_s)
        return base * (1.0 + self._jitter * self._random.random())

    def _count_placement(self, flavor_group: str, intent: str, cr_slot: CrSlot) -> None:
        if self._placement_counter is not None:
            self._placement_counter.labels(
                flavor_group=flavor_group, intent=intent, cr_slot=cr_slot
            ).inc()

    # --- no host found --------------------------------------------------------------

    async def record_no_host_found(
        self, decision: Decision, request: ExternalSchedulerRequest
    ) -> Outcome:
        """Classify and count a request for which no host was found (never writes).

        The skip option does not apply here: the reference controller only consults it
        for placements.
        """
        intent = resolve_intent(decision.intent, request)
        instance_uuid = request.instance_uuid
        project_id = request.project_id
        flavor_name = request.flavor_name
        input_hosts = request.input_hosts

        def log() -> structlog.typing.FilteringBoundLogger:
            # Bound only where a line is written: a bind per event (a new bound logger and
            # context dict) was 1.1 µs with the service's logging configuration, about
            # 1.5 % of a routine event's CPU in a backlog. The processor's debug line
            # "classified" says the rest.
            return _log.bind(instance_uuid=instance_uuid, project_id=project_id, intent=intent)

        def outcome(cr_slot: CrSlot, flavor_group: str | None, vm_mem: int | None) -> Outcome:
            return Outcome(
                kind=OutcomeKind.NO_HOST_FOUND,
                cr_slot=cr_slot,
                intent=intent,
                instance_uuid=instance_uuid,
                project_id=project_id,
                flavor_name=flavor_name,
                flavor_group=flavor_group,
                target_host=None,
                vm_memory_bytes=vm_mem,
            )

        snapshot = await self._state.snapshot(input_hosts, project_id)
        try:
            match = self._flavor_groups.get(snapshot.knowledge).lookup(flavor_name)
        except FlavorGroupLookupError as exc:
            log().error("flavor_group_lookup_failed", flavor=flavor_name, error=str(exc))
            self._count_no_host_found(CrSlot.ERROR, UNKNOWN_FLAVOR_GROUP, intent)
            return outcome(CrSlot.ERROR, UNKNOWN_FLAVOR_GROUP, None)
        if match is None:
            return outcome(CrSlot.PAYG, None, None)

        group = match.group
        vm_mem = match.vm_memory_bytes
        active = active_commitments(snapshot.committed_resources, project_id, group)
        cr_slot = classify_no_host_found(
            active, snapshot.evaluator, input_hosts, project_id, group, vm_mem
        )
        self._count_no_host_found(cr_slot, group, intent)
        return outcome(cr_slot, group, vm_mem)

    def _count_no_host_found(self, cr_slot: CrSlot, flavor_group: str, intent: str) -> None:
        if self._no_host_found_counter is not None:
            self._no_host_found_counter.labels(
                cr_slot=cr_slot, flavor_group=flavor_group, intent=intent
            ).inc()
