package worker

import (
	"errors"

	"github.com/nats-io/nats.go/jetstream"

	"regexp"

	"github.com/buildq/buildq/worker/internal/ledger"
)

// RequestIndexKey is the ledger key of a tenant's request id (see
// internal/ledger).
func RequestIndexKey(tenant, requestID string) string { return ledger.Key(tenant, requestID) }

var buildKeyRe = regexp.MustCompile(`^[a-f0-9]{64}$`)

// IsBuildKey reports whether s looks like a build key (64 hex digits).
func IsBuildKey(s string) bool { return buildKeyRe.MatchString(s) }

// isWrongRevision reports whether err is a KV compare-and-swap conflict.
func isWrongRevision(err error) bool {
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists)
}
