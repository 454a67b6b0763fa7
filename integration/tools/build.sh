#!/usr/bin/env bash
# Builds the real components the integration suite runs from the Go module
# proxy, into a cache outside the clone. Five modules pin them:
#   .        kube-apiserver, kube-controller-manager, etcd, MinIO, registry
#   node/    kubelet and kube-scheduler (the same Kubernetes version)
#   kaniko/  the kaniko executor (github.com/chainguard-dev/kaniko)
#   cosign/  cosign, the third-party verifier of buildq's attestations
#   syft/    syft, the SBOM scanner workers run (--sbom-scanner)
# Each module's binaries live in a directory keyed by that module's go.mod
# and go.sum, so changing one module rebuilds only its binaries, and only
# missing binaries are built: a warm cache costs nothing. Prints on stdout
# one directory that holds (links to) all of them.
#
# One build at a time: the build holds a lock on the cache root, and a
# second build.sh (say make bench-e2e's, while make test builds the tools
# beside its unit stages: beside.sh) waits for it, saying what it builds,
# then builds what is left.
#
# build.sh --missing prints the names of the binaries not built yet, one
# per line, and builds nothing.
#
# Cold, on 2 cores and alone: about 27 minutes of compiling. Override the
# cache root with BUILDQ_TOOLS_CACHE.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${BUILDQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/tools}"

modhash() { cat "$here/$1/go.mod" "$here/$1/go.sum" | sha256sum | cut -c1-16; }

# name|module|package|ldflags
tools=(
  "etcd|.|go.etcd.io/etcd/server/v3"
  "kube-apiserver|.|k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager|.|k8s.io/kubernetes/cmd/kube-controller-manager"
  "registry|.|github.com/distribution/distribution/v3/cmd/registry"
  "minio|.|github.com/minio/minio"
  "kubelet|node|k8s.io/kubernetes/cmd/kubelet"
  "kube-scheduler|node|k8s.io/kubernetes/cmd/kube-scheduler"
  "kaniko-executor|kaniko|github.com/chainguard-dev/kaniko/cmd/executor"
  "cosign|cosign|github.com/sigstore/cosign/v3/cmd/cosign"
  "syft|syft|github.com/anchore/syft/cmd/syft|-X main.version=$(awk '$1 == "github.com/anchore/syft" {print $2}' "$here/syft/go.mod")"
)

if [ "${1:-}" = --missing ]; then
  for t in "${tools[@]}"; do
    IFS='|' read -r name mod _ <<<"$t"
    [ -x "$root/$(modhash "$mod")/$name" ] || echo "$name"
  done
  exit 0
fi

mkdir -p "$root"
exec 9>"$root/.lock"
# Without flock (util-linux) builds are not serialized; they stay correct
# (each binary is renamed into place only when whole), only slower.
if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
  log="$root/beside.log"
  echo "another tools build is running (make test starts one beside the unit stages; its log: $log); waiting for it" >&2
  until flock -w 60 9; do
    last="$(grep -E '^(building|built) ' "$log" 2>/dev/null | tail -n 1 || true)"
    echo "still waiting for the other tools build${last:+; its last step: $last}" >&2
  done
fi

set_hash="$(for m in . node kaniko cosign syft; do modhash "$m"; done | sha256sum | cut -c1-16)"
out="$root/set-$set_hash"
mkdir -p "$out"
for t in "${tools[@]}"; do
  IFS='|' read -r name mod pkg ldflags <<<"$t"
  dir="$root/$(modhash "$mod")"
  mkdir -p "$dir"
  if [ ! -x "$dir/$name" ]; then
    echo "building $name ($pkg) into $dir — first time only, this takes minutes" >&2
    start=$(date +%s)
    # Build to a temporary name and rename: an interrupted build never
    # leaves a half-written binary that later runs would trust.
    (cd "$here/$mod" && CGO_ENABLED=0 go build -trimpath -ldflags "${ldflags:-}" -o "$dir/.$name.tmp" "$pkg")
    mv "$dir/.$name.tmp" "$dir/$name"
    echo "built $name in $(( $(date +%s) - start ))s" >&2
  fi
  ln -sfn "$dir/$name" "$out/$name"
done
echo "$out"
