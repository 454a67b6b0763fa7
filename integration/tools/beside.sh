#!/usr/bin/env bash
# beside.sh COMMAND...: runs COMMAND (make test's stages) while the
# integration suite's node packages are installed and its tools built
# beside it, so that on a fresh machine the tools' compiling (about 27
# minutes on 2 cores alone) takes the CPU the unit stages leave idle: the
# worker's unit tests wait on timers and use about a third of the
# machine for most of their 8 minutes.
#
# The tools build runs at idle CPU priority (SCHED_IDLE, and nice 19): it
# gets a core only when no test wants one, so the tests, the simulation's
# timing rules among them, run as they would alone. build.sh holds a lock
# while it builds; the integration stage's own build.sh waits for this
# one and then builds whatever is left, at normal priority.
#
# With nothing missing (a warm machine, CI here) nothing runs beside.
# Whatever COMMAND's outcome, the work beside it is stopped when it ends;
# a binary it did not finish is not kept (build.sh renames only finished
# ones). Exits with COMMAND's status.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${BUILDQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/tools}"

missing="$(bash "$here/build.sh" --missing | tr '\n' ' ')"
if [ -n "$missing" ]; then
  mkdir -p "$root"
  log="$root/beside.log"
  idle=(nice -n 19)
  if command -v chrt >/dev/null 2>&1; then idle=(chrt --idle 0 nice -n 19); fi
  echo "building the integration suite's tools beside the tests, at idle CPU priority: ${missing% } (log: $log)" >&2
  # Its own session, so that the whole tree (go build and its compilers)
  # is stopped at the end; the node packages first, at normal priority
  # (apt-get is short and mostly waits on the network).
  setsid bash -c 'here=$1; shift
    bash "$here/node-packages.sh" || echo "node-packages.sh failed; make test-integration runs it again" >&2
    exec "$@" bash "$here/build.sh" >/dev/null
  ' beside "$here" "${idle[@]}" >"$log" 2>&1 </dev/null &
  beside=$!
  trap 'kill -TERM -- "-$beside" 2>/dev/null || true' EXIT
fi
"$@"
