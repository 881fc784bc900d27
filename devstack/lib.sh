# shellcheck shell=bash
# Shared settings and helpers for devstack/up, down and status.
#
# Everything binds to 127.0.0.1. Built artifacts (Kafka jars, etcd and kube-apiserver
# binaries) live in a per-user cache outside the clone, keyed by version, so a fresh
# clone (CI) reuses them; runtime state (data, certs, logs, pids) lives in devstack/run/.

set -euo pipefail

DEVSTACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$DEVSTACK_DIR/.." && pwd)
RUN_DIR=${CRS_DEVSTACK_RUN_DIR:-$DEVSTACK_DIR/run}
CACHE_DIR=${CRS_DEVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/crs-devstack}

KAFKA_VERSION=4.1.1
ETCD_VERSION=v3.6.8
K8S_VERSION=v1.36.3

# Fixed ports: KRaft's --standalone format records the controller address in the data
# directory, so the ports of one run directory must not move between starts.
KAFKA_PORT=${CRS_DEVSTACK_KAFKA_PORT:-19092}
KAFKA_CONTROLLER_PORT=${CRS_DEVSTACK_KAFKA_CONTROLLER_PORT:-19093}
ETCD_PORT=${CRS_DEVSTACK_ETCD_PORT:-12379}
ETCD_PEER_PORT=${CRS_DEVSTACK_ETCD_PEER_PORT:-12380}
APISERVER_PORT=${CRS_DEVSTACK_APISERVER_PORT:-16443}
# The optional secured broker (devstack/up --secure-kafka); defaults clear of the plain
# stack's and of the parallel stacks' (19092+N*100) ports.
SECURE_KAFKA_SASL_PORT=${CRS_DEVSTACK_SECURE_KAFKA_SASL_PORT:-19094}
SECURE_KAFKA_MTLS_PORT=${CRS_DEVSTACK_SECURE_KAFKA_MTLS_PORT:-19095}
SECURE_KAFKA_CONTROLLER_PORT=${CRS_DEVSTACK_SECURE_KAFKA_CONTROLLER_PORT:-19096}

KAFKA_HOME=$CACHE_DIR/kafka-$KAFKA_VERSION
ETCD_BIN=$CACHE_DIR/etcd-$ETCD_VERSION/etcd
APISERVER_BIN=$CACHE_DIR/kube-apiserver-$K8S_VERSION/kube-apiserver
CERT_DIR=$RUN_DIR/pki
KUBECONFIG_PATH=$RUN_DIR/kubeconfig

die() {
  echo "devstack: $*" >&2
  exit 1
}

log() {
  echo "devstack: $*" >&2
}

# require CMD HOW: a one-line error naming the missing prerequisite and how to get it.
require() {
  command -v "$1" >/dev/null 2>&1 || die "missing prerequisite '$1': $2"
}

check_prerequisites() {
  require java "install a Java 17+ runtime (apt-get install -y openjdk-17-jre-headless)"
  require mvn "install Maven (apt-get install -y maven)"
  require go "install Go 1.26+ (https://go.dev/doc/install) and put it on PATH"
  require openssl "apt-get install -y openssl"
  require curl "apt-get install -y curl"
  local jv
  jv=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  [ -n "$jv" ] && [ "$jv" -ge 17 ] || die "Java 17 or newer is required (found '${jv:-unknown}'): apt-get install -y openjdk-17-jre-headless"
}

# pid_alive NAME: true when run/NAME.pid names a live process.
pid_alive() {
  local f=$RUN_DIR/$1.pid
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# wait_for DESCRIPTION TIMEOUT_S CMD...: poll until CMD succeeds.
wait_for() {
  local what=$1 timeout=$2
  shift 2
  local start=$SECONDS
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS - start > timeout)); then
      die "$what did not come up within ${timeout}s (see $RUN_DIR/*.log)"
    fi
    sleep 0.2
  done
}

kcurl() {
  curl -sS --fail-with-body --max-time 10 \
    --cacert "$CERT_DIR/ca.crt" --cert "$CERT_DIR/admin.crt" --key "$CERT_DIR/admin.key" \
    "$@"
}
