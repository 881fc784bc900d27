"""Offset bookkeeping of one input partition: what is done, what may be committed.

Records of one partition complete out of order (different keys run concurrently), so the
committed position cannot simply be "last done + 1". As in Confluent's Parallel Consumer,
a commit carries two things:

* the **watermark**: the lowest offset not yet done. Kafka's committed offset is set to
  it, so a new owner starts there;
* in the offset's **metadata**, the records *above* the watermark that are done as well
  (their outputs are in the same transaction): the highest done offset and the few
  offsets below it that are still open. A new owner restores this and skips what was
  done, so a record that completed behind a stuck one is never processed twice.

Restored knowledge stays authoritative until the fetch position passes it. The ledger is
pure bookkeeping (no Kafka, no asyncio): the engine feeds it offsets and outputs and asks
it what to commit; its unit tests run in microseconds.

Metadata format, versioned so a future change can be told apart::

    crs1:<high - low>:<open offset - low>,<...>       (numbers in base 36)

``high`` is the highest done offset, the listed offsets (all in ``(low, high)``) are still
open; everything else in ``[low, high]`` except ``low`` itself is done. An empty string
means "nothing done above the watermark". Unparseable metadata (another tool committed
the group) is ignored: the worst case is reprocessing, which the Kubernetes write's
idempotency makes harmless.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["METADATA_PREFIX", "CommitPlan", "Ledger", "decode_metadata", "encode_metadata"]

METADATA_PREFIX = "crs1:"
# The broker's offset.metadata.max.bytes defaults to 4096; stay well below it.
MAX_METADATA_CHARS = 3000

T = TypeVar("T")


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    if n == 0:
        return "0"
    out = []
    while n:
        n, r = divmod(n, 36)
        out.append(digits[r])
    return "".join(reversed(out))


def encode_metadata(low: int, high: int | None, open_offsets: Iterable[int]) -> str:
    """Metadata for watermark ``low``: done up to ``high`` except ``open_offsets``."""
    if high is None or high <= low:
        return ""
    opens = ",".join(_b36(o - low) for o in sorted(open_offsets) if low < o < high)
    return f"{METADATA_PREFIX}{_b36(high - low)}:{opens}"


def decode_metadata(low: int, metadata: str | None) -> tuple[int | None, list[int]]:
    """``(high, open offsets)`` from committed metadata; ``(None, [])`` when there is none."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return None, []
    try:
        high_part, _, open_part = metadata[len(METADATA_PREFIX) :].partition(":")
        high = low + int(high_part, 36)
        opens = sorted({low + int(p, 36) for p in open_part.split(",") if p})
    except ValueError:
        return None, []
    if high <= low or any(not low < o < high for o in opens):
        return None, []
    return high, opens


@dataclass(frozen=True, slots=True)
class CommitPlan(Generic[T]):
    """What one commit publishes: outputs (in completion order) and the offset to commit."""

    items: list[tuple[int, T]]  # (input offset, payload) in completion order
    offset: int  # the watermark: Kafka's committed offset
    metadata: str


