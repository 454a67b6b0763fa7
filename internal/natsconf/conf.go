package natsconf

import (
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nkeys"

	v1 "github.com/buildq/buildq/api/v1"
)

// ConfigOptions are the inputs of ServerConfig.
type ConfigOptions struct {
	// Tenants are the tenants' names (DNS-1123 labels), in the order their
	// accounts are written.
	Tenants []string
	// NKeys maps key names (WorkerKey, AdminKey or a tenant) to public user
	// nkeys written into the file. A user not in it authenticates with the
	// key in the environment variable NKeyVar(name), which nats-server
	// resolves when it reads the file.
	NKeys map[string]string
}

// ServerConfig is a nats-server configuration file (config-file mode) with
// the BUILDQ account and one account per tenant, explained by its comments
// for the operators who read it. JetStream is enabled; its store directory
// is left to the command line (nats-server -sd DIR).
func ServerConfig(o ConfigOptions) ([]byte, error) {
	if err := CheckTenants(o.Tenants); err != nil {
		return nil, err
	}
	users := Users(o.Tenants)
	for name, pub := range o.NKeys {
		if !slices.Contains(users, name) {
			return nil, fmt.Errorf("nkey for %q: no such user (want one of %s)", name, strings.Join(users, ", "))
		}
		if !nkeys.IsValidPublicUserKey(pub) {
			return nil, fmt.Errorf("nkey for %q: %q is not a public user nkey (U…)", name, pub)
		}
	}
	key := func(user string) string {
		if pub, ok := o.NKeys[user]; ok {
			return fmt.Sprintf("%q", pub)
		}
		return "$" + NKeyVar(user)
	}
	var fromEnv []string
	for _, u := range users {
		if _, ok := o.NKeys[u]; !ok {
			fromEnv = append(fromEnv, u)
		}
	}

	w := &confWriter{}
	writeHeader(w, o.Tenants, fromEnv)

	w.line("port: 4222")
	w.comment(
		"JetStream on. Its store directory is given on the command line",
		"(nats-server -c buildq.conf -sd /data/nats); or write",
		`jetstream { store_dir: "/data/nats" } here instead (not both: the server`,
		"refuses a store_dir set twice).",
	)
	w.line("jetstream: enabled")
	w.blank()
	w.open("accounts {")

	// BUILDQ.
	w.open("%s {", BuildqAccount)
	w.comment("The streams and buckets live in this account; only it has JetStream.")
	w.line("jetstream: enabled")
	w.blank()
	w.comment(
		"What each tenant may reach, exported to that tenant's account only:",
		"its request subject and services (a service import: the server",
		"replaces the reply subject with its own _R_... subject and routes",
		"the reply or PubAck back into the tenant's account) and its results",
		"and events (a stream import: delivered into the tenant's account).",
	)
	w.open("exports: [")
	for i, t := range o.Tenants {
		if i > 0 {
			w.blank()
		}
		acc := TenantAccount(t)
		w.comment("Tenant " + t + ".")
		for _, s := range TenantServices(t) {
			w.line("{ service: %q, accounts: [%q] }", s, acc)
		}
		for _, s := range TenantStreams(t) {
			w.line("{ stream: %q, accounts: [%q] }", s, acc)
		}
	}
	w.close("]")
	w.blank()
	w.open("users: [")
	w.comment("The workers.")
	w.open("{")
	w.line("nkey: %s", key(WorkerKey))
	w.open("permissions: {")
	writePerms(w, "publish", workerPublish)
	writePerms(w, "subscribe", workerSubscribe)
	w.comment(
		"Answer the tenant API: one reply to the reply subject of each",
		"request received (an _R_... subject that leads back into the",
		"asking tenant's account), and nowhere else.",
	)
	w.line("allow_responses: true")
	w.close("}")
	w.close("}")
	w.blank()
	w.comment("Operators: no permissions block, so every subject of the account",
		"(buildq watch --all, nats stream view BUILDQ_RESULTS, nats kv ls, ...).")
	w.line("{ nkey: %s }", key(AdminKey))
	w.close("]")
	w.close("}")

	// The tenants.
	for i, t := range o.Tenants {
		w.blank()
		acc := TenantAccount(t)
		if i == 0 {
			w.comment(
				"Tenant "+t+": an account of its own. It sees of BUILDQ exactly what",
				"it imports, under the same subjects; it has no JetStream and",
				"no bucket, and nothing it publishes, nor any reply subject it",
				"names, reaches another account except through these imports.",
			)
		} else {
			w.comment("Tenant " + t + ": the same, for " + t + ".")
		}
		w.open("%q {", acc)
		w.open("imports: [")
		for _, s := range TenantServices(t) {
			w.line("{ service: { account: %q, subject: %q } }", BuildqAccount, s)
		}
		for _, s := range TenantStreams(t) {
			w.line("{ stream: { account: %q, subject: %q } }", BuildqAccount, s)
		}
		w.close("]")
		w.open("users: [")
		w.open("{")
		w.line("nkey: %s", key(t))
		w.open("permissions: {")
		if i == 0 {
			writePerms(w, "publish", []perm{
				{TenantServices(t)[0], []string{
					"Its build requests (a JetStream publish: BUILDQ_REQUESTS",
					"stores them; the PubAck comes back on its inbox). The",
					"worker refuses a body whose tenant is not this subject's.",
				}},
				{TenantServices(t)[1], []string{
					"Its status and cancel services (request/reply; the worker",
					"answers for " + t + "'s requests and builds only).",
				}},
				{TenantServices(t)[2], nil},
				{TenantServices(t)[3], []string{
					"Its logs service: the log of a build that answered one of",
					t + "'s requests. The logs themselves (buildq.logs.>, the",
					"BUILDQ_LOGS stream) stay in BUILDQ: no subscription, no",
					"JetStream API.",
				}},
				{TenantServices(t)[4], []string{
					"Its stored-results service: " + t + "'s own results stored",
					"after a point (what a watch missed while disconnected),",
					"read from BUILDQ_RESULTS for it by the workers.",
				}},
				{TenantServices(t)[5], []string{"The first version's cancel subject, for its own names."}},
			})
			writePerms(w, "subscribe", []perm{
				{TenantStreams(t)[0], []string{
					"Its results as they are published (core NATS; results",
					"decided earlier come from the status service).",
				}},
				{TenantStreams(t)[1], []string{"Its progress events."}},
				{TenantInboxes(t)[0], []string{
					"Replies to it: PubAcks and service answers, on the default",
					"inbox or on the prefix _INBOX_" + t + " (both in its own account).",
				}},
				{TenantInboxes(t)[1], nil},
			})
		} else {
			writePerms(w, "publish", plain(TenantServices(t)))
			writePerms(w, "subscribe", plain(append(TenantStreams(t), TenantInboxes(t)...)))
		}
		w.close("}")
		w.close("}")
		w.close("]")
		w.close("}")
	}
	w.close("}")
	return []byte(w.b.String()), nil
}

