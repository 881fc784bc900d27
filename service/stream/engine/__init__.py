"""The consume-decide-produce engine.

Where it lives: :mod:`.service` (the facade: start, the fetch loop, close),
:mod:`.settings`, :mod:`.clients` (every Kafka client's arguments), :mod:`.core` (what
the parts share), :mod:`.state` (per-partition state, forgotten in one place),
:mod:`.lanes` (key lanes, deciding), :mod:`.committer` (when to commit: the token
bucket, opening and producing ahead), :mod:`.pacing` (the replica's transactions per
second across its partitions), :mod:`.transaction` (one commit: outputs and
offsets in one transaction), :mod:`.ownership` (assign, revoke, take over, fence),
:mod:`.release` (give up, drop, take over again) and :mod:`.lag`; aiokafka's private
parts only through :mod:`service.stream.aiokafka_internals`, errors classified by
:mod:`service.stream.errors`.

Design, in the order the failures of the first engine taught it (issue 11):

* **Fencing by partition.** Every assigned input partition has its own transactional
  producer, ``transactional.id = <prefix>-<topic>-<partition>`` (Kafka Streams' first
  exactly-once mode, Faust). It is initialised when the partition is taken over, *before*
  the partition's committed offset is read: ``InitProducerId`` aborts (or completes) a
  previous owner's open transaction and bumps the epoch, so a paused replica that wakes up
  can no longer commit (it gets ``ProducerFenced`` and drops its work quietly), and the new
  owner starts from offsets that already include whatever the old owner did commit.
  aiokafka cannot send group-aware offset commits (KIP-447), so this is the fence.
* **No batch barrier.** Each partition commits on its own, in its own transaction, paced
  by a token bucket (one commit per ``commit_interval_ms`` sustained, ``commit_burst``
  at once after a quiet spell) or at once when ``commit_max_records`` outputs wait; with
  ``commit_rate_max`` (off by default) the replica's partitions together begin at most
  that many transactions per second. A partition blocked on the Kubernetes API delays
  no other. Within a partition, a placement's output produced ahead of its write never
  holds back another key's: a record decided first aborts that transaction instead (see
  :mod:`.committer`).
* **Key-level concurrency** (Confluent's Parallel Consumer): inside a partition, records
  with different keys run concurrently (up to ``key_concurrency``), records with the same
  key in offset order. The key is the record key; a record without one is keyed by the
  event's instance UUID (decoded once more for that), so per-VM order holds either way.
  Because records finish out of order, a commit writes the lowest open offset as the
  committed offset and lists what is done above it in the offset metadata
  (:mod:`service.stream.ledger`): an event completed behind a stuck one is committed at
  once and never processed twice.
* **Backpressure.** A partition with ``max_in_flight`` records received but not committed
  is left out of the fetches until it has room; fetching never stops for the others. When
  every partition is full, one record is still asked for every ``poll_keepalive_s``:
  aiokafka makes a member that stops calling ``getmany()`` leave the group.
* **Failures.** An event the cluster cannot take now (RetryLater) waits in its key's lane
  with capped exponential back-off; other keys go on. A failed commit never retries as if
  nothing happened: the partition is *re-acquired* (new producer, fence, read the
  committed offset, seek, reprocess), which the Kubernetes write's idempotency makes
  harmless. A record the broker rejects as too large is replaced by a stub dead letter;
  an authorisation failure marks the partition stalled (metric, readiness) and re-tries
  at the back-off cap. ``ProducerFenced`` means another member owns the partition now:
  its work is dropped, nothing is re-initialised until the group says it is still ours.
* **Counted once.** Counters advance when the transaction that publishes the outcome
  commits (:mod:`service.stream.deferred`).
"""

from service.stream.engine.core import KafkaClientEnded
from service.stream.engine.service import StreamService
from service.stream.engine.settings import StreamSettings, transactional_id_for
from service.stream.engine.state import PartitionView

__all__ = [
    "KafkaClientEnded",
    "PartitionView",
    "StreamService",
    "StreamSettings",
    "transactional_id_for",
]
