"""Configuration: env, CLI overrides, defaults for the dev stack, errors naming the variable."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from crs_demo import demo as crs_demo_module
from crs_demo.cli import main as demo_main
from service.app import config as config_module
from service.app import logs as logs_module
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


def test_every_default_meets_its_own_constraint() -> None:
    # Defaults are typed values, not parsed text: a strict round trip checks each against
    # the constraint of its field (a default of 0 for a positive setting fails here).
    defaults = msgspec.structs.asdict(Config())
    assert msgspec.convert(defaults, Config) == Config()
    assert {s.field for s in SETTINGS} == set(defaults)


def test_a_field_without_variable_or_default_is_refused_at_import() -> None:
    class Undeclared(msgspec.Struct):
        knob: int = 1

    class NoDefault(msgspec.Struct):
        knob: Annotated[int, config_module._env("CRS_KNOB", "A knob")]

    with pytest.raises(TypeError, match=r"Undeclared\.knob is declared without _env"):
        config_module._settings(Undeclared)
    with pytest.raises(TypeError, match=r"NoDefault\.knob has no default"):
        config_module._settings(NoDefault)


def test_the_variables_the_service_names_are_its_settings() -> None:
    # Error and check messages name variables by hand: each must be a real one.
    known = {s.env for s in SETTINGS} | {s.file_env for s in SETTINGS if s.secret}
    for path in (REPO / "service").rglob("*.py"):
        named = set(re.findall(r"\b(?:CRS|KAFKA)_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
        assert named <= known, f"{path.name} names unknown variables: {sorted(named - known)}"


def test_choices_ignore_case_and_booleans_take_words() -> None:
    c = Config.load(env={"CRS_LOG_LEVEL": "debug", "CRS_EXACTLY_ONCE": "off",
                         "CRS_K8S_READ_MODE": " List "})  # fmt: skip
    assert (c.log_level, c.exactly_once, c.k8s_read_mode) == ("DEBUG", False, "list")
    assert Config.load(env={"CRS_EXACTLY_ONCE": "Yes"}).exactly_once is True


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CRS_HTTP_PORT": "70000"}, "CRS_HTTP_PORT='70000': must be an integer from 0 to 65535"),
        ({"CRS_MAX_BATCH": "1.5"}, "CRS_MAX_BATCH='1.5': must be a positive integer"),
        ({"CRS_REVOKE_WAIT_S": "0"}, "CRS_REVOKE_WAIT_S='0': must be a positive number"),
        ({"CRS_LOG_FORMAT": "xml"}, "CRS_LOG_FORMAT='xml': must be one of console, json"),
        ({"CRS_GROUP_ID": " "}, "CRS_GROUP_ID=' ': must be a non-empty text"),
    ],
)
def test_errors_say_what_the_constraint_wants(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config.load(env=env)
    assert str(err.value) == message


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
        ({"CRS_CONFLICT_RETRIES": "-1"}, "CRS_CONFLICT_RETRIES"),
        ({"CRS_CONFLICT_BACKOFF_MAX_S": "0.001"}, "CRS_CONFLICT_BACKOFF_MAX_S"),
        ({"CRS_WATCH_BACKOFF_S": "60"}, "CRS_WATCH_BACKOFF_MAX_S"),
        ({"CRS_WATCH_TIMEOUT_S": "0.5"}, "CRS_WATCH_TIMEOUT_S"),  # the server counts seconds
        ({"CRS_WATCH_TIMEOUT_S": "20"}, "CRS_WATCH_TIMEOUT_S must be at most half of"),
        ({"CRS_K8S_PAGE_SIZE": "0"}, "CRS_K8S_PAGE_SIZE"),
        ({"CRS_LIVENESS_BOUND_S": "never"}, "CRS_LIVENESS_BOUND_S"),
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
        assert s.flag in run_help
        assert s.env in run_help


def test_cli_exits_2_naming_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--http-port", "not-a-port"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--http-port" in err


def test_an_address_not_on_this_host_exits_2_like_any_invalid_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found only when the HTTP server binds, the first step of the start (before Kafka or
    # Kubernetes is contacted, so no dev stack is needed): it exited 1, a start-up
    # failure, where a configuration error is documented to exit 2.
    for env in ("KUBECONFIG", "KAFKA_SSL_CAFILE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("CRS_HTTP_HOST", "203.0.113.7")  # TEST-NET-3: on no host
    monkeypatch.setenv("CRS_HTTP_PORT", "0")
    monkeypatch.setattr(logs_module, "configure_logging", lambda *_: None)  # keep global state
    assert main(["run"]) == 2
    captured = capsys.readouterr()
    assert "CRS_HTTP_HOST='203.0.113.7'" in captured.out + captured.err


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


# ---------------------------------------------------------------- secrets and client TLS

SASL = {
    "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "KAFKA_SASL_USERNAME": "crs",
}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def client_cert(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A client certificate with a plain key and the same key encrypted ("s3cret")."""
    d = tmp_path_factory.mktemp("pki")
    key, crt, enc = d / "user.key", d / "user.crt", d / "user-enc.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(crt), "-subj", "/CN=crs", "-days", "1")  # fmt: skip
    _openssl("pkey", "-in", str(key), "-out", str(enc), "-aes256", "-passout", "pass:s3cret")
    other = d / "other.key"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(other))  # fmt: skip
    return {"crt": str(crt), "key": str(key), "enc": str(enc), "other": str(other)}