func plain(subjects []string) []perm {
	ps := make([]perm, len(subjects))
	for i, s := range subjects {
		ps[i] = perm{subject: s}
	}
	return ps
}

func writePerms(w *confWriter, kind string, ps []perm) {
	w.open("%s: {", kind)
	w.open("allow: [")
	for _, p := range ps {
		w.comment(p.comment...)
		w.line("%q", p.subject)
	}
	w.close("]")
	w.close("}")
}

func writeHeader(w *confWriter, tenants, fromEnv []string) {
	gen := "buildq nats-config"
	if len(fromEnv) < len(Users(tenants)) {
		gen += " --nkeys DIR"
	}
	for _, t := range tenants {
		gen += " --tenant " + t
	}
	w.comment(
		"nats-server configuration for buildq: the tenants are accounts of their own.",
		"Made by `"+gen+"`;",
		"deploy/nats/README.md tells how to change it.",
		"",
		"Why accounts: NATS checks the subject a user publishes to, never the reply",
		"subject. Were the tenants users of the account that holds the streams and",
		"buckets, a tenant could publish its request with the reply subject",
		"$KV.buildq-builds.<key>, and the server itself would write the PubAck into",
		"the bucket. So:",
		"",
		"  BUILDQ         the streams (BUILDQ_REQUESTS, BUILDQ_QUEUE, BUILDQ_RESULTS,",
		"                 BUILDQ_DEADLETTER, BUILDQ_LOGS) and the KV buckets",
		"                 (buildq-builds, buildq-requests, buildq-slots), with",
		"                 JetStream. Users:",
		"    buildq-worker  the workers: the JetStream API, the buckets, every",
		"                   tenant's results and events, the tenant API services,",
		"                   the build logs (buildq.logs.>) and the workers' own",
		"                   buildq.internal.> subjects.",
		"    buildq-admin   operators: everything in the account.",
	)
	for i, t := range tenants {
		name := TenantAccount(t)
		first := "  " + name + strings.Repeat(" ", max(1, 15-len(name)))
		if i == 0 {
			w.comment(wrap("tenant "+t+", one user. It imports from BUILDQ its request subject "+
				v1.RequestSubject(t)+" and its services "+strings.Join(TenantServices(t)[1:], ", ")+
				" (request/reply: the server replaces the reply subject with an _R_... subject of its own"+
				" and routes the answer or PubAck back into this account, so no reply subject can name"+
				" BUILDQ's buckets), and the streams "+strings.Join(TenantStreams(t), " and ")+
				". No JetStream, no bucket, no build log but through its logs service, nothing of another tenant.", 78, first, strings.Repeat(" ", 17))...)
		} else {
			w.comment(first + "tenant " + t + ", the same for " + t + ".")
		}
	}
	w.comment("")
	if len(fromEnv) > 0 {
		var vars []string
		for _, u := range fromEnv {
			vars = append(vars, NKeyVar(u)+"=U...")
		}
		w.comment(
			"Users authenticate with nkeys. The file holds public keys only; those",
			"written as $BUILDQ_<NAME>_NKEY are read from the environment (nats-server",
			"resolves an undefined $NAME from it and refuses to start when it is unset).",
			"Make a key pair per user with",
			"    buildq nats-config --nkeys DIR --tenant ...",
			"(DIR/<user>.seed; the file it prints has the public keys written in), or",
			"    go run github.com/nats-io/nkeys/nk@latest -gen user -pubout",
			"(line 1: the seed, kept by the user; line 2: the public key, for here).",
			"",
			"Run:",
		)
		w.comment(shellLines(append(vars, "nats-server", "-c", "buildq.conf", "-sd", "/data/nats"), 76)...)
	} else {
		w.comment(
			"Users authenticate with nkeys; the public keys are written below and",
			"the seeds are in the --nkeys directory (<user>.seed).",
			"",
			"Run:",
			"    nats-server -c buildq.conf -sd /data/nats",
		)
	}
	newKey := "set " + NKeyVar("T") + " as well"
	if len(fromEnv) < len(Users(tenants)) {
		newKey = "the same --nkeys DIR: its keys are kept and T's is made"
	}
	w.comment(
		"",
		"Connect with the seed file:",
		"    buildq worker --nats-nkey worker.seed ...",
		"    buildq submit DIR --tenant "+tenants[0]+" --nats-nkey "+tenants[0]+".seed --wait",
		"A tenant's clients may use any inbox prefix: replies come back into its",
		"own account (--inbox-prefix _INBOX_"+tenants[0]+" still works).",
		"",
	)
	w.comment(wrap("To add a tenant T (a DNS-1123 label): run the command above again with --tenant T added ("+newKey+
		"), put the new file in place of this one and restart nats-server. A reload is not enough:"+
		" nats-server 2.15 adds T's account on the first reload (SIGHUP) but its service imports only on"+
		" the next one, so signal it twice if it must not restart. T's clients connect with T's seed and --tenant T.", 78, "", "")...)
	w.blank()
}

