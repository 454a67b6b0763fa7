//go:build integration && benche2e

package integration

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
)

// TestBenchE2ERecovery measures P7: how long a build waits when its
// worker dies (SIGKILL: redelivery after AckWait, take-over after the
// lease) or stops (SIGTERM: handed off at once).
func TestBenchE2ERecovery(t *testing.T) {
	start := time.Now()
	const (
		ackWait = 5 * time.Second // the suite's --ack-wait
		lease   = 3 * time.Second // the suite's --lease
		rounds  = 3
	)
	names := []string{}
	for _, sig := range []string{"kill", "term"} {
		for i := range rounds {
			names = append(names, fmt.Sprintf("%s-%d", sig, i))
		}
	}
	h := newHolds(t, names...)
	s := newSuite(t, options{faults: h.fault})
	src := s.benchSource()
	results := s.resultClock()
	// measure runs one request on one of two workers, signals its worker
	// with sig as the build ends, and returns how long until the other
	// worker took the request on (its first progress event) and until the
	// result arrived.
	measure := func(name string, sig syscall.Signal) (resumed, answered float64) {
		a := s.startBenchWorker(name + "-a")
		b := s.startBenchWorker(name + "-b")
		defer b.stop(t, syscall.SIGTERM)
		var mu sync.Mutex
		var events []v1.Event
		var eventAt []time.Time
		sub, err := s.nc.Subscribe(v1.EventSubject("acme", name), func(m *nats.Msg) {
			var e v1.Event
			if json.Unmarshal(m.Data, &e) == nil {
				mu.Lock()
				events, eventAt = append(events, e), append(eventAt, time.Now())
				mu.Unlock()
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = sub.Unsubscribe() }()
		req := src.request(name, name)
		src.publish(req)
		// The worker that creates the Job says so in its progress events.
		var owner, other *benchWorker
		eventually(t, time.Minute, "the Job of "+name, func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, e := range events {
				if e.Phase == v1.PhaseJobCreated {
					owner, other = a, b
					if e.Worker == b.id {
						owner, other = b, a
					}
					return true
				}
			}
			return false
		})
		t0 := time.Now()
		owner.stop(t, sig)
		h.release(name)
		results.wait(t, []string{req.RequestID}, 2*time.Minute)
		results.check(t, []string{req.RequestID})
		results.mu.Lock()
		by := results.src[req.RequestID]
		results.mu.Unlock()
		if !containsID(by, other.id) {
			t.Errorf("%s answered by %q, want the other worker %s", name, by, other.id)
		}
		mu.Lock()
		for i, e := range events {
			if e.Worker == other.id && eventAt[i].After(t0) {
				resumed = ms(eventAt[i].Sub(t0))
				break
			}
		}
		mu.Unlock()
		if other == a {
			a.stop(t, syscall.SIGTERM)
		}
		return resumed, ms(results.arrival(req.RequestID).Sub(t0))
	}
	var kill, term, killDone, termDone []float64
	for i := range rounds {
		r, d := measure(fmt.Sprintf("kill-%d", i), syscall.SIGKILL)
		kill, killDone = append(kill, r), append(killDone, d)
		r, d = measure(fmt.Sprintf("term-%d", i), syscall.SIGTERM)
		term, termDone = append(term, r), append(termDone, d)
	}
	k50, _ := pct(kill)
	t50, _ := pct(term)
	kd50, _ := pct(killDone)
	td50, _ := pct(termDone)
	writeResult(t, benchfmt.Result{ID: "P7", Title: "a worker's build resumed elsewhere: SIGKILL, SIGTERM",
		Baseline: fmt.Sprintf("AckWait (%v) for SIGKILL, lease (%v) for SIGTERM", ackWait, lease),
		Rows: []benchfmt.Row{
			benchfmt.Compared("P7 SIGKILL → request taken on by the other worker, median", "ms", k50, ms(ackWait)),
			benchfmt.Compared("P7 SIGKILL → result, median", "ms", kd50, ms(ackWait)),
			benchfmt.Compared("P7 SIGTERM → request taken on by the other worker, median", "ms", t50, ms(lease)),
			benchfmt.Compared("P7 SIGTERM → result, median", "ms", td50, ms(lease)),
		},
		Notes: []string{fmt.Sprintf("median of %d rounds each, two workers, --ack-wait %v, --lease %v; the build is held while its worker runs and let go when the worker is signalled, so the result also waits for the rest of the emulated build (context fetch, build, push)", rounds, ackWait, lease),
			"SIGKILL: the request comes back after AckWait and the other worker adopts the running Job; SIGTERM: the worker hands the request and its claim back at once"},
		Seconds: time.Since(start).Seconds()})
}

func containsID(source, id string) bool {
	return regexp.MustCompile(`\b` + regexp.QuoteMeta(id) + `\b`).MatchString(source)
}
