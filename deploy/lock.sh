#!/usr/bin/env bash
# Regenerate the image's lock files, every version pinned and every file hashed:
#   requirements.lock        runtime dependencies (pyproject.toml's [project] dependencies,
#                            no extras): what /opt/venv in the image holds
#   requirements-build.lock  the build backend (build-system.requires) that turns the
#                            sources into the wheel in the builder stage
#
#   deploy/lock.sh            # after changing dependencies in pyproject.toml
#   deploy/lock.sh --upgrade  # move every pin to the newest version the ranges allow
#
# The tool is pip-tools' pip-compile from PyPI, installed once into its own venv in the
# dev stack's cache (~/.cache/crs-devstack/pip-tools-<version>), never into .venv. Resolves
# for the interpreter given as PYTHON (default python3.11, else python3): use the image's
# Python minor version (3.11), since markers and wheels depend on it.
# tests/unit/test_lock.py fails when the lock and pyproject.toml drift apart.
set -euo pipefail

PIP_TOOLS_VERSION=7.6.2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_DIR=${CRS_DEVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/crs-devstack}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
  { echo "lock: $PYTHON is not Python 3.11, the image's Python" >&2; exit 1; }

TOOL=$CACHE_DIR/pip-tools-$PIP_TOOLS_VERSION
if [ ! -x "$TOOL/bin/pip-compile" ]; then
  echo "lock: installing pip-tools $PIP_TOOLS_VERSION into $TOOL (first run only)" >&2
  rm -rf "$TOOL"
  "$PYTHON" -m venv "$TOOL"
  "$TOOL/bin/python" -m pip install -q --disable-pip-version-check "pip-tools==$PIP_TOOLS_VERSION"
fi
cd "$REPO"
# CUSTOM_COMPILE_COMMAND: the headers name this script, not the raw pip-compile call.
compile() {
  CUSTOM_COMPILE_COMMAND="deploy/lock.sh" "$TOOL/bin/pip-compile" --quiet --generate-hashes \
    --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links "$@" pyproject.toml
}
compile --output-file requirements.lock "${@}"
compile --output-file requirements-build.lock --only-build-deps --build-deps-for wheel "${@}"
echo "lock: wrote requirements.lock and requirements-build.lock" >&2
