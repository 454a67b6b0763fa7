package worker

import (
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/tenantapi"
)

// RequestIndexKey is the ledger key of a tenant's request id (see
// internal/ledger).
func RequestIndexKey(tenant, requestID string) string { return ledger.Key(tenant, requestID) }

// ServiceReplyPrefix is the prefix nats-server gives the reply subject
// of a request that reached the workers' account through a service import
// (see internal/tenantapi).
const ServiceReplyPrefix = tenantapi.ServiceReplyPrefix
