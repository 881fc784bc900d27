# shellcheck shell=bash
# The optional second, secured Kafka broker (`devstack/up --secure-kafka`), sourced by up.
#
# The same cached Kafka jars as the plain broker, in its own run directory
# (run/secure-kafka/) and JVM, configured the way a production cluster (Strimzi) is:
#   * SASL_SSL listener, SCRAM-SHA-512 users (server certificate from a dev CA)
#   * SSL listener with client authentication required (mTLS users; the principal is the
#     certificate's subject, `User:CN=<name>`, as for a Strimzi `authentication: tls` user)
#   * StandardAuthorizer, allow.everyone.if.no.acl.found=false: nothing without an ACL
#   * super users: `admin` (SCRAM, for set-up: topics, ACLs) and the broker's own
#     certificate (CN=crs-devstack-broker), used on the controller and inter-broker
#     listeners, which are SSL with client authentication too: no plaintext port at all.
# Users, passwords and certificates are created once per run directory:
#   run/secure-kafka/pki/      ca.crt, broker.pem, crs-mtls.crt, crs-mtls.key (encrypted),
#                              crs-mtls.key.password
#   run/secure-kafka/*.password  admin.password, crs-sasl.password (SCRAM users)
#   run/secure-kafka/env       addresses and file paths for clients and tests

SK_DIR=$RUN_DIR/secure-kafka
SK_PKI=$SK_DIR/pki
SK_DATA=$SK_DIR/data
SK_CONF=$SK_DIR/server.properties