def test_a_secret_is_read_from_its_file_variable(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    c = Config.load(env={**SASL, "KAFKA_SASL_PASSWORD_FILE": str(secret)})
    assert c.sasl_password == "from-file"  # the editor's trailing newline is not part of it
    assert c.kafka_client_args()["sasl_plain_password"] == "from-file"
    assert "from-file" not in repr(c.redacted())


def test_a_secret_file_given_by_flag_wins_over_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("flag-file")
    env = {**SASL, "KAFKA_SASL_PASSWORD": "from-env"}
    c = Config.load(env=env, overrides={"sasl_password_file": str(secret)})
    assert c.sasl_password == "flag-file"


def test_a_secret_and_its_file_variable_together_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("x")
    env = {**SASL, "KAFKA_SASL_PASSWORD": "y", "KAFKA_SASL_PASSWORD_FILE": str(secret)}
    with pytest.raises(ConfigError, match="KAFKA_SASL_PASSWORD and KAFKA_SASL_PASSWORD_FILE"):
        Config.load(env=env)


def test_an_unreadable_secret_file_is_named_without_its_content(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"KAFKA_SASL_PASSWORD_FILE=.*nope") as err:
        Config.load(env={**SASL, "KAFKA_SASL_PASSWORD_FILE": str(missing)})
    assert "cannot read" in str(err.value)
    empty = tmp_path / "empty"
    empty.write_text("\n")  # an empty secret is no secret: the SASL check names the variable
    with pytest.raises(ConfigError, match="KAFKA_SASL_PASSWORD is required"):
        Config.load(env={**SASL, "KAFKA_SASL_PASSWORD_FILE": str(empty)})


def test_secrets_have_no_value_flag_and_the_old_one_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    secrets = [s for s in SETTINGS if s.secret]
    assert {s.env for s in secrets} == {"KAFKA_SASL_PASSWORD", "KAFKA_SSL_KEY_PASSWORD"}
    run_help = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    assert "--sasl-password-file" in run_help
    assert "--sasl-password " not in run_help
    assert main(["check", "--sasl-password", "hunter2"]) == 2
    err = capsys.readouterr().err
    assert "KAFKA_SASL_PASSWORD_FILE" in err
    assert "hunter2" not in err


def test_the_demo_tool_refuses_a_secret_flag_value_as_the_service_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It takes the same settings, so it also parsed the hidden --sasl-password flag, and
    # went on without the password (the flag's value was silently dropped).
    async def demo(*_: object, **__: object) -> int:
        return 0

    monkeypatch.setattr(crs_demo_module, "demo", demo)  # no cluster: only the refusal counts
    assert main(["check", "--sasl-password", "hunter2"]) == 2
    service_err = capsys.readouterr().err
    assert demo_main(["demo", "--sasl-password", "hunter2"]) == 2
    demo_err = capsys.readouterr().err
    assert demo_err.startswith("crs-consumer-demo: ")
    assert demo_err.removeprefix("crs-consumer-demo: ") == service_err.removeprefix(
        "crs-consumer: "
    )
    assert "hunter2" not in demo_err


def test_cli_reads_the_password_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("pw")
    # A wrong mechanism stops the CLI at configuration time, after the file was read: the
    # error names the mechanism, not the password, so the file was accepted.
    proc = subprocess.run(
        [sys.executable, "-m", "service", "check", "--sasl-password-file", str(secret),
         "--security-protocol", "SASL_PLAINTEXT", "--sasl-username", "u",
         "--sasl-mechanism", "GSSAPI"],
        capture_output=True, text=True, cwd=REPO, check=False, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "KAFKA_SASL_MECHANISM" in proc.stderr or "--sasl-mechanism" in proc.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "service", "check", "--sasl-password-file", str(tmp_path / "x")],
        capture_output=True, text=True, cwd=REPO, check=False, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert missing.returncode == 2
    assert "--sasl-password-file" in missing.stderr


def test_client_certificate_settings_build_an_mtls_context(client_cert: dict[str, str]) -> None:
    env = {
        "KAFKA_SECURITY_PROTOCOL": "SSL",
        "KAFKA_SSL_CERTFILE": client_cert["crt"],
        "KAFKA_SSL_KEYFILE": client_cert["enc"],
        "KAFKA_SSL_KEY_PASSWORD": "s3cret",
    }
    c = Config.load(env=env)
    ctx = c.kafka_client_args()["ssl_context"]
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert "s3cret" not in repr(c.redacted())
    plain = Config.load(
        env={"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CERTFILE": client_cert["crt"],
             "KAFKA_SSL_KEYFILE": client_cert["key"]}
    )  # fmt: skip
    assert plain.ssl_key_password is None


def test_the_key_password_also_comes_from_a_file(
    client_cert: dict[str, str], tmp_path: Path
) -> None:
    pw = tmp_path / "key-password"
    pw.write_text("s3cret\n")
    env = {
        "KAFKA_SECURITY_PROTOCOL": "SSL",
        "KAFKA_SSL_CERTFILE": client_cert["crt"],
        "KAFKA_SSL_KEYFILE": client_cert["enc"],
        "KAFKA_SSL_KEY_PASSWORD_FILE": str(pw),
    }
    assert Config.load(env=env).ssl_key_password == "s3cret"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"KAFKA_SSL_KEY_PASSWORD": "wrong"}, "KAFKA_SSL_KEY_PASSWORD"),
        ({"KAFKA_SSL_KEY_PASSWORD": ""}, "KAFKA_SSL_KEY_PASSWORD"),  # no terminal prompt
        ({"KAFKA_SSL_KEYFILE": "other"}, "KAFKA_SSL_KEYFILE"),  # key of another certificate
        ({"KAFKA_SSL_CERTFILE": "/nonexistent.crt"}, "KAFKA_SSL_CERTFILE"),
        ({"KAFKA_SSL_KEYFILE": None}, "KAFKA_SSL_KEYFILE"),
        ({"KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}, "KAFKA_SSL_CERTFILE"),
    ],
)
def test_bad_client_tls_settings_name_the_variable(
    client_cert: dict[str, str], change: dict[str, str | None], named: str
) -> None:
    env: dict[str, str | None] = {
        "KAFKA_SECURITY_PROTOCOL": "SSL",
        "KAFKA_SSL_CERTFILE": client_cert["crt"],
        "KAFKA_SSL_KEYFILE": client_cert["enc"],
        "KAFKA_SSL_KEY_PASSWORD": "s3cret",
    }
    for key, value in change.items():
        env[key] = client_cert.get(value, value) if value else value
    with pytest.raises(ConfigError, match=named):
        Config.load(env={k: v for k, v in env.items() if v is not None})


