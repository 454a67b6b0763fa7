#!/usr/bin/env bash
# Stops the dockerd that hack/docker/start.sh started (by its pid file; its
# containerd child goes with it), after removing the containers it ran and
# any network a client made, then removes the containers' empty cgroups
# (buildq-e2e) and any mount left under its directory. Safe to run when
# nothing is running.
set -uo pipefail
dir=${BUILDQ_DOCKER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/docker}
pidfile=$dir/dockerd.pid
sock=$dir/docker.sock

cleanup() {
  # The containers' cgroup (--cgroup-parent buildq-e2e), once empty; cgroup
  # v1 puts it under the process's own cgroup in some hierarchies.
  for d in /sys/fs/cgroup/*/buildq-e2e /sys/fs/cgroup/*/*/buildq-e2e /sys/fs/cgroup/*/*/*/buildq-e2e; do
    [ -d "$d" ] || continue
    find "$d" -mindepth 1 -depth -type d -exec rmdir {} \; 2>/dev/null
    rmdir "$d" 2>/dev/null || true
  done
  # Mounts left under the data root (overlay layers, shm) by a killed daemon.
  grep -F " $dir/" /proc/mounts | awk '{print $2}' | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -f "$pidfile" "$sock"
}

pid=$(cat "$pidfile" 2>/dev/null || true)
if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
  cleanup
  exit 0
fi
if [ -S "$sock" ]; then
  export DOCKER_HOST=unix://$sock
  ids=$(timeout 30 docker ps -aq 2>/dev/null || true)
  [ -z "$ids" ] || timeout 60 docker rm -f $ids >/dev/null 2>&1 || true
  # Networks a client made (a bridge would stay on the host as br-…):
  # only host and none belong here.
  timeout 30 docker network prune -f >/dev/null 2>&1 || true
fi
kill -TERM "$pid" 2>/dev/null || true
for _ in $(seq 1 60); do
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
if kill -0 "$pid" 2>/dev/null; then
  echo "dockerd $pid did not stop in 30 s; killing it" >&2
  kill -KILL "$pid" 2>/dev/null || true
fi
# dockerd's containerd child, should it have outlived its parent.
cpid=$(cat "$dir/run/containerd/containerd.pid" 2>/dev/null || true)
if [ -n "$cpid" ] && kill -0 "$cpid" 2>/dev/null && grep -q "$dir/run" "/proc/$cpid/cmdline" 2>/dev/null; then
  kill -TERM "$cpid" 2>/dev/null || true
fi
cleanup
echo "dockerd stopped" >&2
