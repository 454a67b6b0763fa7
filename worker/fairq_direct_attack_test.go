package worker

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// A tenant's own Buildq-Intake-* headers (any case) act neither on a
// request taken straight from intake nor on a queued one.
//
// Origin: attack review of taking requests straight from intake (272503c):
// held.
func TestAttack_ATenantsIntakeHeadersActOnNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		direct uint64
	}{
		{"direct", nil, 1},
		{"queued", func(c *Config) { c.Fair.QueueLimit = map[string]int{"acme": 100} }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			w1 := e.startWorker("w1", tc.mutate)
			results := e.collect()
			req := request("atk-hdr-" + tc.name)
			req.APIVersion, req.RequestID, req.SubmittedAt = v1.APIVersion, "atk-hdr-"+tc.name, time.Now().UTC()
			b, _ := json.Marshal(req)
			m := nats.NewMsg(v1.RequestSubject("acme"))
			m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", req.RequestID))
			m.Header["Buildq-Intake-Delivered"] = []string{"40"}
			m.Header["buildq-intake-delivered"] = []string{"40"}
			m.Header["Buildq-Intake-Seq"] = []string{"1"}
			m.Header["Buildq-Intake-Subject"] = []string{"buildq.requests.globex"}
			m.Data = b
			if tc.direct == 1 {
				// Taken straight from intake only by a dispatcher that
				// already waits idle.
				waitIdle(t, w1)
			}
			if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
				t.Fatal(err)
			}
			job := e.waitJob(jobOf(req))
			e.kubelet(job, 0, digestOf("x"))
			r := results.waitFor(t, 1, 10*time.Second)[0]
			t.Logf("%s: taken direct %d; result tenant=%s attempts=%d %s", tc.name, takenDirect(w1), r.Data.Tenant, r.Data.Attempts, decision(r.Data))
			if takenDirect(w1) != tc.direct || r.Data.Attempts != 1 || r.Data.Tenant != "acme" {
				t.Errorf("tenant headers acted")
			}
		})
	}
}
