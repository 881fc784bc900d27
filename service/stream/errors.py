"""Kafka errors, classified once for everything that reacts to them.

The engine (:mod:`service.stream.engine`), the runtime's start-up retries
(:mod:`service.app.runtime`) and the committed-offset read (:mod:`service.stream.committed`)
each decide what an aiokafka error means: retry soon, retry at the back-off cap, give up,
look the coordinator up again. They read the kind from :func:`classify` here, so a new
error class (an aiokafka upgrade) is placed in one table.

The callers do not all act alike on a kind, on purpose or by history; each such
difference is spelled at the predicate that serves the caller:

* a *cluster* authorization failure (ClusterAuthorizationFailed: e.g. the
  IdempotentWrite ACL on old brokers) is a configuration error at start-up and waited
  out on a restart (:func:`is_configuration`, :func:`is_acl`), but the engine retries
  it on its usual back-off, not at the cap (:func:`engine_waits_at_cap`);
* the engine treats every other error alike (transient), while start-up separates
  configuration errors (credentials, client settings) that no retry fixes.
"""

from __future__ import annotations

import enum

from aiokafka import errors as kafka_errors

__all__ = [
    "AUTHORIZATION",
    "COORDINATOR_MOVED",
    "REFUSED_RECORD",
    "Kind",
    "classify",
    "engine_waits_at_cap",
    "is_acl",
    "is_configuration",
]


class Kind(enum.Enum):
    """What an error says about the request that failed."""

    FENCED = "fenced"  # another producer initialised the transactional.id
    REFUSED_RECORD = "refused_record"  # the broker will never take this record
    AUTHORIZATION = "authorization"  # an ACL on a topic, the group or a transactional.id
    CLUSTER_AUTHORIZATION = "cluster_authorization"  # an ACL on the cluster
    CONFIGURATION = "configuration"  # credentials or client settings
    COORDINATOR_MOVED = "coordinator_moved"  # look the group coordinator up again
    KAFKA = "kafka"  # any other Kafka error: the broker (briefly) away or busy
    OTHER = "other"  # not a Kafka error


# The broker refuses the record itself: too large for the topic or the request, or
# unreadable. Sending it again cannot succeed (the engine stubs it instead).
REFUSED_RECORD: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.CorruptRecordException,
)
# An ACL refuses a topic, the group or a transactional.id (not the cluster: see below).
AUTHORIZATION: tuple[type[BaseException], ...] = (
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.GroupAuthorizationFailedError,
    kafka_errors.TransactionalIdAuthorizationFailed,
)
_CLUSTER_AUTHORIZATION: tuple[type[BaseException], ...] = (
    kafka_errors.ClusterAuthorizationFailedError,
)
# No retry fixes these: credentials, client settings.
_CONFIGURATION: tuple[type[BaseException], ...] = (
    kafka_errors.AuthenticationFailedError,
    kafka_errors.AuthenticationMethodNotSupported,
    kafka_errors.UnsupportedSaslMechanismError,
    kafka_errors.IllegalSaslStateError,
    kafka_errors.KafkaConfigurationError,
    kafka_errors.IllegalArgumentError,
    kafka_errors.IncompatibleBrokerVersion,
    kafka_errors.UnsupportedCodecError,
)
# After these the group coordinator must be looked up again (as aiokafka does).
COORDINATOR_MOVED: tuple[type[BaseException], ...] = (
    kafka_errors.NotCoordinatorForGroupError,
    kafka_errors.GroupCoordinatorNotAvailableError,
)

_TABLE: tuple[tuple[tuple[type[BaseException], ...], Kind], ...] = (
    ((kafka_errors.ProducerFenced,), Kind.FENCED),
    (REFUSED_RECORD, Kind.REFUSED_RECORD),
    (AUTHORIZATION, Kind.AUTHORIZATION),
    (_CLUSTER_AUTHORIZATION, Kind.CLUSTER_AUTHORIZATION),
    (_CONFIGURATION, Kind.CONFIGURATION),
    (COORDINATOR_MOVED, Kind.COORDINATOR_MOVED),
    ((kafka_errors.KafkaError,), Kind.KAFKA),
)


def classify(exc: BaseException) -> Kind:
    """The kind of ``exc`` (the first row of the table it is an instance of)."""
    for classes, kind in _TABLE:
        if isinstance(exc, classes):
            return kind
    return Kind.OTHER


def engine_waits_at_cap(exc: BaseException) -> bool:
    """The engine retries a failed fetch, commit or take-over at the back-off cap (and
    reports its partition stalled at once): an ACL refuses it, which only an operator
    fixes. A cluster ACL is not among them (retried on the usual back-off)."""
    return classify(exc) is Kind.AUTHORIZATION


def is_configuration(exc: BaseException) -> bool:
    """No start-up retry fixes it: credentials, client settings, an ACL (the cluster's
    included); see :func:`is_acl` for a restart."""
    return classify(exc) in (Kind.AUTHORIZATION, Kind.CLUSTER_AUTHORIZATION, Kind.CONFIGURATION)


def is_acl(exc: BaseException) -> bool:
    """An ACL refuses the request (the cluster's included): after the service has run
    with this configuration, a change on the broker's side that is waited out."""
    return classify(exc) in (Kind.AUTHORIZATION, Kind.CLUSTER_AUTHORIZATION)
