#!/usr/bin/env bash
# beside.sh COMMAND...: runs COMMAND (make test's unit tests) while the
# integration stage's prerequisites are made beside it, then waits for
# them, so that on a fresh machine their compiling takes the CPU the unit
# tests leave idle: the worker's unit tests wait on timers, and alone they
# keep about a third of two cores busy for most of their 8 minutes.
#
# Not beside the simulation nor the mutants (make test runs them after):
# they judge timing rules in calm stretches, and with the tools building
# beside them two mutants the simulation alone kills (no-job-cleanup,
# ignore-priority) survived in one of two cold runs.
#
# The work beside, on a machine whose integration tools are not all built:
#   - the node's Debian packages (node-packages.sh), at normal priority:
#     apt-get is short and mostly waits on the network;
#   - the tools (build.sh: about 27 minutes of compiling on 2 cores alone);
#   - then what the integration suite compiles itself, into the build
#     cache: buildq for linux/amd64 and linux/arm64 as make image builds
#     it (TestImageBuildsAndPushesWithoutDocker), and nats-server static
#     (the real node's images).
# Both compile steps run at idle CPU priority (SCHED_IDLE, and nice 19):
# they get a core only when no test wants one (the unit tests passed with
# them beside in both cold runs; the simulation's timing rules did not
# always, hence the order above).
#
# When COMMAND succeeds, beside.sh waits for the work beside to end (it
# then has the machine to itself), saying what it is at every minute; a
# step of it that failed is only reported, since the integration stage
# runs node-packages.sh and build.sh again and stops on their errors.
# When COMMAND fails or is interrupted, the work beside is stopped; a tool
# it did not finish is not kept (build.sh renames only finished ones).
# With every tool built (a warm machine, CI here) nothing runs beside.
# Exits with COMMAND's status.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${BUILDQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/tools}"
idle=(nice -n 19)
if command -v chrt >/dev/null 2>&1; then idle=(chrt --idle 0 nice -n 19); fi

if [ "${1:-}" = --work ]; then
  # The work beside itself (beside.sh starts it so, in a session of its own).
  step() { echo "$(date +%T) $*"; }
  bash "$here/node-packages.sh" || step "node-packages.sh failed; the integration stage runs it again"
  step "building the tools"
  "${idle[@]}" bash "$here/build.sh" >/dev/null || { step "build.sh failed; the integration stage runs it again"; exit 1; }
  cd "$here/../.."
  for arch in amd64 arm64; do
    step "compiling buildq for linux/$arch into the build cache"
    "${idle[@]}" env CGO_ENABLED=0 GOOS=linux GOARCH="$arch" go build -trimpath -o /dev/null ./cmd/buildq || step "that compile failed; the integration suite compiles it again"
  done
  step "compiling nats-server, static, into the build cache"
  "${idle[@]}" env CGO_ENABLED=0 go build -trimpath -o /dev/null github.com/nats-io/nats-server/v2 || step "that compile failed; the integration suite compiles it again"
  step "done"
  exit 0
fi

# make -n runs this recipe line too (it names $(MAKE)): a dry run makes
# nothing beside. Make puts its one-letter flags, n among them, first in
# MAKEFLAGS.
flags="${MAKEFLAGS:-}"
flags="${flags%% *}"
case "$flags" in
  -*) ;;
  *n*) exec "$@" ;;
esac
missing="$(bash "$here/build.sh" --missing | tr '\n' ' ')"
if [ -z "$missing" ]; then
  exec "$@"
fi
mkdir -p "$root"
log="$root/beside.log"
echo "building the integration suite's tools beside the tests, at idle CPU priority: ${missing% } (log: $log)" >&2
# A session of its own, so that the whole tree (go build and its
# compilers) is stopped with it.
setsid bash "$0" --work >"$log" 2>&1 </dev/null &
beside=$!
# stop ends the work beside: its session's process group, once setsid has
# made it (right at the start it may not have yet).
stop() {
  for _ in $(seq 40); do
    kill -TERM -- "-$beside" 2>/dev/null && return
    kill -0 "$beside" 2>/dev/null || return
    sleep 0.05
  done
  kill -TERM "$beside" 2>/dev/null || true
}
trap stop EXIT
"$@"
echo "waiting for the work beside the tests to end (log: $log)" >&2
while kill -0 "$beside" 2>/dev/null; do
  for _ in $(seq 60); do
    kill -0 "$beside" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$beside" 2>/dev/null; then
    echo "  still at: $(grep -E '^[0-9:]+ |^(building|built) ' "$log" | tail -n 1)" >&2
  fi
done
wait "$beside" || echo "the work beside the tests did not all succeed (log: $log); the integration stage redoes what is missing" >&2
trap - EXIT
