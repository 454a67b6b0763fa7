package worker

// The test world's NATS is internal/testnats's restartable server: one
// embedded nats-server with JetStream and a file store, which can be
// stopped and started again on the same port and store. The harness, the
// fault simulation and the scale benchmark's NATS processes all run it.

import "github.com/buildq/buildq/internal/testnats"

type (
	natsServer = testnats.Server
	natsConfig = testnats.Config
)

var startNATS = testnats.Start