class Ledger(Generic[T]):
    """Done/open offsets of one partition and the outputs not yet committed.

    ``start`` is the committed watermark the partition was taken over at (None: no commit
    yet, the first record received sets it); ``metadata`` the committed metadata.
    """

    def __init__(self, start: int | None = None, metadata: str | None = None) -> None:
        self._next: int | None = start  # the next offset expected from the fetcher
        self._low = start
        self._high: int | None = None  # highest offset done (restored or completed)
        self._restored_open: list[int] = []  # restored open offsets not yet received
        if start is not None:
            high, opens = decode_metadata(start, metadata)
            if high is not None:
                self._high = high
                self._restored_open = [start, *opens]
        self._pending: dict[int, None] = {}  # received, not done (insertion = offset order)
        self._done: list[tuple[int, T]] = []  # done, not yet committed
        # What was last committed; restored knowledge is already committed, so taking a
        # partition over commits nothing by itself.
        self._last: tuple[int, str] | None = (start, metadata or "") if start is not None else None

    # ------------------------------------------------------------------ feeding

    def receive(self, offset: int) -> bool:
        """A record arrived. True: process it; False: skip (already done, or a repeat)."""
        if self._next is not None and offset < self._next:
            # Already received. The engine never feeds one (a record below this offset
            # means Kafka reset the fetch, and the partition is taken over again from
            # there: StreamService._fetch_reset); the ledger keeps its own contract.
            return False
        if self._low is None:
            self._low = offset
        self._next = offset + 1
        if self._restored_open and self._restored_open[0] <= offset:
            # Restored open offsets the fetch skipped over no longer exist (compaction,
            # transaction markers): they are no longer open.
            i = bisect.bisect_left(self._restored_open, offset)
            hit = i < len(self._restored_open) and self._restored_open[i] == offset
            del self._restored_open[: i + (1 if hit else 0)]
            if hit:
                self._pending[offset] = None
                return True
        if self._high is not None and offset <= self._high:
            return False  # done by a previous owner, committed with the watermark
        self._pending[offset] = None
        return True

    def complete(self, offset: int, payload: T) -> None:
        """The record at ``offset`` is decided; ``payload`` is what its commit publishes."""
        del self._pending[offset]
        self._done.append((offset, payload))
        if self._high is None or offset > self._high:
            self._high = offset

    # ------------------------------------------------------------------ queries

    @property
    def in_flight(self) -> int:
        """Received but not committed: the partition's share of memory and backpressure."""
        return len(self._pending) + len(self._done)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def is_pending(self, offset: int) -> bool:
        """Whether the record at ``offset`` was received and is not decided yet."""
        return offset in self._pending

    @property
    def done_uncommitted(self) -> int:
        return len(self._done)

    @property
    def next_expected(self) -> int | None:
        """The offset after the last one received (or the start): where fetching must
        go on from. None: nothing received and no committed start."""
        return self._next

    @property
    def position(self) -> int | None:
        """The watermark a commit now would write (None: nothing received yet)."""
        candidates = []
        if self._pending:
            candidates.append(next(iter(self._pending)))
        if self._restored_open:
            candidates.append(self._restored_open[0])
        if candidates:
            return min(candidates)
        return self._past_received()

    def settled_position(self) -> int | None:
        """The watermark once every record received so far is done (with no metadata);
        None while restored offsets are still open or nothing was received."""
        return None if self._restored_open else self._past_received()

    def _past_received(self) -> int | None:
        """The watermark with nothing open: past every record received and every one done."""
        if self._next is None:
            return None
        if self._high is not None and self._high >= self._next:
            return self._high + 1
        return self._next

    def _open_below(self, high: int) -> list[int]:
        opens = [o for o in self._pending if o < high]
        opens.extend(o for o in self._restored_open if o < high)
        return sorted(opens)

    def plan(self) -> CommitPlan[T] | None:
        """What to commit now, or None when nothing changed since the last commit.

        If the open offsets would not fit the metadata, only the outputs up to the highest
        offset already committed as done are committed (with the metadata that says so:
        it fits, since no offset below it can open again and the watermark only rises);
        the rest waits until the stuck records finish.
        """
        low = self.position
        if low is None:
            return None
        high = self._high
        metadata = encode_metadata(low, high, self._open_below(high)) if high is not None else ""
        items = list(self._done)
        if len(metadata) > MAX_METADATA_CHARS:
            # The highest offset the last commit recorded as done above its watermark:
            # whatever this commit writes must still say so.
            kept = decode_metadata(*self._last)[0] if self._last is not None else None
            if kept is None or kept <= low:
                items = [(o, p) for o, p in self._done if o < low]
                metadata = ""
            else:
                items = [(o, p) for o, p in self._done if o <= kept]
                metadata = encode_metadata(low, kept, self._open_below(kept))
            if not items:
                return None
        if not items and self._last == (low, metadata):
            return None
        return CommitPlan(items=items, offset=low, metadata=metadata)

    def committed(self, plan: CommitPlan[T]) -> None:
        """``plan`` is committed: forget its outputs."""
        done = {o for o, _ in plan.items}
        self._done = [(o, p) for o, p in self._done if o not in done]
        self._last = (plan.offset, plan.metadata)