// shellLines lays out a shell command line as comment lines of at most
// width characters, continued with backslashes.
func shellLines(words []string, width int) []string {
	var lines []string
	line := "  "
	for i, word := range words {
		if i > 0 && len(line)+len(word)+2 > width {
			lines = append(lines, line+"\\")
			line = "    "
		}
		line += word + " "
	}
	return append(lines, strings.TrimRight(line, " "))
}

// confWriter writes nats-server configuration text with two-space
// indentation.
type confWriter struct {
	b     strings.Builder
	depth int
}

func (w *confWriter) line(format string, args ...any) {
	w.b.WriteString(strings.Repeat("  ", w.depth))
	fmt.Fprintf(&w.b, format, args...)
	w.b.WriteByte('\n')
}

func (w *confWriter) blank() { w.b.WriteByte('\n') }

func (w *confWriter) comment(lines ...string) {
	for _, l := range lines {
		w.b.WriteString(strings.Repeat("  ", w.depth))
		if l == "" {
			w.b.WriteString("#\n")
			continue
		}
		w.b.WriteString("# " + l + "\n")
	}
}

func (w *confWriter) open(format string, args ...any) {
	w.line(format, args...)
	w.depth++
}

func (w *confWriter) close(s string) {
	w.depth--
	w.line("%s", s)
}
