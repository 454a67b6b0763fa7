#!/usr/bin/env bash
# `make lint`'s golangci-lint step: builds the pinned golangci-lint the first
# time (build.sh), then lints the default build and the build-tagged code
# (the integration suite, the end-to-end benchmarks, the Docker-host suite,
# the scale benchmark and the mutation tests, as `make vet` does) with the
# repository's .golangci.yml. A finding in a file both runs see is printed
# once. Arguments go to both runs (e.g. --fix, or --new-from-rev=HEAD~1).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(bash "$here/build.sh")" || exit
cd "$here/../../.."
tags=integration,benche2e,e2e,benchscale,mutants
{
  "$bin" run "$@" ./...
  a=$?
  "$bin" run "$@" --build-tags "$tags" ./worker/... ./integration/...
  b=$?
  exit $((a > b ? a : b))
} 2>&1 | awk '!seen[$0]++'
exit "${PIPESTATUS[0]}"
