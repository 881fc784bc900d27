"""The per-event error policy: every input ends as one output or one dead letter."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from service.crs.outcome import AllocationStatus, CrSlot, Outcome, OutcomeKind
from service.crs.ports import OUTCOME_HOOK, ForbiddenError, InvalidError, UnavailableError
from service.model import Decision, ExternalSchedulerRequest
from service.stream.codec import InputRef, encode_input
from service.stream.metrics import StreamMetrics
from service.stream.processor import EXPECTED_OUTPUT, Processor, RetryLater
from tests import nova

VM = "4f1e7b7e-0000-4000-8000-000000000001"


class ScriptedRecorder:
    """Stands in for the Recorder (our own interface): answers from a script."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, Decision, ExternalSchedulerRequest]] = []
        self.replays: list[bool] = []  # record()'s replay flag, per call
        self.placed_at: list[datetime | None] = []  # record()'s placed_at, per call

    async def _next(
        self, kind: str, decision: Decision, request: ExternalSchedulerRequest
    ) -> Outcome:
        self.calls.append((kind, decision, request))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def record(
        self,
        decision: Decision,
        request: ExternalSchedulerRequest,
        *,
        replay: bool = False,
        placed_at: datetime | None = None,
    ) -> Outcome:
        self.replays.append(replay)
        self.placed_at.append(placed_at)
        if decision.result.target_host:
            return await self.record_placement(decision, request)
        return await self.record_no_host_found(decision, request)

    async def record_placement(
        self, decision: Decision, request: ExternalSchedulerRequest
    ) -> Outcome:
        return await self._next("placement", decision, request)

    async def record_no_host_found(
        self, decision: Decision, request: ExternalSchedulerRequest
    ) -> Outcome:
        return await self._next("no_host_found", decision, request)


def outcome(kind: str = "placement", cr_slot: str = "slot_used") -> Outcome:
    return Outcome(
        kind=kind,  # type: ignore[arg-type]
        cr_slot=cr_slot,  # type: ignore[arg-type]
        intent="create",
        instance_uuid=VM,
        project_id="p1",
        flavor_name="m1.small",
        flavor_group="g1",
        target_host="hv-1" if kind == "placement" else None,
        reservation="slot-1",
        allocation=AllocationStatus.WRITTEN,
        vm_memory_bytes=4 << 30,
        conflicts=2,
    )


def make(recorder: ScriptedRecorder, max_attempts: int = 3) -> tuple[Processor, StreamMetrics]:
    metrics = StreamMetrics()
    return (
        Processor(
            recorder,  # type: ignore[arg-type]
            metrics,
            output_topic="out",
            dlq_topic="dlq",
            max_event_bytes=64 * 1024,
            max_attempts=max_attempts,
        ),
        metrics,
    )


REF = InputRef(topic="in", partition=3, offset=42)


def event(target: str | None = "hv-1") -> tuple[bytes, list[tuple[str, bytes]]]:
    return encode_input(nova.decision_dict(target), nova.request(VM, hosts=["hv-1"]))


async def test_placement_becomes_one_classification_record() -> None:
    rec = ScriptedRecorder(outcome())
    proc, metrics = make(rec)
    value, headers = event()
    out = await proc.process(REF, VM.encode(), value, headers)
    assert out.topic == "out"
    assert out.key == VM.encode()
    assert not out.dead_letter
    data = msgspec.json.decode(out.value or b"")["data"]
    assert (data["cr_slot"], data["allocation"], data["reservation"]) == (
        "slot_used",
        "written",
        "slot-1",
    )
    assert data["input"] == {"id": data["input"]["id"], "topic": "in", "partition": 3, "offset": 42}
    assert rec.calls[0][0] == "placement"
    assert metrics.events.labels("placement", "slot_used")._value.get() == 1
    assert metrics.conflicts._value.get() == 2
    # The engine's replay flag reaches the Recorder.
    rec.answers.append(outcome())
    again = await proc.process(REF, VM.encode(), value, headers, replay=True)
    assert not again.dead_letter
    assert rec.replays == [False, True]


