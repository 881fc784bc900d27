"""The checked-in contracts (schemas/) match the code and the events it produces."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev extras
import pytest
import yaml

from service.crs.outcome import AllocationStatus, Outcome
from service.model import InputRef, schemagen
from service.stream.codec import (
    POISON_CODES,
    dead_letter_headers,
    decode_input,
    encode_input,
    encode_output,
)
from tests.upstream import nova_decision

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas"
Validator = jsonschema.Draft202012Validator


def load_json(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / name).read_text())
    return doc


@pytest.fixture(scope="module")
def asyncapi() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((SCHEMAS / "asyncapi.yaml").read_text())
    return doc


@pytest.fixture(scope="module")
def example_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    doc = nova_decision()
    result = doc["status"]["result"]
    decision = {
        "name": doc["metadata"]["name"],
        "result": {"targetHost": result["targetHost"], "orderedHosts": result["orderedHosts"]},
    }
    return decision, doc["spec"]["novaRaw"]


# --- generated JSON Schemas --------------------------------------------------------------


def test_checked_in_json_schemas_match_the_types() -> None:
    stale = schemagen.check()
    assert stale == [], f"run: python -m service.model.schemagen (stale: {stale})"
    assert schemagen.main(["--check"]) == 0


def test_check_detects_drift(tmp_path: Path) -> None:
    assert schemagen.main(["--check", "--dir", str(tmp_path)]) == 1  # missing files
    assert schemagen.main(["--dir", str(tmp_path)]) == 0
    assert schemagen.main(["--check", "--dir", str(tmp_path)]) == 0
    path = tmp_path / "classification-event.schema.json"
    path.write_text(path.read_text().replace('"slot_used"', '"slot_usd"'))
    assert schemagen.check(tmp_path) == [path]
    assert schemagen.main(["--check", "--dir", str(tmp_path)]) == 1


def test_generation_is_deterministic() -> None:
    for name, text in schemagen.rendered().items():
        assert text.endswith("}\n")
        assert text == schemagen.rendered()[name]
        assert json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n" == text


@pytest.mark.parametrize("name", list(schemagen.SCHEMAS))
def test_json_schemas_are_valid_2020_12(name: str) -> None:
    schema = load_json(name)
    Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_contract_enums_are_documented() -> None:
    defs = load_json("classification-event.schema.json")["$defs"]
    props = defs["ClassificationData"]["properties"]
    assert set(props["cr_slot"]["enum"]) == {
        "no_cr",
        "slot_used",
        "slot_missed",
        "cr_exhausted",
        "slot_exhausted",
        "slot_blocked",
        "error",
        "payg",
        "skipped",
    }
    assert set(props["kind"]["enum"]) == {"placement", "no_host_found"}
    assert set(props["allocation"]["enum"]) == {str(s) for s in AllocationStatus}
    event = defs["OutputEvent"]["properties"]
    assert event["type"] == {"enum": ["cortex.crs.classification.v1"]}
    assert event["specversion"] == {"enum": ["1.0"]}
    assert event["source"] == {"enum": ["crs-consumer"]}
    # Every data field is required: "not applicable" is an explicit null, never omitted.
    assert set(defs["ClassificationData"]["required"]) == set(props)


# --- real events validate ----------------------------------------------------------------


def test_encoded_input_events_validate(example_pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    decision, request = example_pair
    schema = load_json("input-event.schema.json")
    value, _ = encode_input(decision, request)
    Validator(schema).validate(json.loads(value))
    # Binary mode: the value is OutcomeData.
    value, _ = encode_input(decision, request, binary=True)
    data_schema = {**schema, "$ref": "#/$defs/OutcomeData"}
    Validator(data_schema).validate(json.loads(value))


def test_input_schema_rejects_what_the_decoder_rejects(
    example_pair: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    decision, request = example_pair
    validator = Validator(load_json("input-event.schema.json"))
    doc = json.loads(encode_input(decision, request)[0])
    for field, bad in [("specversion", "0.3"), ("type", "other"), ("id", ""), ("data", None)]:
        assert not validator.is_valid({**doc, field: bad}), field


def outcomes() -> Iterator[Outcome]:
    base: dict[str, Any] = {
        "intent": "create",
        "instance_uuid": "abc12345-6789-0123-4567-89abcdef0123",
        "project_id": "abcdef1234567890abcdef1234567890",
        "flavor_name": "hana",
    }
    yield Outcome(
        kind="placement",
        cr_slot="slot_used",
        flavor_group="hana_v2",
        target_host="nova-compute-bb83",
        reservation="cr-slot-0",
        allocation=AllocationStatus.ALREADY_PRESENT,
        vm_memory_bytes=2032 << 20,
        **base,
    )
    yield Outcome(kind="no_host_found", cr_slot="payg", flavor_group=None, target_host=None, **base)


@pytest.mark.parametrize("outcome", list(outcomes()), ids=lambda o: o.cr_slot)
def test_encoded_output_events_validate(
    example_pair: tuple[dict[str, Any], dict[str, Any]], outcome: Outcome
) -> None:
    decision, request = example_pair
    value, headers = encode_input(decision, request)
    event = decode_input(value, headers, max_bytes=1 << 20)
    ref = InputRef(topic="nova.scheduling-outcomes", partition=0, offset=7)
    doc = json.loads(encode_output(event, ref, outcome, now=datetime.now(UTC)))
    validator = Validator(load_json("classification-event.schema.json"))
    validator.validate(doc)
    bad = {**doc, "data": {**doc["data"], "cr_slot": "bogus"}}
    assert not validator.is_valid(bad)
    missing = {**doc, "data": {k: v for k, v in doc["data"].items() if k != "reservation"}}
    assert not validator.is_valid(missing)


# --- AsyncAPI ----------------------------------------------------------------------------


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def resolve_pointer(doc: Any, pointer: str) -> Any:
    for token in pointer.lstrip("/").split("/") if pointer.strip("/") else []:
        token = token.replace("~1", "/").replace("~0", "~")
        doc = doc[int(token)] if isinstance(doc, list) else doc[token]
    return doc


def test_asyncapi_document_shape(asyncapi: dict[str, Any]) -> None:
    assert asyncapi["asyncapi"] == "3.0.0"
    assert asyncapi["servers"]["local"]["host"] == "127.0.0.1:19092"
    assert asyncapi["servers"]["local"]["protocol"] == "kafka"
    addresses = {name: ch["address"] for name, ch in asyncapi["channels"].items()}
    assert addresses == {
        "schedulingOutcomes": "nova.scheduling-outcomes",
        "classifications": "cortex.crs.classifications",
        "deadLetters": "nova.scheduling-outcomes.dlq",
    }
    actions = {op["action"] for op in asyncapi["operations"].values()}
    assert actions == {"send", "receive"}


def test_asyncapi_messages_are_keyed_by_instance(asyncapi: dict[str, Any]) -> None:
    trait = asyncapi["components"]["messageTraits"]["keyedByInstance"]
    assert trait["bindings"]["kafka"]["key"]["format"] == "uuid"
    messages = asyncapi["components"]["messages"]
    for name in ("SchedulingOutcome", "SchedulingOutcomeBinary", "Classification"):
        assert {"$ref": "#/components/messageTraits/keyedByInstance"} in messages[name]["traits"]


def test_asyncapi_documents_every_dead_letter_header(asyncapi: dict[str, Any]) -> None:
    message = asyncapi["components"]["messages"]["DeadLetter"]
    names = [
        name
        for name, _ in dead_letter_headers("x", "y", InputRef(topic="t", partition=0, offset=0))
    ]
    assert set(message["headers"]["required"]) == set(names)
    assert set(message["headers"]["properties"]) == set(names)
    for code in POISON_CODES:
        assert f"`{code}`" in message["description"], code


def test_every_asyncapi_ref_resolves(asyncapi: dict[str, Any]) -> None:
    found = list(refs(asyncapi))
    file_refs = [r for r in found if not r.startswith("#")]
    assert {r.split("#")[0] for r in file_refs} == {
        "./input-event.schema.json",
        "./classification-event.schema.json",
    }
    for ref in found:
        target, _, pointer = ref.partition("#")
        if target:
            path = SCHEMAS / target
            assert path.is_file(), ref
            doc: Any = json.loads(path.read_text())
        else:
            doc = asyncapi
        try:
            resolve_pointer(doc, pointer)
        except (KeyError, IndexError, ValueError):
            pytest.fail(f"unresolvable $ref {ref!r}")
