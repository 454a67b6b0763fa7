#!/usr/bin/env bash
# Builds the real components the integration suite runs — kube-apiserver,
# kube-controller-manager, etcd, MinIO and the distribution registry — from
# the Go module proxy, into a cache outside the clone keyed by this
# module's go.mod and go.sum. Only missing binaries are built, so a warm
# cache costs nothing. Prints the cache directory on stdout.
#
# Cold, on 2 cores: about 25 minutes. Override the cache root with
# BUILDQ_TOOLS_CACHE.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
hash="$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"
root="${BUILDQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/buildq/tools}"
dir="$root/$hash"
mkdir -p "$dir"

# name|package
tools=(
  "etcd|go.etcd.io/etcd/server/v3"
  "kube-apiserver|k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager|k8s.io/kubernetes/cmd/kube-controller-manager"
  "registry|github.com/distribution/distribution/v3/cmd/registry"
  "minio|github.com/minio/minio"
)
cd "$here"
for t in "${tools[@]}"; do
  name="${t%%|*}"; pkg="${t#*|}"
  if [ -x "$dir/$name" ]; then
    continue
  fi
  echo "building $name ($pkg) into $dir — first time only, this takes minutes" >&2
  start=$(date +%s)
  # Build to a temporary name and rename: an interrupted build never
  # leaves a half-written binary that later runs would trust.
  CGO_ENABLED=0 go build -trimpath -o "$dir/.$name.tmp" "$pkg"
  mv "$dir/.$name.tmp" "$dir/$name"
  echo "built $name in $(( $(date +%s) - start ))s" >&2
done
echo "$dir"
