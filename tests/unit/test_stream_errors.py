"""One classification of Kafka errors (service.stream.errors), and where its callers
differ on purpose: the engine, the start-up retries, the committed-offset read."""

from __future__ import annotations

import pytest
from aiokafka import errors as kafka_errors

from service.stream import errors
from service.stream.errors import Kind


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (kafka_errors.ProducerFenced(), Kind.FENCED),
        (kafka_errors.MessageSizeTooLargeError(), Kind.REFUSED_RECORD),
        (kafka_errors.RecordTooLargeError(), Kind.REFUSED_RECORD),
        (kafka_errors.RecordListTooLargeError(), Kind.REFUSED_RECORD),
        (kafka_errors.CorruptRecordException(), Kind.REFUSED_RECORD),
        (kafka_errors.TopicAuthorizationFailedError(), Kind.AUTHORIZATION),
        (kafka_errors.GroupAuthorizationFailedError(), Kind.AUTHORIZATION),
        (kafka_errors.TransactionalIdAuthorizationFailed(), Kind.AUTHORIZATION),
        (kafka_errors.ClusterAuthorizationFailedError(), Kind.CLUSTER_AUTHORIZATION),
        (kafka_errors.AuthenticationFailedError(), Kind.CONFIGURATION),
        (kafka_errors.UnsupportedSaslMechanismError(), Kind.CONFIGURATION),
        (kafka_errors.KafkaConfigurationError(), Kind.CONFIGURATION),
        (kafka_errors.NotCoordinatorForGroupError(), Kind.COORDINATOR_MOVED),
        (kafka_errors.GroupCoordinatorNotAvailableError(), Kind.COORDINATOR_MOVED),
        (kafka_errors.KafkaConnectionError(), Kind.KAFKA),
        (kafka_errors.GroupLoadInProgressError(), Kind.KAFKA),
        (OSError("refused"), Kind.OTHER),
    ],
)
def test_each_error_has_one_kind(error: BaseException, kind: Kind) -> None:
    assert errors.classify(error) is kind


def test_the_engine_waits_at_the_cap_for_acls_but_not_the_clusters() -> None:
    assert errors.engine_waits_at_cap(kafka_errors.TopicAuthorizationFailedError())
    assert errors.engine_waits_at_cap(kafka_errors.TransactionalIdAuthorizationFailed())
    # Retried on the usual back-off (as the engine always has).
    assert not errors.engine_waits_at_cap(kafka_errors.ClusterAuthorizationFailedError())
    assert not errors.engine_waits_at_cap(kafka_errors.KafkaConnectionError())


def test_start_up_takes_every_acl_and_client_setting_for_configuration() -> None:
    assert errors.is_configuration(kafka_errors.ClusterAuthorizationFailedError())
    assert errors.is_configuration(kafka_errors.GroupAuthorizationFailedError())
    assert errors.is_configuration(kafka_errors.AuthenticationFailedError())
    assert not errors.is_configuration(kafka_errors.KafkaConnectionError())
    assert not errors.is_configuration(kafka_errors.ProducerFenced())
    # ... and only the ACLs among them for a change on the broker's side.
    assert errors.is_acl(kafka_errors.ClusterAuthorizationFailedError())
    assert not errors.is_acl(kafka_errors.AuthenticationFailedError())
