// Package natsconf generates the NATS server setup that keeps buildq's
// tenants apart (DESIGN §9, invariant 8): one account per tenant.
//
// NATS checks the subject a user publishes to, never the reply subject. In
// one shared account a tenant could therefore do a JetStream publish on its
// own request subject with the reply subject $KV.buildq-builds.<key>, and the
// server itself would write the PubAck into the bucket. So the streams and
// buckets live in the BUILDQ account (with the worker and operator users),
// and every tenant is an account of its own that imports from BUILDQ exactly
// its own subjects: its request subject and its status, cancel, logs and
// stored-results services as services (the server gives each request a
// fresh _R_.… reply subject in BUILDQ and routes the answer, or the
// PubAck, back into the tenant's account, so a reply subject can name
// nothing of BUILDQ), and its results and progress events as streams. Build logs (the BUILDQ_LOGS
// stream, buildq.logs.>) stay in BUILDQ: a tenant reads a log only through
// its logs service.
//
// Two forms are generated:
//
//   - ServerConfig: a nats-server configuration file with the accounts
//     written out (config-file mode). Users authenticate with nkeys, given as
//     public keys or as $BUILDQ_<NAME>_NKEY references to the environment.
//     NewUserKeys makes the key pairs.
//   - JWTSetup: decentralized mode. An operator signs the system account,
//     BUILDQ and one account per tenant; BUILDQ exports wildcard, private
//     services and streams, and each tenant account imports its own
//     subjects with activation tokens BUILDQ signed for that account and
//     those subjects. Adding a tenant signs one new account, which
//     PushAccount hands to a running server; nothing else changes.
//
// Everything here is a pure generator except PushAccount, which talks to a
// server over the connection it is given.
package natsconf

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	v1 "github.com/buildq/buildq/api/v1"
)

// Accounts and users.
const (
	// BuildqAccount holds the streams and buckets, the workers and the
	// operators.
	BuildqAccount = "BUILDQ"
	// SystemAccount is the system account of decentralized mode.
	SystemAccount = "SYS"
	// WorkerUser and AdminUser are the names of the workers' and the
	// operators' users (in JWTs; config-file nkey users have no name).
	WorkerUser = "buildq-worker"
	AdminUser  = "buildq-admin"
	// SysUser is the system account's user in decentralized mode.
	SysUser = "sys"
)

// Key names of the users that are not tenants: the names of their key and
// credentials files (worker.seed, worker.creds, …) and of their variables
// (BUILDQ_WORKER_NKEY). A tenant's key name is the tenant's name, so these
// are not valid tenant names.
const (
	WorkerKey = "worker"
	AdminKey  = "admin"
	SysKey    = "sys"
)

var reserved = []string{WorkerKey, AdminKey, SysKey}

// TenantAccount is the name of tenant t's account: "tenant-<t>".
func TenantAccount(t string) string { return "tenant-" + t }

// NKeyVar is the environment variable that holds the public nkey of the user
// with the given key name: BUILDQ_WORKER_NKEY, BUILDQ_ACME_NKEY,
// BUILDQ_MY_TENANT_NKEY (upper case, '-' becomes '_'; as tenant names are
// DNS-1123 labels, two tenants never share a variable).
func NKeyVar(user string) string {
	return "BUILDQ_" + strings.ToUpper(strings.ReplaceAll(user, "-", "_")) + "_NKEY"
}

// CheckTenant says what makes t unusable as a tenant name, or nil.
func CheckTenant(t string) error {
	if p := v1.DNSLabelProblem(t); p != "" {
		return fmt.Errorf("tenant %s", p)
	}
	if slices.Contains(reserved, t) {
		return fmt.Errorf("tenant %q: the name is taken by the %s user's keys (%s.seed, %s); choose another", t, t, t, NKeyVar(t))
	}
	return nil
}

// CheckTenants refuses an empty list, an invalid name and a name given twice.
func CheckTenants(tenants []string) error {
	if len(tenants) == 0 {
		return errors.New("no tenants: give at least one")
	}
	var errs []error
	seen := map[string]bool{}
	for _, t := range tenants {
		if err := CheckTenant(t); err != nil {
			errs = append(errs, err)
			continue
		}
		if seen[t] {
			errs = append(errs, fmt.Errorf("tenant %q is given twice", t))
		}
		seen[t] = true
	}
	return errors.Join(errs...)
}

// Users are the key names of config-file mode's users: worker, admin and
// the tenants, in that order.
func Users(tenants []string) []string {
	return append([]string{WorkerKey, AdminKey}, tenants...)
}