async def test_the_outcomes_time_reaches_the_recorder_as_the_placement_time() -> None:
    # The allocation's creationTimestamp starts Cortex's grace period: it must be when
    # Nova placed the VM (the event's time), not when this service got to the record.
    rec = ScriptedRecorder(outcome(), outcome())
    proc, _ = make(rec)
    placed = datetime(2026, 12, 6, 8, 0, 0, tzinfo=UTC)
    value, headers = encode_input(
        nova.decision_dict("hv-1"), nova.request(VM, hosts=["hv-1"]), time=placed
    )
    assert not (await proc.process(REF, VM.encode(), value, headers)).dead_letter
    binary_value, binary_headers = encode_input(
        nova.decision_dict("hv-1"), nova.request(VM, hosts=["hv-1"]), time=placed, binary=True
    )
    assert not (await proc.process(REF, VM.encode(), binary_value, binary_headers)).dead_letter
    assert rec.placed_at == [placed, placed]


async def test_no_target_host_goes_to_no_host_found() -> None:
    rec = ScriptedRecorder(outcome("no_host_found", "slot_blocked"))
    proc, _ = make(rec)
    value, headers = event(target=None)
    out = await proc.process(REF, VM.encode(), value, headers)
    assert rec.calls[0][0] == "no_host_found"
    assert msgspec.json.decode(out.value or b"")["data"]["cr_slot"] == "slot_blocked"


async def test_poison_is_dead_lettered_with_original_bytes_and_no_recorder_call() -> None:
    rec = ScriptedRecorder()
    proc, metrics = make(rec)
    out = await proc.process(REF, b"key", b"\x00\x01garbage", [("trace", b"t-1")])
    assert out.dead_letter
    assert (out.topic, out.key, out.value) == ("dlq", b"key", b"\x00\x01garbage")
    headers = dict(out.headers)
    assert headers["crs.error"] == b"not_json"
    assert headers["trace"] == b"t-1"  # the producer's headers travel with the record
    assert headers["crs.source.offset"] == b"42"
    assert rec.calls == []
    assert metrics.dead_letters.labels("not_json")._value.get() == 1


async def test_unavailable_retries_then_dead_letters_after_max_attempts() -> None:
    boom = UnavailableError("apiserver down", status=503)
    rec = ScriptedRecorder(boom, boom, boom)
    proc, metrics = make(rec, max_attempts=3)
    value, headers = event()
    for attempt in (1, 2):
        with pytest.raises(RetryLater) as exc:
            await proc.process(REF, VM.encode(), value, headers, attempt=attempt)
        assert exc.value.attempt == attempt
    out = await proc.process(REF, VM.encode(), value, headers, attempt=3)
    assert out.dead_letter
    assert dict(out.headers)["crs.error"] == b"retries_exhausted"
    assert b"apiserver down" in dict(out.headers)["crs.reason"]
    assert metrics.retries.labels("k8s_unavailable")._value.get() == 2


async def test_non_retryable_api_error_is_dead_lettered_at_once() -> None:
    rec = ScriptedRecorder(InvalidError("spec.x: Invalid value", status=422))
    proc, _ = make(rec)
    value, headers = event()
    out = await proc.process(REF, VM.encode(), value, headers)
    assert dict(out.headers)["crs.error"] == b"k8s_error"


async def test_forbidden_waits_for_the_operator_before_dead_lettering() -> None:
    denied = ForbiddenError("no patch on reservations", status=403)
    rec = ScriptedRecorder(denied, denied)
    proc, metrics = make(rec, max_attempts=2)
    value, headers = event()
    with pytest.raises(RetryLater):
        await proc.process(REF, VM.encode(), value, headers, attempt=1)
    out = await proc.process(REF, VM.encode(), value, headers, attempt=2)
    assert dict(out.headers)["crs.error"] == b"retries_exhausted"
    assert metrics.retries.labels("k8s_forbidden")._value.get() == 1


