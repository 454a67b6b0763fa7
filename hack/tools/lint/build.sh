#!/usr/bin/env bash
# Builds golangci-lint from the module pinned beside this script (go.mod's
# tool directive and go.sum) into a cache outside the clone, the first time
# only, and prints the binary's path on stdout. The binary lives in a
# directory keyed by this module's go.mod and go.sum, the same cache as the
# integration suite's components (integration/tools/build.sh): bumping the
# version builds a new one, a warm cache costs nothing.
#
# Cold, on 2 cores: about 2 minutes. Override the cache root with
# BUILDQ_TOOLS_CACHE.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${BUILDQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/tools}"
hash="$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"
dir="$root/lint-$hash"
bin="$dir/golangci-lint"
if [ ! -x "$bin" ]; then
  mkdir -p "$dir"
  echo "building golangci-lint into $dir — first time only, this takes minutes" >&2
  start=$(date +%s)
  # Build to a temporary name and rename: an interrupted build never leaves
  # a half-written binary that later runs would trust.
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -o "$dir/.golangci-lint.tmp" github.com/golangci/golangci-lint/v2/cmd/golangci-lint)
  mv "$dir/.golangci-lint.tmp" "$bin"
  echo "built golangci-lint in $(( $(date +%s) - start ))s" >&2
fi
echo "$bin"
