"""The producers' partitioner equals Kafka's default one (aiokafka's murmur2)."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from service.stream.partitioner import murmur2, partition_for_key


@given(st.binary(max_size=200))
def test_murmur2_equals_aiokafkas(data: bytes) -> None:
    assert murmur2(data) == aiokafka_murmur2(data)


@pytest.mark.parametrize(
    ("key", "java"),
    [  # Kafka's UtilsTest.testMurmur2 (Java ints: signed)
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
    ],
)
def test_known_values_of_the_java_client(key: bytes, java: int) -> None:
    assert murmur2(key) == java & 0xFFFFFFFF


@given(st.binary(min_size=1, max_size=64), st.integers(min_value=1, max_value=64))
def test_partition_for_key_equals_the_default_partitioner(key: bytes, n: int) -> None:
    parts = list(range(n))
    assert partition_for_key(key, parts, parts) == DefaultPartitioner()(key, parts, parts)


def test_keyless_records_go_to_an_available_partition() -> None:
    assert partition_for_key(None, [0, 1, 2], [2]) == 2
    assert partition_for_key(None, [0, 1, 2], []) in (0, 1, 2)
