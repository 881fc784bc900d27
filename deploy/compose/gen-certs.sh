#!/bin/sh
# One-shot PKI for the compose stack (the `certs` service; also runnable on a host with
# openssl). Writes into $PKI_DIR (default /pki, the shared `pki` volume):
#
#   ca.crt ca.key                   cluster CA (signs serving and client certs)
#   apiserver.crt apiserver.key     kube-apiserver serving cert (SANs: kube-apiserver, localhost, ...)
#   sa.key sa.pub                   service-account token signing key pair
#   admin.crt admin.key             client cert O=system:masters, for `crds` and `seed`
#   crs-consumer.crt .key           client cert CN=crs-consumer, no groups: what the consumer
#                                   runs as; RBAC binds it to deploy/clusterrole.yaml only
#   admin.kubeconfig crs-consumer.kubeconfig   rendered from kubeconfig.tmpl
#
# Idempotent: keys and certs are made once per volume; kubeconfigs are re-rendered each run.
# Client files belong to CLIENT_UID (10001, the image's user) and are mode 0600.
# Dev-only material: never use it outside this compose project.
set -eu

PKI_DIR=${PKI_DIR:-/pki}
SERVER=${APISERVER_URL:-https://kube-apiserver:6443}
CLIENT_UID=${CLIENT_UID:-10001}
HERE=$(cd "$(dirname "$0")" && pwd)
TEMPLATE=${KUBECONFIG_TEMPLATE:-$HERE/kubeconfig.tmpl}
DAYS=3650

if ! command -v openssl >/dev/null 2>&1; then
  if command -v apk >/dev/null 2>&1; then
    apk add --no-cache --quiet openssl
  else
    echo "gen-certs: openssl is required" >&2
    exit 1
  fi
fi

mkdir -p "$PKI_DIR"
chmod 0755 "$PKI_DIR" # clients (uid 10001) traverse it; secrets stay 0600
cd "$PKI_DIR"
umask 077

sign() { # sign NAME SUBJECT EXTFILE: NAME.key + NAME.crt signed by the CA
  openssl req -new -newkey rsa:2048 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$DAYS" \
    -sha256 -extfile "$3" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr"
}

if [ ! -s ca.crt ] || [ ! -s crs-consumer.crt ]; then
  echo "gen-certs: creating CA, serving, client and service-account keys in $PKI_DIR"
  openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -sha256 -subj "/CN=crs-compose-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout ca.key -out ca.crt 2>/dev/null

  cat >serving.ext <<EXT
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:kube-apiserver,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.0.0.1
EXT
  sign apiserver "/CN=kube-apiserver" serving.ext

  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >client.ext
  sign admin "/O=system:masters/CN=compose-admin" client.ext
  sign crs-consumer "/CN=crs-consumer" client.ext

  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  rm -f serving.ext client.ext
fi

for user in admin crs-consumer; do
  sed -e "s#@SERVER@#$SERVER#g" -e "s#@PKI_DIR@#$PKI_DIR#g" -e "s#@USER@#$user#g" \
    "$TEMPLATE" >"$user.kubeconfig"
done

# The apiserver (root) reads its own files; the clients run as CLIENT_UID.
chmod 0644 ca.crt apiserver.crt sa.pub
chmod 0600 ca.key apiserver.key sa.key
for f in admin.crt admin.key admin.kubeconfig crs-consumer.crt crs-consumer.key crs-consumer.kubeconfig; do
  chmod 0600 "$f"
  if [ "$(id -u)" = 0 ]; then chown "$CLIENT_UID:$CLIENT_UID" "$f"; fi
done
echo "gen-certs: ready ($PKI_DIR)"
