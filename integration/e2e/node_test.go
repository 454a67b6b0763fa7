//go:build e2e

package e2e

import (
	"testing"

	"github.com/buildq/buildq/integration/internal/realnode"
)

// startRealNode starts the integration suite's real node
// (integration/internal/realnode, under the same machine-wide lock) with
// the stack's registry and MinIO containers forwarded to its Pods. The
// stack runs its own nats-server container, so the node builds no NATS
// image.
func startRealNode(t *testing.T) *realnode.Node {
	t.Helper()
	return realnode.Start(t, realnode.Env{
		PackagesScript: "../tools/node-packages.sh",
		Tools:          shared.tools, Kube: shared.kube, Kubeconfig: shared.kubeconfig,
		RegistryHost: shared.registryHost, RegistryUser: shared.registryUser, RegistryPass: shared.registryPass,
		MinioEndpoint: shared.minioEndpoint,
	})
}
