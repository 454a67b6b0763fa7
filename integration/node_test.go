//go:build integration

package integration

import (
	"testing"

	"github.com/buildq/buildq/integration/internal/realnode"
)

// The real node (integration/internal/realnode, which the Docker-host
// suite integration/e2e runs too): containerd, runc, a CNI bridge of its
// own, kubelet and kube-scheduler, registered with the suite's
// kube-apiserver, tainted so that only the node tests' Jobs run there.
// What follows names it as the node tests do.
const (
	nodeName    = realnode.Name
	nodeGateway = realnode.Gateway
	nodeTaint   = realnode.Taint
)

// nodeJobTemplate is the worker's --job-template for builds on the node.
const nodeJobTemplate = realnode.JobTemplate

type realNode struct {
	*realnode.Node

	// registryHost and minioEndpoint are the suite's registry and MinIO as
	// the Pods (and the node tests' workers) address them.
	registryHost  string
	minioEndpoint string
	images        nodeImages
}

// nodeImages are the real node's images, referenced by digest at the
// registry address the Pods use.
type nodeImages struct {
	kaniko string // the kaniko executor in upstream's image layout
	base   string // FROM image of the node tests: Debian's busybox-static
	buildq string // buildq itself, static, for the fetch-context init container
	nats   string // nats-server from its Go module, static: deploy/nats's image
}

// startRealNode brings the node up against the suite's shared components
// and registers its teardown with t: everything it started stops and
// everything it made is removed, also after a failed test.
func startRealNode(t *testing.T) *realNode {
	t.Helper()
	n := realnode.Start(t, realnode.Env{
		PackagesScript: "tools/node-packages.sh",
		Tools:          shared.tools,
		Kube:           shared.kube,
		Kubeconfig:     shared.kubeconfig,
		RegistryHost:   shared.registryHost,
		RegistryUser:   shared.registryUser,
		RegistryPass:   shared.registryPass,
		MinioEndpoint:  shared.minioEndpoint,
		NATSImage:      true, // deploy/nats's image, for the worker-Pod tests
	})
	im := n.Images
	return &realNode{Node: n, registryHost: n.RegistryHost, minioEndpoint: n.MinioEndpoint,
		images: nodeImages{kaniko: im.Kaniko, base: im.Base, buildq: im.Buildq, nats: im.NATS}}
}

// forward listens on the bridge's gateway and forwards each connection to
// target on 127.0.0.1; it returns the gateway address.
func (n *realNode) forward(target string) string { return n.Forward(target) }

// dumpNamespace logs the Jobs, Pods and Events of ns (when a node test
// fails, this is what says why).
func dumpNamespace(t *testing.T, ns string) { realnode.DumpNamespace(t, shared.kube, ns) }
