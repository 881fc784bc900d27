"""Builders for Nova external-scheduler requests and decisions, as the wire carries them.

``request()`` produces the JSON shape of ``Decision.spec.novaRaw`` (see
tests/fixtures/nova-decision.yaml): ``{"spec": {"nova_object.data": ...},
"context": ..., "hosts": [...], ...}``. It returns plain dicts so tests can put them on
Kafka as-is or decode them with :func:`parse_request`; every field the CR logic reads is a
parameter, everything else has a realistic fixed value.
"""

from __future__ import annotations

import uuid as uuid_mod
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from service.model import Decision, DecisionResult, ExternalSchedulerRequest

__all__ = ["decision", "decision_dict", "flavor", "parse_request", "request"]

DEFAULT_PROJECT = "p1"


def flavor(name: str, *, memory_mb: int = 4096, vcpus: int = 2) -> dict[str, Any]:
    """A Nova Flavor object (``nova_object`` envelope included)."""
    return {
        "nova_object.changes": [],
        "nova_object.data": {
            "created_at": "1970-01-01T00:00:00Z",
            "description": None,
            "disabled": False,
            "ephemeral_gb": 0,
            "extra_specs": {"hw_video:ram_max_mb": "16"},
            "flavorid": name,
            "id": 1,
            "is_public": True,
            "memory_mb": memory_mb,
            "name": name,
            "root_gb": 64,
            "rxtx_factor": 1,
            "swap": 0,
            "updated_at": None,
            "vcpu_weight": 0,
            "vcpus": vcpus,
        },
        "nova_object.name": "Flavor",
        "nova_object.namespace": "nova",
        "nova_object.version": "1.2",
    }


def request(
    instance_uuid: str | None = None,
    *,
    project_id: str = DEFAULT_PROJECT,
    flavor_name: str = "m1.large",
    memory_mb: int = 4096,
    vcpus: int = 2,
    hosts: Sequence[str] = ("host-a",),
    hints: Mapping[str, Any] | None = None,
    skip_cr_tracking: bool | None = None,
    context_project_id: str | None = "",
    availability_zone: str = "az-1",
    weights: Mapping[str, float] | None = None,
    pipeline: str = "nova-external-scheduler",
) -> dict[str, Any]:
    """An ExternalSchedulerRequest as JSON-ready dict.

    ``context_project_id`` "" (default) copies ``project_id`` into the context, None
    leaves the context empty (as in the reference example); ``hints`` None means no
    ``scheduler_hints`` key at all; ``skip_cr_tracking`` None means no ``options`` key.
    """
    uuid = instance_uuid or str(uuid_mod.uuid4())
    data: dict[str, Any] = {
        "availability_zone": availability_zone,
        "flavor": flavor(flavor_name, memory_mb=memory_mb, vcpus=vcpus),
        "force_hosts": None,
        "force_nodes": None,
        "ignore_hosts": None,
        "instance_group": None,
        "instance_uuid": uuid,
        "is_bfv": False,
        "num_instances": 1,
        "numa_topology": None,
        "project_id": project_id,
        "user_id": "u1",
    }
    if hints is not None:
        data["scheduler_hints"] = dict(hints)
    context: dict[str, Any] = {}
    if context_project_id is not None:
        context = {"project_id": context_project_id or project_id, "user": "u1"}
    body: dict[str, Any] = {
        "context": context,
        "hosts": [{"host": h, "hypervisor_hostname": h} for h in hosts],
        "pipeline": pipeline,
        "live": False,
        "rebuild": False,
        "resize": False,
        "vmware": False,
        "spec": {
            "nova_object.changes": [],
            "nova_object.data": data,
            "nova_object.name": "RequestSpec",
            "nova_object.namespace": "nova",
            "nova_object.version": "1.14",
        },
        "weights": dict(weights) if weights is not None else {h: 1.0 for h in hosts},
    }
    if skip_cr_tracking is not None:
        body["options"] = {"skip_committed_resource_tracking": skip_cr_tracking}
    return body


def parse_request(body: Mapping[str, Any]) -> ExternalSchedulerRequest:
    """Decode a :func:`request` dict into the model the Recorder takes."""
    return msgspec.convert(dict(body), ExternalSchedulerRequest)


def decision_dict(
    target_host: str | None,
    ordered_hosts: Sequence[str] | None = None,
    *,
    intent: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """A scheduling decision as JSON; ``ordered_hosts`` defaults to ``[target_host]``."""
    if ordered_hosts is None:
        ordered_hosts = [target_host] if target_host is not None else []
    result: dict[str, Any] = {"orderedHosts": list(ordered_hosts)}
    if target_host is not None:
        result["targetHost"] = target_host
    out: dict[str, Any] = {"result": result}
    if intent is not None:
        out["intent"] = intent
    if name is not None:
        out["name"] = name
    return out


def decision(
    target_host: str | None,
    ordered_hosts: Sequence[str] | None = None,
    *,
    intent: str | None = None,
) -> Decision:
    """The :class:`~service.model.Decision` model of :func:`decision_dict`."""
    if ordered_hosts is None:
        ordered_hosts = [target_host] if target_host is not None else []
    return Decision(
        result=DecisionResult(target_host=target_host, ordered_hosts=list(ordered_hosts)),
        intent=intent,
    )
