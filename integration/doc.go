// Package integration holds buildq's tests against real components (build
// tag "integration"): NATS, MinIO, the distribution registry, and
// kube-apiserver + etcd + kube-controller-manager built from Go modules.
package integration
