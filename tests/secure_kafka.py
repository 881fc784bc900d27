"""The dev stack's secured broker (devstack/up --secure-kafka): clients, users and ACLs.

Set-up (topics, ACLs) goes through the SCRAM super user ``admin``; the service runs as
``crs-sasl`` (SASL_SSL, SCRAM-SHA-512) or as the certificate ``CN=crs-mtls`` (mTLS),
neither of which can do anything without an ACL.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.admin import CreateAclsRequest, DeleteAclsRequest
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactBytes,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from service.app.kafka_access import Acl

# org.apache.kafka.common.{resource.ResourceType, resource.PatternType, acl.AclOperation,
# acl.AclPermissionType} codes.
RESOURCE_TYPE = {"Topic": 2, "Group": 3, "Cluster": 4, "TransactionalId": 5}
PATTERN = {"literal": 3, "prefix": 4}
OPERATION = {"Read": 3, "Write": 4, "Describe": 8}
PERMISSION = {"allow": 3, "deny": 2}


@dataclass(frozen=True)
class SecureKafka:
    env: dict[str, str]

    @property
    def sasl_bootstrap(self) -> str:
        return self.env["CRS_SECURE_KAFKA_SASL_BOOTSTRAP"]

    @property
    def sasl_principal(self) -> str:
        return f"User:{self.env['CRS_SECURE_KAFKA_SASL_USER']}"

    @property
    def mtls_principal(self) -> str:
        return self.env["CRS_SECURE_KAFKA_MTLS_PRINCIPAL"]

    def admin_args(self) -> dict[str, Any]:
        password = Path(self.env["CRS_SECURE_KAFKA_ADMIN_PASSWORD_FILE"]).read_text().strip()
        return {
            "bootstrap_servers": self.sasl_bootstrap,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": self.env["CRS_SECURE_KAFKA_ADMIN_USER"],
            "sasl_plain_password": password,
            "ssl_context": ssl.create_default_context(cafile=self.env["CRS_SECURE_KAFKA_CA"]),
        }

    def sasl_env(self) -> dict[str, str]:
        """The service's settings as the SCRAM user (password from a file, as in a pod)."""
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.sasl_bootstrap,
            "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "KAFKA_SASL_USERNAME": self.env["CRS_SECURE_KAFKA_SASL_USER"],
            "KAFKA_SASL_PASSWORD_FILE": self.env["CRS_SECURE_KAFKA_SASL_PASSWORD_FILE"],
            "KAFKA_SSL_CAFILE": self.env["CRS_SECURE_KAFKA_CA"],
        }

    def mtls_env(self) -> dict[str, str]:
        """The service's settings as the certificate user (encrypted key, password file)."""
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.env["CRS_SECURE_KAFKA_MTLS_BOOTSTRAP"],
            "KAFKA_SECURITY_PROTOCOL": "SSL",
            "KAFKA_SSL_CAFILE": self.env["CRS_SECURE_KAFKA_CA"],
            "KAFKA_SSL_CERTFILE": self.env["CRS_SECURE_KAFKA_MTLS_CERT"],
            "KAFKA_SSL_KEYFILE": self.env["CRS_SECURE_KAFKA_MTLS_KEY"],
            "KAFKA_SSL_KEY_PASSWORD_FILE": self.env["CRS_SECURE_KAFKA_MTLS_KEY_PASSWORD_FILE"],
        }

    def issue_client_cert(self, cn: str, days: int = 2) -> dict[str, bytes]:
        """A new client certificate for ``User:CN=<cn>`` from the dev CA (a random serial),
        as a Strimzi KafkaUser's Secret holds it: ``user.crt``, ``user.key`` (encrypted)
        and ``user.password``, by file name."""
        pki = Path(self.env["CRS_SECURE_KAFKA_CA"]).parent
        ca_key = pki / "ca.key"
        assert ca_key.is_file(), f"the dev CA's key is not at {ca_key} (devstack/secure-kafka.sh)"
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            password = secrets.token_hex(16)
            (d / "user.password").write_text(password)
            (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
            openssl = ["openssl"]
            for args in (
                ["req", "-newkey", "rsa:2048", "-subj", f"/CN={cn}",
                 "-passout", f"file:{d / 'user.password'}",
                 "-keyout", str(d / "user.key"), "-out", str(d / "user.csr")],
                ["x509", "-req", "-in", str(d / "user.csr"), "-CA", self.env["CRS_SECURE_KAFKA_CA"],
                 "-CAkey", str(ca_key), "-set_serial", f"0x{secrets.token_hex(16)}",
                 "-days", str(days), "-extfile", str(d / "client.ext"),
                 "-out", str(d / "user.crt")],
            ):  # fmt: skip
                subprocess.run([*openssl, *args], check=True, capture_output=True, timeout=60)
            return {
                name: (d / name).read_bytes() for name in ("user.crt", "user.key", "user.password")
            }

    async def create_topics(self, names: list[str], partitions: int = 2) -> None:
        admin = AIOKafkaAdminClient(**self.admin_args())
        await admin.start()
        try:
            await admin.create_topics([NewTopic(n, partitions, 1) for n in names])
        finally:
            await admin.close()

    async def group_state(self, group: str) -> tuple[str, int]:
        """(state, number of members) of a consumer group, as its coordinator sees it."""
        admin = AIOKafkaAdminClient(**self.admin_args())
        await admin.start()
        try:
            (response,) = await admin.describe_consumer_groups([group])
            _error, _gid, state, _ptype, _protocol, members, *_ = response.groups[0]
            return state, len(members)
        finally:
            await admin.close()

    async def delete_topics(self, names: list[str]) -> None:
        admin = AIOKafkaAdminClient(**self.admin_args())
        await admin.start()
        try:
            await admin.delete_topics(names)
        finally:
            await admin.close()

    async def set_scram_password(self, user: str, password: str | None) -> None:
        """Create the SCRAM-SHA-512 user ``user`` or change its password (``None``:
        delete it), as Strimzi's User Operator does for a KafkaUser."""
        client = AIOKafkaClient(**self.admin_args())
        await client.bootstrap()
        try:
            response = await client.send(client.get_random_node(), _AlterScram(user, password))
            errors = [r for r in response.results if r[1]]
            assert not errors, f"AlterUserScramCredentials failed: {errors}"
        finally:
            await client.close()

    async def _send(self, requests: list[Any]) -> None:
        client = AIOKafkaClient(**self.admin_args())
        await client.bootstrap()
        try:
            for request in requests:
                response = await client.send(client.get_random_node(), request)
                results = getattr(response, "creation_responses", None) or getattr(
                    response, "filter_responses", []
                )
                errors = [r for r in results if r[0]]
                assert not errors, f"ACL request failed: {errors}"
        finally:
            await client.close()

    async def grant(self, principal: str, acls: list[Acl], permission: str = "allow") -> None:
        """Add ALLOW rules, or DENY ones (which win over any ALLOW) with ``permission``."""
        await self._send([CreateAclsRequest(*_acl_args(principal, a, permission)) for a in acls])

    async def revoke(self, principal: str, acls: list[Acl], permission: str = "allow") -> None:
        await self._send([DeleteAclsRequest(*_acl_args(principal, a, permission)) for a in acls])


def _acl_args(
    principal: str, acl: Acl, permission: str
) -> tuple[int, str, int, str, str, int, int]:
    return (
        RESOURCE_TYPE[acl.resource_type],
        acl.name,
        PATTERN[acl.pattern],
        principal,
        "*",
        OPERATION[acl.operation],
        PERMISSION[permission],
    )


# ---------------------------------------------------------------- AlterUserScramCredentials
# Not in aiokafka (KIP-554, API key 51, flexible from v0).

_SCRAM_SHA_512, _SCRAM_ITERATIONS = 2, 4096


class _AlterScramResponse(Response):  # type: ignore[misc]
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("results", CompactArray(
            ("user", CompactString("utf-8")),
            ("error_code", Int16),
            ("error_message", CompactString("utf-8")),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )  # fmt: skip


class _AlterScramStruct(RequestStruct):  # type: ignore[misc]
    API_KEY = 51
    API_VERSION = 0
    FLEXIBLE_VERSION = True
    RESPONSE_TYPE = _AlterScramResponse
    SCHEMA = Schema(
        ("deletions", CompactArray(
            ("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields),
        )),
        ("upsertions", CompactArray(
            ("name", CompactString("utf-8")),
            ("mechanism", Int8),
            ("iterations", Int32),
            ("salt", CompactBytes),
            ("salted_password", CompactBytes),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )  # fmt: skip


class _AlterScram(Request[_AlterScramStruct]):  # type: ignore[misc]
    API_KEY = 51

    def __init__(self, user: str, password: str | None) -> None:
        self._user, self._password = user, password

    def build(self, request_struct_class: type[_AlterScramStruct]) -> Any:
        if self._password is None:
            return request_struct_class([(self._user, _SCRAM_SHA_512, {})], [], {})
        salt = os.urandom(32)
        salted = hashlib.pbkdf2_hmac("sha512", self._password.encode(), salt, _SCRAM_ITERATIONS)
        upsertion = (self._user, _SCRAM_SHA_512, _SCRAM_ITERATIONS, salt, salted, {})
        return request_struct_class([], [upsertion], {})
