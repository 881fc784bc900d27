"""One type per vocabulary: the domain outcome and the wire event share kind, cr_slot and
allocation, every member survives the wire, and the schemas list exactly the members."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgspec
import pytest

import service.crs
import service.model
from service.crs.classify import CrSlot as ClassifyCrSlot
from service.crs.outcome import Outcome
from service.model import schemagen
from service.model.events import ClassificationData, InputEvent, OutputEvent
from service.model.vocabulary import AllocationStatus, CrSlot, OutcomeKind
from service.stream.codec import InputRef, decode_input, encode_input, encode_output
from tests import nova

VM = "4f1e7b7e-0000-4000-8000-000000000001"
REF = InputRef(topic="in", partition=0, offset=1)
SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "classification-event.schema.json"

# The wire field of ClassificationData that carries each vocabulary.
FIELDS: dict[str, type[StrEnum]] = {
    "kind": OutcomeKind,
    "cr_slot": CrSlot,
    "allocation": AllocationStatus,
}
MEMBERS = [(field, member) for field, vocabulary in FIELDS.items() for member in vocabulary]


@pytest.fixture(scope="module")
def event() -> InputEvent:
    value, headers = encode_input(nova.decision_dict("hv-1"), nova.request(VM, hosts=["hv-1"]))
    return decode_input(value, headers, max_bytes=1 << 20)


def outcome_with(field: str, member: StrEnum) -> Outcome:
    fields: dict[str, Any] = {
        "kind": OutcomeKind.PLACEMENT,
        "cr_slot": CrSlot.SLOT_USED,
        "intent": "create",
        "instance_uuid": VM,
        "project_id": "p1",
        "flavor_name": "m1.large",
        "flavor_group": "g1",
        "target_host": "hv-1",
        "allocation": AllocationStatus.WRITTEN,
    }
    fields[field] = member
    return Outcome(**fields)


def test_the_domain_and_the_wire_share_one_type_per_vocabulary() -> None:
    wire = {f.name: f.type for f in msgspec.structs.fields(ClassificationData)}
    assert {name: wire[name] for name in FIELDS} == FIELDS
    assert (service.crs.CrSlot, ClassifyCrSlot, service.model.CrSlot) == (CrSlot,) * 3
    assert service.crs.AllocationStatus is service.model.AllocationStatus is AllocationStatus
    assert service.crs.OutcomeKind is service.model.OutcomeKind is OutcomeKind


@pytest.mark.parametrize(("field", "member"), MEMBERS, ids=lambda v: str(v))
def test_every_member_round_trips_through_the_wire(
    event: InputEvent, field: str, member: StrEnum
) -> None:
    value = encode_output(event, REF, outcome_with(field, member))
    assert json.loads(value)["data"][field] == member.value
    decoded = msgspec.json.decode(value, type=OutputEvent)
    assert getattr(decoded.data, field) is member


@pytest.mark.parametrize("field", list(FIELDS))
def test_the_wire_decoder_refuses_a_value_outside_the_vocabulary(
    event: InputEvent, field: str
) -> None:
    doc = json.loads(encode_output(event, REF, outcome_with(field, next(iter(FIELDS[field])))))
    doc["data"][field] = "bogus"
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(json.dumps(doc), type=OutputEvent)


@pytest.mark.parametrize(("field", "member"), MEMBERS, ids=lambda v: str(v))
def test_an_outcome_turns_an_on_contract_string_into_its_member(
    field: str, member: StrEnum
) -> None:
    built = outcome_with(field, str(member.value))  # type: ignore[arg-type]
    assert getattr(built, field) is member


@pytest.mark.parametrize("field", list(FIELDS))
def test_an_outcome_refuses_a_value_outside_the_vocabulary(field: str) -> None:
    for bad in ("bogus", None, 1):
        with pytest.raises(ValueError, match=f"^{field} "):
            outcome_with(field, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", list(FIELDS))
def test_the_schema_enum_lists_are_the_members(field: str) -> None:
    checked_in = json.loads(SCHEMA.read_text())["$defs"]["ClassificationData"]["properties"]
    generated = json.loads(schemagen.rendered()[SCHEMA.name])
    members = sorted(m.value for m in FIELDS[field])
    assert checked_in[field] == {"enum": members}
    assert generated["$defs"]["ClassificationData"]["properties"][field] == {"enum": members}
    # Inlined: the Python class names are not part of the contract.
    assert FIELDS[field].__name__ not in generated["$defs"]
