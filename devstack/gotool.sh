# shellcheck shell=bash
# Build a Go command-line tool once per machine from the pinned module in devstack/go/NAME
# (its go.mod names the tool with a `tool` directive; go.sum holds the checksums) into
# $CACHE_DIR/NAME-VERSION/NAME, like the dev stack's servers. Sourced after lib.sh.

# go_tool_version NAME MODULE: the version of MODULE that devstack/go/NAME/go.mod pins.
go_tool_version() {
  grep -m1 -o "$2 v[0-9][0-9.]*" "$DEVSTACK_DIR/go/$1/go.mod" | cut -d' ' -f2
}

# ensure_go_tool NAME PACKAGE VERSION [LDFLAGS]: prints the binary's path, building it first
# if it is not cached. A lock keeps parallel test sessions from building it twice at once.
ensure_go_tool() {
  local name=$1 pkg=$2 version=$3 ldflags=${4:-}
  local bin=$CACHE_DIR/$name-$version/$name
  if [ ! -x "$bin" ]; then
    require go "install Go 1.26+ (https://go.dev/doc/install) and put it on PATH"
    mkdir -p "$CACHE_DIR/logs" "$(dirname "$bin")"
    local logf=$CACHE_DIR/logs/$name.build.log t=$SECONDS
    exec 9>"$CACHE_DIR/$name.build.lock"
    flock 9
    if [ ! -x "$bin" ]; then
      log "building $name $version from Go modules (first run only; log: $logf)"
      if ! (cd "$DEVSTACK_DIR/go/$name" && CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w $ldflags" -o "$bin.tmp" "$pkg") >"$logf" 2>&1; then
        tail -20 "$logf" >&2
        die "building $name failed; full log: $logf"
      fi
      mv "$bin.tmp" "$bin"
      log "built $name in $((SECONDS - t))s"
    fi
    exec 9>&-
  fi
  echo "$bin"
}
