"""bench/stage_trace (the per-stage tracer for trials) and bench/stage_report.py."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO


def _load(name: str, path: Path) -> ModuleType:
    # bench/ is a directory of scripts, not a package.
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_traced_method_exists() -> None:
    # The tracer wraps private engine and client methods by name: a rename must fail
    # here, not leave a trial that traces nothing.
    tracer = _load("stage_trace_sitecustomize", REPO / "bench" / "stage_trace" / "sitecustomize.py")
    from aiokafka.conn import AIOKafkaConnection

    assert callable(AIOKafkaConnection.send)  # counted by _count_requests
    from service.stream.metrics import StreamMetrics

    assert StreamMetrics().produced_ahead.labels("published")._value.get() == 0  # dump()
    for module, cls, method, _ in tracer.TARGETS:
        assert callable(getattr(getattr(importlib.import_module(module), cls), method)), (
            f"{module}.{cls}.{method}"
        )


def test_the_report_splits_a_record_into_its_stages(tmp_path: Path) -> None:
    # One placement: published at 100.000, fetched 2 ms later, decided from 100.003 to
    # 100.009, committed from 100.010 to 100.012 (ahead), the EndTxn in the last 0.5 ms.
    events = [
        ["fetched", 0, 7, 100.000, 100.002],
        ["decided", 0, 7, 100.003, 100.009],
        ["sent", 0, 8, 100.010, 100.012, True],
        ["end_txn", 0, 0, 100.0115, 100.012],
        ["kafka_requests", {"EndTxnRequest": 1, "ProduceRequest": 2}],
        ["produced_ahead", {"published": 1.0, "discarded": 0.0}],
    ]
    (tmp_path / "t.123").write_text(json.dumps(events))
    report = subprocess.run(
        [sys.executable, str(REPO / "bench" / "stage_report.py"), str(tmp_path / "t")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stages = report.split("commits:")[0]
    lines = {line.split()[0]: line.split()[1] for line in stages.splitlines() if line[:2] == "  "}
    assert lines == {
        "fetch": "2.00",
        "queue": "1.00",
        "decide": "6.00",
        "to_commit": "1.00",
        "commit": "2.00",
        "total": "12.00",
    }
    assert "placements (decided in over 2 ms): 1 records" in report
    assert "commits: 1, of them opened ahead: 1" in report
    assert "EndTxn: 1, ms p50 0.50" in report
    assert "ProduceRequest" in report
    assert "2.00 per record" in report
    assert "outputs produced ahead: 1 published, 0 discarded" in report


def test_the_report_fails_on_an_empty_trace(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "stage_report.py"), str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
