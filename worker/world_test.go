package worker

// One test world for every test that runs workers: a restartable embedded
// NATS (world_nats_test.go), the fault-injecting Kubernetes API server
// (world_api_test.go), one node emulation — kubelet, Job controller and
// TTL controller — on it (world_node_test.go), and the in-memory registry
// (world_registry_test.go). The harness (harness_test.go: setup, env) runs
// it with no faults and builds that end when a test says; the fault
// simulation (sim_*_test.go) with faults, builds that end by themselves at
// seeded times and a TTL controller; the scale benchmark
// (benchscale_test.go) runs its parts in separate processes; the backend
// conformance suite (backend_conformance_test.go) runs the kaniko backend
// on the harness's node and on the simulation's.

import (
	"testing"
)

// world is one test world.
type world struct {
	nats *natsServer // nil: none (worldConfig.noNATS)
	api  *apiServer
	node *fakeNode
	reg  *testRegistry // nil: none (worldConfig.registry false)
}

// worldConfig says what a world has.
type worldConfig struct {
	nats   natsConfig
	noNATS bool
	// registry: the world has a registry, where the node's builds push
	// (unless node.registry names another).
	registry bool
	node     nodeOptions
}

// newWorld starts a world; t's cleanup stops it.
func newWorld(t *testing.T, cfg worldConfig) *world {
	t.Helper()
	w := &world{api: newAPIServer()}
	if !cfg.noNATS {
		w.nats = startNATS(t, cfg.nats)
	}
	if cfg.registry {
		w.reg = newTestRegistry(t)
		if cfg.node.registry == nil {
			cfg.node.registry = w.reg.client
		}
	}
	w.node = newFakeNode(w.api, cfg.node)
	t.Cleanup(w.close)
	return w
}

// close stops the node and the API server (NATS and the registry stop
// with the test).
func (w *world) close() {
	w.node.close()
	w.api.close()
}