async def test_dead_letter_too_large_to_produce_keeps_coordinates_not_bytes() -> None:
    metrics = StreamMetrics()
    proc = Processor(
        ScriptedRecorder(),  # type: ignore[arg-type]
        metrics,
        output_topic="out",
        dlq_topic="dlq",
        max_event_bytes=1000,
        max_attempts=3,
        max_dead_letter_value_bytes=2000,
    )
    small = await proc.process(REF, b"k", b"x" * 1500, [])
    assert small.value == b"x" * 1500  # oversized for processing, still fits a record
    huge = await proc.process(REF, b"k", b"x" * 5000, [])
    headers = dict(huge.headers)
    assert huge.value is None
    assert headers["crs.error"] == b"oversized"
    assert headers["crs.value.omitted"] == b"5000"
    assert headers["crs.source.offset"] == b"42"


async def test_an_unencodable_outcome_costs_one_event() -> None:
    # An off-contract cr_slot can no longer be built (Outcome refuses it, see
    # test_events.py); a lone surrogate is what the JSON encoder still cannot write.
    bad = Outcome(
        kind=OutcomeKind.PLACEMENT,
        cr_slot=CrSlot.SLOT_USED,
        intent="create",
        instance_uuid=VM,
        project_id="p1",
        flavor_name="m1.\ud800",
        flavor_group="g1",
        target_host="hv-1",
    )
    proc, _ = make(ScriptedRecorder(bad))
    value, headers = event()
    out = await proc.process(REF, VM.encode(), value, headers)
    assert dict(out.headers)["crs.error"] == b"internal_error"


async def test_a_bug_costs_one_event_not_the_service() -> None:
    rec = ScriptedRecorder(ZeroDivisionError("oops"))
    proc, _ = make(rec)
    value, headers = event()
    out = await proc.process(REF, VM.encode(), value, headers)
    assert dict(out.headers)["crs.error"] == b"internal_error"
    assert out.value == value


class TellingRecorder(ScriptedRecorder):
    """Tells ``told`` ahead when the hook is set (ports.OUTCOME_HOOK, as the Recorder
    does before a PATCH), then answers."""

    def __init__(self, told: Outcome, answer: Any) -> None:
        super().__init__(answer)
        self.told = told

    async def _next(
        self, kind: str, decision: Decision, request: ExternalSchedulerRequest
    ) -> Outcome:
        hook = OUTCOME_HOOK.get()
        if hook is not None:
            hook(self.told)
        return await super()._next(kind, decision, request)


async def _process_telling(told: Outcome, answer: Any) -> tuple[Any, list[tuple[int, Any]]]:
    """(the processor's output, what the engine was told) for a placement."""
    expected: list[tuple[int, Any]] = []
    proc, _ = make(TellingRecorder(told, answer))
    value, headers = event()
    token = EXPECTED_OUTPUT.set(lambda offset, out: expected.append((offset, out)))
    try:
        out = await proc.process(REF, VM.encode(), value, headers)
    finally:
        EXPECTED_OUTPUT.reset(token)
    return out, expected


async def test_a_placement_ending_as_told_returns_the_very_record_told_ahead() -> None:
    # The engine skips producing again only for the same object: it was produced ahead.
    out, expected = await _process_telling(outcome(), outcome())
    assert [(offset, record is out) for offset, record in expected] == [(REF.offset, True)]
    data = msgspec.json.decode(out.value)["data"]
    assert (data["reservation"], data["allocation"]) == ("slot-1", "written")


async def test_a_placement_ending_otherwise_returns_another_record() -> None:
    told = outcome()
    ended = msgspec.structs.replace(told, reservation="slot-2", conflicts=3)  # after a conflict
    out, expected = await _process_telling(told, ended)
    assert len(expected) == 1
    assert expected[0][1] is not out
    assert msgspec.json.decode(out.value)["data"]["reservation"] == "slot-2"
    # A retry (the API server unavailable) returns no record at all.
    with pytest.raises(RetryLater):
        await _process_telling(told, UnavailableError("down"))


async def test_no_host_found_is_never_told_ahead() -> None:
    # It writes nothing: its output is produced after its decision, as always.
    proc, _ = make(TellingRecorder(outcome(), outcome("no_host_found", "no_cr")))
    expected: list[Any] = []
    value, headers = event(None)
    token = EXPECTED_OUTPUT.set(lambda offset, out: expected.append(out))
    try:
        await proc.process(REF, VM.encode(), value, headers)
    finally:
        EXPECTED_OUTPUT.reset(token)
    assert expected == []
