"""The two counters: exposed names, label order, and registry isolation."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from service.crs import new_no_host_found_counter, new_placement_counter


def test_placement_counter_name_and_labels() -> None:
    registry = CollectorRegistry()
    counter = new_placement_counter(registry)
    assert counter._labelnames == ("flavor_group", "intent", "cr_slot")
    counter.labels("g", "create", "slot_used").inc()  # positional order is the contract
    text = generate_latest(registry).decode()
    assert "# TYPE cortex_nova_placement_total counter" in text
    assert (
        registry.get_sample_value(
            "cortex_nova_placement_total",
            {"flavor_group": "g", "intent": "create", "cr_slot": "slot_used"},
        )
        == 1.0
    )


def test_no_host_found_counter_name_and_label_order() -> None:
    registry = CollectorRegistry()
    counter = new_no_host_found_counter(registry)
    assert counter._labelnames == ("cr_slot", "flavor_group", "intent")
    # Positional order is the contract: cr_slot, flavor_group, intent.
    counter.labels("error", "unknown", "Unknown").inc(2)
    text = generate_latest(registry).decode()
    assert "# TYPE cortex_nova_no_host_found_total counter" in text
    assert (
        registry.get_sample_value(
            "cortex_nova_no_host_found_total",
            {"cr_slot": "error", "flavor_group": "unknown", "intent": "Unknown"},
        )
        == 2.0
    )


def test_default_registry_is_private_and_not_global() -> None:
    before = set(REGISTRY._names_to_collectors)
    first = new_placement_counter()
    second = new_placement_counter()  # would raise "Duplicated timeseries" in a shared registry
    new_no_host_found_counter()
    new_no_host_found_counter()
    assert set(REGISTRY._names_to_collectors) == before
    first.labels("g", "create", "no_cr").inc()
    assert second.labels("g", "create", "no_cr")._value.get() == 0
