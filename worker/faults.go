package worker

// faultHooks are the fault-injection points of the package's randomized
// fault simulation (sim_test.go). They are nil in every real worker: only
// tests in this package can set Worker.faults.
type faultHooks struct {
	// loseAck, when it returns true, drops the ack (or term) of a request
	// whose result was stored: the server redelivers it as if the ack had
	// been lost on the wire.
	loseAck func(requestID string) bool
	// beforeRenew runs before each lease renewal of a build claim; it may
	// block, as a worker paused longer than its lease would.
	beforeRenew func(key string)
	// beforeFinalize runs before the owner stores a build's final record;
	// it may block (a pause between the outcome and the write).
	beforeFinalize func(key string)
	// beforeWalk runs each time a handler reads its key's build record to
	// decide what to do (claim, join, take over, answer from the index);
	// it may block (a handler stalled while its request is handled
	// elsewhere).
	beforeWalk func(key string)
	// beforeRecordRead runs before intake's shared read of a key's
	// record (sharedRecord); it may block (a slow read).
	beforeRecordRead func(key string)
}
