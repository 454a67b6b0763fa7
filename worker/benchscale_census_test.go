//go:build benchscale && linux

package worker

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"
)

// subjectCensus counts the messages a topology's clients publish, by the
// kind of subject (BUILDQ_SCALE_CENSUS=1): what the messages into the
// servers per request are made of. It subscribes to every subject, so it
// adds the servers' work of one more subscriber to the run it measures:
// a diagnostic run, not the page's.
type subjectCensus struct {
	mu     sync.Mutex
	counts map[string]int
	sub    *nats.Subscription
}

func startCensus(t *testing.T, nc *nats.Conn) *subjectCensus {
	t.Helper()
	c := &subjectCensus{counts: map[string]int{}}
	sub, err := nc.Subscribe(">", func(m *nats.Msg) {
		k := censusKind(m.Subject)
		if strings.HasPrefix(m.Reply, "$JS.ACK.") {
			k += " (a consumer's delivery)"
		}
		if m.Header.Get("Nats-Stream") != "" {
			k += " (stream headers: a republish, or a direct get's reply)"
		}
		c.mu.Lock()
		c.counts[k]++
		c.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	c.sub = sub
	return c
}

// censusKind names a subject by its kind: tenants, request ids, keys and
// inboxes dropped. A consumer's delivery shows under the message's own
// subject (a request fetched counts under buildq.requests beside its
// publish, marked as a consumer's delivery by its $JS.ACK reply), and a
// KV watch's under its key's.
func censusKind(subj string) string {
	tok := strings.Split(subj, ".")
	switch {
	case tok[0] == "_INBOX":
		return "_INBOX (replies)"
	case tok[0] == "$JS" && len(tok) > 2 && tok[1] == "ACK":
		return "$JS.ACK." + tok[2]
	case tok[0] == "$JS" && len(tok) > 3 && tok[1] == "API":
		switch tok[2] {
		case "DIRECT":
			// A key-value read names its key: $JS.API.DIRECT.GET.<stream>.$KV.<bucket>.<key>.
			k := strings.Join(tok[:4], ".") + " " + censusStream(tok)
			if len(tok) > 7 && tok[5] == "$KV" {
				if len(tok[7]) >= 40 {
					return k + " (entries)"
				}
				return k + " " + tok[7]
			}
			return k
		case "CONSUMER", "STREAM":
			return strings.Join(tok[:4], ".") + " " + censusStream(tok)
		}
		return strings.Join(tok[:3], ".")
	case tok[0] == "$JS" && len(tok) > 2 && tok[1] == "FC":
		return "$JS.FC"
	case tok[0] == "$JS" && len(tok) > 3 && tok[1] == "EVENT":
		return strings.Join(tok[:4], ".")
	case tok[0] == "buildq" && len(tok) > 2 && tok[1] == "internal":
		return strings.Join(tok[:3], ".")
	case tok[0] == "$KV" && len(tok) > 2:
		if len(tok[2]) >= 40 {
			return "$KV." + tok[1] + " (entries)" // ledger entries, build records
		}
		return "$KV." + tok[1] + " " + tok[2] // "w." waiters, "p." pending marks
	case len(tok) >= 2:
		return tok[0] + "." + tok[1]
	}
	return subj
}

func censusStream(tok []string) string {
	if len(tok) > 4 {
		return tok[4]
	}
	return ""
}

// report is the census per request, largest first.
func (c *subjectCensus) report(requests int) string {
	_ = c.sub.Unsubscribe()
	c.mu.Lock()
	defer c.mu.Unlock()
	type kv struct {
		k string
		n int
	}
	var all []kv
	total := 0
	for k, n := range c.counts {
		all = append(all, kv{k, n})
		total += n
	}
	slices.SortFunc(all, func(a, b kv) int { return b.n - a.n })
	var b strings.Builder
	fmt.Fprintf(&b, "client messages per request, by subject (census): %.2f in all", float64(total)/float64(requests))
	for _, e := range all {
		if float64(e.n)/float64(requests) < 0.01 {
			continue
		}
		fmt.Fprintf(&b, "; %s %.2f", e.k, float64(e.n)/float64(requests))
	}
	return b.String()
}
