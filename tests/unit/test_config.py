"""Configuration: env, CLI overrides, defaults for the dev stack, errors naming the variable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.app.cli import build_parser, main
from service.app.config import SETTINGS, Config, ConfigError
from tests.conftest import REPO


def test_defaults_work_on_the_dev_stack() -> None:
    c = Config.load(env={})
    assert c.bootstrap_servers == "127.0.0.1:19092"
    assert (c.input_topic, c.output_topic, c.dlq_topic) == (
        "nova.scheduling-outcomes",
        "cortex.crs.classifications",
        "nova.scheduling-outcomes.dlq",
    )
    assert c.group_id == "cortex-crs-consumer"
    assert c.exactly_once is True
    assert c.http_port == 8080
    assert c.k8s_read_mode == "watch"
    assert c.kubeconfig is None  # in-cluster unless KUBECONFIG is set


def test_environment_then_cli_override() -> None:
    env = {"CRS_INPUT_TOPIC": "from-env", "CRS_MAX_ATTEMPTS": "9", "CRS_EXACTLY_ONCE": "false"}
    c = Config.load(env=env, overrides={"input_topic": "from-cli"})
    assert c.input_topic == "from-cli"
    assert c.max_attempts == 9
    assert c.exactly_once is False


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"CRS_HTTP_PORT": "http"}, "CRS_HTTP_PORT"),
        ({"CRS_HTTP_PORT": "70000"}, "CRS_HTTP_PORT"),
        ({"CRS_MAX_ATTEMPTS": "0"}, "CRS_MAX_ATTEMPTS"),
        ({"CRS_EXACTLY_ONCE": "maybe"}, "CRS_EXACTLY_ONCE"),
        ({"CRS_K8S_READ_MODE": "poll"}, "CRS_K8S_READ_MODE"),
        ({"CRS_LOG_FORMAT": "xml"}, "CRS_LOG_FORMAT"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "KAFKA_SASL_MECHANISM"),
        ({"CRS_OUTPUT_TOPIC": "nova.scheduling-outcomes"}, "CRS_OUTPUT_TOPIC"),
    ],
)
def test_invalid_values_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config.load(env=env)


def test_secrets_are_masked_in_errors_and_redacted_views() -> None:
    env = {
        "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "KAFKA_SASL_MECHANISM": "PLAIN",
        "KAFKA_SASL_USERNAME": "u",
        "KAFKA_SASL_PASSWORD": "hunter2",
    }
    c = Config.load(env=env)
    assert c.kafka_client_args()["sasl_plain_password"] == "hunter2"
    assert "hunter2" not in repr(c.redacted())


def test_every_setting_has_a_flag() -> None:
    help_text = build_parser().format_help()
    run_help = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    assert "run" in help_text
    for s in SETTINGS:
        assert f"--{s.field.replace('_', '-')}" in run_help
        assert s.env in run_help


def test_cli_exits_2_naming_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--http-port", "not-a-port"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--http-port" in err


def test_module_entry_point_is_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0
    assert "check" in proc.stdout
    # The demo and seeding commands moved to their own tool, out of the service's package.
    assert "seed" not in proc.stdout
    demo = subprocess.run(
        [sys.executable, "-m", "crs_demo", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr
    assert "demo" in demo.stdout
    assert "seed" in demo.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "service", "check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={"PATH": "/usr/bin:/bin", "CRS_MAX_BATCH": "-1"},
    )
    assert bad.returncode == 2
    assert "CRS_MAX_BATCH" in bad.stderr
