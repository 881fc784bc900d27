#!/usr/bin/env bash
# Repeat the Dockerfile's builder + runtime install steps without Docker, to catch a broken
# image build (a file the wheel needs but the Dockerfile does not COPY, a runtime import of a
# dev-only package, a missing console script) on a machine with no Docker daemon.
#
#   deploy/check-dockerfile-steps.sh                 # ends with `crs-consumer --help`
#   deploy/check-dockerfile-steps.sh --import-only   # ends with `python -c "import service"`
#
# Steps, as in the Dockerfile's builder stage:
#   1. copy exactly the sources the builder stage COPYs (read from the Dockerfile's COPY
#      lines, filtered by .dockerignore's **/__pycache__ etc.) into a fresh temp dir;
#   2. install requirements-build.lock (hashes required), `pip wheel --no-deps
#      --no-build-isolation` that tree;
#   3. install requirements.lock (hashes required, no resolving) and the wheel into a fresh
#      pip-less venv, and `pip check` it;
#   4. run the console script from outside the source tree, with the runtime env vars.
# Uses pip's normal cache; talks to no index but the configured one (PyPI).
# Env: PYTHON (default: python3.11, else python3), KEEP_TMP=1 to keep the temp dir.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DOCKERFILE=$REPO/Dockerfile
MODE=cli
case ${1:-} in
  "") ;;
  --import-only) MODE=import ;;
  -h | --help)
    sed -n '2,17p' "$0"
    exit 0
    ;;
  *)
    echo "usage: $0 [--import-only]" >&2
    exit 2
    ;;
esac

die() {
  echo "check-dockerfile-steps: $*" >&2
  exit 1
}
step() { echo "check-dockerfile-steps: $*" >&2; }

if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python3.11 || command -v python3 || true)
fi
[ -n "$PYTHON" ] || die "no python3 found (set PYTHON)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  die "$PYTHON is older than 3.11, the image's Python"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/crs-dockerfile-steps.XXXXXX")
if [ "${KEEP_TMP:-0}" = 1 ]; then
  step "keeping $TMP"
else
  trap 'rm -rf "$TMP"' EXIT
fi
SRC=$TMP/src # stands for the builder's WORKDIR /src
mkdir -p "$SRC"

# -- 1. COPY: every `COPY <src>... <dest>` of the builder stage (the ones without --from)
builder_copies=$(awk '
  /^FROM /            { stage = ($0 ~ / AS builder$/) ? "builder" : "other" }
  stage == "builder" && /^COPY / && !/--from=/ { $1 = ""; print }
' "$DOCKERFILE")
[ -n "$builder_copies" ] || die "no COPY lines found in the builder stage of $DOCKERFILE"
while read -r -a words; do
  dest=${words[${#words[@]} - 1]}
  unset 'words[${#words[@]}-1]'
  matched=0
  for pattern in "${words[@]}"; do
    # Globs expand against the build context, as COPY does; no match is allowed for a glob
    # (Docker accepts it while another source matches) but not for a plain path.
    shopt -s nullglob
    # shellcheck disable=SC2206 # the glob expansion is the point
    paths=("$REPO"/$pattern)
    shopt -u nullglob
    if [ ${#paths[@]} -eq 0 ]; then
      case $pattern in
        *[*?[]*) continue ;;
        *) die "Dockerfile COPYs '$pattern', which does not exist" ;;
      esac
    fi
    for p in "${paths[@]}"; do
      matched=1
      if [ -d "$p" ]; then # COPY dir/ dest/ copies the directory's contents into dest
        mkdir -p "$SRC/$dest"
        cp -a "$p/." "$SRC/$dest/"
      else
        case $dest in
          */) mkdir -p "$SRC/$dest" && cp -a "$p" "$SRC/$dest" ;;
          *) mkdir -p "$(dirname "$SRC/$dest")" && cp -a "$p" "$SRC/$dest" ;;
        esac
      fi
    done
  done
  [ "$matched" = 1 ] || die "COPY line '${words[*]} $dest' matched nothing"
done <<<"$builder_copies"
# .dockerignore drops these from the context
find "$SRC" \( -name __pycache__ -o -name .mypy_cache -o -name .pytest_cache -o -name .ruff_cache \) \
  -prune -exec rm -rf {} +
find "$SRC" \( -name '*.pyc' -o -name '*.pyo' \) -delete
step "context: $(cd "$SRC" && find . -type f | wc -l) files"

# -- 2. the locked build backend, then pip wheel --no-deps --no-build-isolation (the builder
#       image's own pip and python; here a throwaway venv's)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
"$PYTHON" -m venv "$TMP/build-python"
BUILD_PY=$TMP/build-python/bin/python
"$BUILD_PY" -m pip install -q --require-hashes --no-deps -r "$SRC/requirements-build.lock"
"$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$TMP/wheels" "$SRC"
wheels=("$TMP"/wheels/*.whl)
[ ${#wheels[@]} -eq 1 ] || die "expected one wheel, got: ${wheels[*]}"
step "built $(basename "${wheels[0]}")"

# -- 3. pip-less runtime venv: the locked runtime deps (hashes required), then the wheel;
#       nothing resolved, so `pip check` fails when the lock misses a dependency
"$PYTHON" -m venv --without-pip "$TMP/opt-venv"
VENV_PY=$TMP/opt-venv/bin/python
"$BUILD_PY" -m pip --python "$VENV_PY" install -q --require-hashes --no-deps -r "$SRC/requirements.lock"
"$BUILD_PY" -m pip --python "$VENV_PY" install -q --no-deps "${wheels[0]}"
"$BUILD_PY" -m pip --python "$VENV_PY" check >&2 || die "the lock does not hold every runtime dependency"
# crs_demo: the demo/seeding tool (tools/demo) belongs to the `demo` target only.
for devpkg in pytest pytest_asyncio hypothesis ruff mypy jsonschema crs_demo; do
  if "$VENV_PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$devpkg') is None)"; then
    die "dev-only package '$devpkg' ended up in the runtime venv"
  fi
done

# -- 4. run it, outside the source tree, with the image's runtime environment
cd "$TMP"
export PATH=$TMP/opt-venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
  CRS_HTTP_HOST=0.0.0.0 CRS_HTTP_PORT=8080
unset PYTHONPATH VIRTUAL_ENV
if [ "$MODE" = import ]; then
  step "running: python -c 'import service'"
  "$VENV_PY" -c 'import service, sys; assert "/opt-venv/" in service.__file__, service.__file__; sys.stdout.write(service.__file__ + "\n")'
else
  [ -x "$TMP/opt-venv/bin/crs-consumer" ] || die "the wheel installs no crs-consumer console script"
  step "running: crs-consumer --help"
  crs-consumer --help
fi
step "OK"