make_secure_kafka_pki() {
  local d=$SK_PKI
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=crs-devstack-kafka-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  # The broker's certificate serves TLS and is also its client identity towards its own
  # controller listener (client auth required there), hence both key usages.
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' >"$d/broker.ext"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=crs-devstack-broker" \
    -keyout "$d/broker.key" -out "$d/broker.csr" 2>/dev/null
  openssl x509 -req -in "$d/broker.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/broker.ext" -out "$d/broker.crt" 2>/dev/null
  # PEM keystore (KIP-651): unencrypted PKCS#8 key followed by the certificate.
  openssl pkcs8 -topk8 -nocrypt -in "$d/broker.key" -out "$d/broker.pk8"
  cat "$d/broker.pk8" "$d/broker.crt" >"$d/broker.pem"
  # The mTLS client user, key encrypted like a real secret would be.
  printf 'extendedKeyUsage=clientAuth\n' >"$d/client.ext"
  openssl rand -hex 16 >"$d/crs-mtls.key.password"
  openssl req -newkey rsa:2048 -subj "/CN=crs-mtls" -passout "file:$d/crs-mtls.key.password" \
    -keyout "$d/crs-mtls.key" -out "$d/crs-mtls.csr" 2>/dev/null
  openssl x509 -req -in "$d/crs-mtls.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/client.ext" -out "$d/crs-mtls.crt" 2>/dev/null
  chmod 600 "$d"/*.key "$d"/*.pem "$d"/*.password
}

start_secure_kafka() {
  local sasl=$SECURE_KAFKA_SASL_PORT mtls=$SECURE_KAFKA_MTLS_PORT ctrl=$SECURE_KAFKA_CONTROLLER_PORT
  mkdir -p "$SK_DIR"
  [ -f "$SK_PKI/crs-mtls.crt" ] || make_secure_kafka_pki
  local u
  for u in admin crs-sasl; do
    [ -f "$SK_DIR/$u.password" ] || (umask 077 && openssl rand -hex 16 >"$SK_DIR/$u.password")
  done
  if ! pid_alive secure-kafka; then
    check_port_free "$sasl" "secure kafka SASL_SSL" CRS_DEVSTACK_SECURE_KAFKA_SASL_PORT
    check_port_free "$mtls" "secure kafka mTLS" CRS_DEVSTACK_SECURE_KAFKA_MTLS_PORT
    check_port_free "$ctrl" "secure kafka controller" CRS_DEVSTACK_SECURE_KAFKA_CONTROLLER_PORT
    cat >"$SK_CONF" <<PROPS
process.roles=broker,controller
node.id=1
listeners=SASL_SSL://127.0.0.1:$sasl,SSL://127.0.0.1:$mtls,CONTROLLER://127.0.0.1:$ctrl
advertised.listeners=SASL_SSL://127.0.0.1:$sasl,SSL://127.0.0.1:$mtls
listener.security.protocol.map=SASL_SSL:SASL_SSL,SSL:SSL,CONTROLLER:SSL
controller.listener.names=CONTROLLER
controller.quorum.bootstrap.servers=127.0.0.1:$ctrl
inter.broker.listener.name=SSL
ssl.keystore.type=PEM
ssl.keystore.location=$SK_PKI/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$SK_PKI/ca.crt
listener.name.ssl.ssl.client.auth=required
listener.name.controller.ssl.client.auth=required
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:CN=crs-devstack-broker
log.dirs=$SK_DATA
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=2
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=2
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
delete.topic.enable=true
log.flush.interval.messages=9223372036854775807
PROPS
    # Smaller heap than the plain broker: it only serves the security tests.
    local java=(java -Xms64m -Xmx384m -XX:+UseG1GC -XX:TieredStopAtLevel=1 -Xshare:auto
      -Dkafka.logs.dir="$SK_DIR" -Dlog4j2.configurationFile="file:$DEVSTACK_DIR/kafka/log4j2.properties"
      -cp "$KAFKA_HOME/libs/*")
    if [ ! -f "$SK_DATA/meta.properties" ]; then
      local cluster_id
      cluster_id=$("${java[@]}" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -1)
      # SCRAM credentials are written into the metadata log at format time (KRaft), so the
      # super user exists before the first connection.
      "${java[@]}" kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$SK_CONF" \
        --add-scram "SCRAM-SHA-512=[name=admin,password=$(cat "$SK_DIR/admin.password")]" \
        --add-scram "SCRAM-SHA-512=[name=crs-sasl,password=$(cat "$SK_DIR/crs-sasl.password")]" \
        >"$SK_DIR/format.log" 2>&1 || die "formatting the secure Kafka storage failed; see $SK_DIR/format.log"
    fi
    start_daemon secure-kafka "${java[@]}" kafka.Kafka "$SK_CONF"
  fi
  secure_kafka_started() { port_open "$sasl" && port_open "$mtls" && grep -q "Kafka Server started" "$SK_DIR/kafka-server.log"; }
  wait_for "secure kafka" 120 secure_kafka_started
  cat >"$SK_DIR/env" <<ENV
CRS_SECURE_KAFKA_SASL_BOOTSTRAP=127.0.0.1:$sasl
CRS_SECURE_KAFKA_MTLS_BOOTSTRAP=127.0.0.1:$mtls
CRS_SECURE_KAFKA_CA=$SK_PKI/ca.crt
CRS_SECURE_KAFKA_ADMIN_USER=admin
CRS_SECURE_KAFKA_ADMIN_PASSWORD_FILE=$SK_DIR/admin.password
CRS_SECURE_KAFKA_SASL_USER=crs-sasl
CRS_SECURE_KAFKA_SASL_PASSWORD_FILE=$SK_DIR/crs-sasl.password
CRS_SECURE_KAFKA_MTLS_PRINCIPAL=User:CN=crs-mtls
CRS_SECURE_KAFKA_MTLS_CERT=$SK_PKI/crs-mtls.crt
CRS_SECURE_KAFKA_MTLS_KEY=$SK_PKI/crs-mtls.key
CRS_SECURE_KAFKA_MTLS_KEY_PASSWORD_FILE=$SK_PKI/crs-mtls.key.password
ENV
  echo "secure Kafka    SASL_SSL 127.0.0.1:$sasl, mTLS 127.0.0.1:$mtls   (log: $SK_DIR/kafka-server.log, env: $SK_DIR/env)"
}