def test_to_env_configures_a_child_process_exactly_so() -> None:
    # The subprocess helpers of the tests and benchmarks start the service from this.
    env = {
        **SASL,
        "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "KAFKA_SASL_PASSWORD": "pw",
        "CRS_EXACTLY_ONCE": "false",
        "CRS_REVOKE_WAIT_S": "0.25",
        "CRS_HTTP_PORT": "0",
    }
    config = Config.load(env=env)
    assert Config.load(env=config.to_env()) == config
    assert config.to_env()["CRS_EXACTLY_ONCE"] == "false"
    assert Config.load(env=Config().to_env()) == Config()


def test_the_rebalance_callbacks_stay_well_inside_the_session_timeout() -> None:
    # aiokafka sends no heartbeat while a revoke or an assignment callback runs.
    from service.stream.engine import StreamSettings

    for session_ms in ("10000", "45000"):
        c = Config.load(env={"CRS_SESSION_TIMEOUT_MS": session_ms})
        s = StreamSettings.from_config(c)
        assert s.assign_wait_s * 1000 <= c.session_timeout_ms / 3
        assert s.revoke_wait_s * 1000 <= c.session_timeout_ms / 2
        assert (s.revoke_wait_s + s.revoke_commit_s) * 1000 < c.session_timeout_ms


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CRS_SESSION_TIMEOUT_MS": "3000"}, "CRS_SESSION_TIMEOUT_MS must be at least 6000"),
        (
            {"CRS_LIVENESS_BOUND_S": "60", "CRS_RETRY_BACKOFF_MAX_S": "60"},
            "CRS_LIVENESS_BOUND_S must exceed CRS_RETRY_BACKOFF_MAX_S plus CRS_POLL_TIMEOUT_MS",
        ),
    ],
)
def test_settings_that_would_break_the_running_service_are_refused_at_start(
    env: dict[str, str], message: str
) -> None:
    # A session below the broker's minimum fails every JoinGroup (the loop would retry
    # forever); a liveness bound inside the fetch back-off restarts a pod waiting out an
    # outage.
    with pytest.raises(ConfigError, match=message):
        Config.load(env=env)
    Config.load(env={"CRS_SESSION_TIMEOUT_MS": "6000"})
    Config.load(env={"CRS_LIVENESS_BOUND_S": "61", "CRS_RETRY_BACKOFF_MAX_S": "60"})