// TenantServices are the subjects tenant t imports from BUILDQ as services
// (request/reply; the request subject is a JetStream publish whose PubAck
// is the reply), in the order they are written: its request subject, its
// status, cancel, logs and stored-results services, and the first
// version's cancel subject.
//
// No tenant gets anything of the build logs but its logs service: the
// logs themselves (buildq.logs.>, the BUILDQ_LOGS stream) are neither
// exported nor in any tenant's permissions, and tenants have no JetStream
// API. Nor does any tenant read BUILDQ_RESULTS: what it missed of its
// own results it asks its stored-results service for.
func TenantServices(t string) []string {
	return []string{
		v1.RequestSubject(t),
		v1.APIStatusSubject(t),
		v1.APICancelSubject(t),
		v1.APILogsSubject(t),
		v1.APIResultsSubject(t),
		v1.CancelPrefix + "." + t + ".*",
	}
}

// TenantStreams are the subjects tenant t imports from BUILDQ as streams.
func TenantStreams(t string) []string {
	return []string{v1.ResultsPrefix + "." + t + ".>", v1.EventsPrefix + "." + t + ".>"}
}

// TenantInboxes are the reply subjects a tenant's user may subscribe to:
// the default inbox and the tenant's own prefix of the single-account
// configuration, which its clients may still use. The default inbox is
// safe only in the tenant's own account: in BUILDQ's it would be every
// user's replies, the workers' reads of the buckets and of BUILDQ_LOGS
// included.
func TenantInboxes(t string) []string {
	return []string{"_INBOX.>", "_INBOX_" + t + ".>"}
}

// perm is one subject of a permission list with the comment that explains
// it in the configuration file.
type perm struct {
	subject string
	comment []string // lines written before the subject; none: same group as the previous
}

// The worker's permissions, carried over from the single-account
// configuration.
var workerPublish = []perm{
	{"$JS.API.>", []string{
		"Create/update the streams, the consumers and the buckets;",
		"fetch requests; read and write the buckets (direct get).",
	}},
	{"$JS.ACK.BUILDQ_REQUESTS.buildq-workers.>", []string{"Ack, nak, in-progress and term of the requests it holds."}},
	{"$JS.ACK.BUILDQ_QUEUE.>", []string{
		"... and of the admitted requests it runs (the tenants'",
		"dispatch consumers on BUILDQ_QUEUE).",
	}},
	{"$JS.FC.>", []string{"Flow-control replies of the bucket watchers."}},
	{"$KV.buildq-builds.>", []string{"Writes to the buckets."}},
	{"$KV.buildq-requests.>", nil},
	{"$KV.buildq-slots.>", nil},
	{"buildq.queue.>", []string{"Admitted requests, into their tenant's queue by priority."}},
	{"buildq.events.>", []string{"Every tenant's progress events."}},
	{"buildq.deadletter.>", []string{"Copies of requests that exhausted their deliveries."}},
	{"buildq.requests.>", []string{
		"Parked requests published again (their run failed for",
		"its claimer's own inputs, or nobody runs it any more).",
	}},
	{"buildq.internal.>", []string{
		"Results, into BUILDQ_RESULTS (buildq.internal.results.>: the",
		"stream stores and publishes them as buildq.results.>, once",
		"each); worker to worker: a canceled request is let go",
		"everywhere, a wake-up of idle dispatchers.",
	}},
	{"buildq.logs.>", []string{
		"Build log chunks into BUILDQ_LOGS (buildq.logs.<key>.<run>);",
		"tenants never get it: they read a log through the logs service.",
	}},
}

var workerSubscribe = []perm{
	{"_INBOX.>", []string{
		"Replies to its own requests (JetStream API, PubAcks) and",
		"the bucket watchers' deliveries: the default inbox prefix.",
	}},
	{"buildq.api.status.*", []string{
		"The tenant API (queue group buildq-api): status and cancel",
		"of each tenant, answered for the subject's tenant only.",
	}},
	{"buildq.api.cancel.*", nil},
	{"buildq.api.logs.*", []string{
		"The logs service: a build's log, served to a tenant one of",
		"whose requests the build answered.",
	}},
	{"buildq.api.results.*", []string{
		"The stored-results service: a tenant's own results stored",
		"after a point, read from BUILDQ_RESULTS for it (a watch that",
		"was disconnected asks it for what it missed).",
	}},
	{"buildq.cancel.*.*", []string{"The first version's cancel subject, buildq.cancel.<tenant>.<name>."}},
	{"buildq.internal.>", nil},
}

func subjects(ps []perm) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.subject
	}
	return out
}

// WorkerPublish are the subjects the worker's user may publish to; it may
// also answer each request it receives once (allow_responses).
func WorkerPublish() []string { return subjects(workerPublish) }

// WorkerSubscribe are the subjects the worker's user may subscribe to.
func WorkerSubscribe() []string { return subjects(workerSubscribe) }
