"""The least-privilege ACL set derived from the configuration (README, "Access")."""

from __future__ import annotations

from service.app.config import Config
from service.app.kafka_access import Acl, required_acls


def test_defaults_are_five_acls_with_a_prefixed_transactional_id() -> None:
    acls = required_acls(Config.load(env={}))
    assert [str(a) for a in acls] == [
        "ALLOW Read on Topic:nova.scheduling-outcomes (literal)",
        "ALLOW Write on Topic:cortex.crs.classifications (literal)",
        "ALLOW Write on Topic:nova.scheduling-outcomes.dlq (literal)",
        "ALLOW Read on Group:cortex-crs-consumer (literal)",
        "ALLOW Write on TransactionalId:cortex-crs-consumer (prefix)",
    ]


def test_names_follow_the_settings() -> None:
    env = {"CRS_INPUT_TOPIC": "i", "CRS_OUTPUT_TOPIC": "o", "CRS_DLQ_TOPIC": "d",
           "CRS_GROUP_ID": "g"}  # fmt: skip
    acls = required_acls(Config.load(env=env))
    assert {(a.resource_type, a.name) for a in acls} == {
        ("Topic", "i"), ("Topic", "o"), ("Topic", "d"), ("Group", "g"), ("TransactionalId", "g"),
    }  # fmt: skip


def test_at_least_once_needs_no_transactional_id() -> None:
    acls = required_acls(Config.load(env={"CRS_EXACTLY_ONCE": "false"}))
    assert [a.resource_type for a in acls] == ["Topic", "Topic", "Topic", "Group"]


def test_the_transactional_id_acl_is_the_prefix_of_the_partition_bound_ids() -> None:
    def txn(env: dict[str, str]) -> Acl:
        return required_acls(Config.load(env=env))[-1]

    default = txn({"CRS_GROUP_ID": "g"})
    assert (default.name, default.pattern, default.operation) == ("g", "prefix", "Write")
    own = txn({"CRS_GROUP_ID": "g", "CRS_TRANSACTIONAL_ID_PREFIX": "crs-eu-de-1"})
    assert (own.name, own.pattern) == ("crs-eu-de-1", "prefix")
