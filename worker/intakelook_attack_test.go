package worker

import (
	"context"
	"fmt"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// Hostile tenant: a tenant with a limit drives no registry traffic from
// intake. Its requests are never taken straight from intake, so none has
// a preflight HEAD sent ahead — not a backlog at its concurrency limit (a
// HEAD each, never used), nor requests refused over its queue limit.
//
// Origin: attack review of taking requests straight from intake; failed
// on 272503c (a HEAD sent for every request while the worker had a slot
// free), fixed by sending it only when the dispatcher waits idle and the
// request may be taken direct.
func TestAttack_NoPreflightAheadForRequestsThatWait(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		limit func(*Config)
	}{
		{"concurrency", func(c *Config) { c.Fair.Concurrency = map[string]int{"acme": 1} }},
		{"queue-limit", func(c *Config) { c.Fair.QueueLimit = map[string]int{"acme": 1} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			reg := &headCounter{Registry: tr.client}
			e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Registry = reg; tc.limit(c) })
			results := e.collect()
			first := request("atk-limit-0")
			if _, err := e.pub.Publish(context.Background(), first); err != nil {
				t.Fatal(err)
			}
			e.waitJob(jobOf(first))
			var tags []string
			for i := 1; i <= 5; i++ {
				r := request(fmt.Sprintf("atk-limit-%d", i))
				tags = append(tags, tr.host+"/acme/web:"+v1.DefaultTag(v1.BuildKey(r, kanikoID)))
				if _, err := e.pub.Publish(context.Background(), r); err != nil {
					t.Fatal(err)
				}
			}
			time.Sleep(1500 * time.Millisecond)
			heads := 0
			for _, tag := range tags {
				heads += reg.count(tag)
			}
			t.Logf("%s: results so far %d; HEADs of the 5 waiting/refused requests' tags: %d", tc.name, len(results.snapshot()), heads)
			if heads > 0 {
				t.Errorf("%d preflight HEADs sent ahead for requests that were not taken at once", heads)
			}
		})
	}
}

// slowHeads delays every HEAD by d (honoring ctx).
type slowHeads struct {
	headCounter
	d time.Duration
}

func (s *slowHeads) Head(ctx context.Context, ref string) (string, error) {
	select {
	case <-time.After(s.d):
	case <-ctx.Done():
		s.headCounter.mu.Lock()
		if s.headCounter.heads == nil {
			s.headCounter.heads = map[string]int{}
		}
		s.headCounter.heads["timeout:"+ref]++
		s.headCounter.mu.Unlock()
		return "", ctx.Err()
	}
	return s.headCounter.Head(ctx, ref)
}

// A slow registry (a HEAD of 700 ms) costs the handler no more than its
// own HEAD would: the HEAD sent ahead is not cut at a deadline shorter
// than the handler's, which would leave the handler waiting for it and
// then sending one of its own.
//
// Origin: attack review of taking requests straight from intake; failed
// on 272503c (the HEAD sent ahead had 500 ms), fixed with the handler's
// budget.
func TestAttack_ASlowRegistryCostsNoMoreThanOneHEAD(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	reg := &slowHeads{headCounter: headCounter{Registry: tr.client}, d: 700 * time.Millisecond}
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Registry = reg })
	results := e.collect()
	req := request("atk-slow")
	tag := tr.host + "/acme/web:" + v1.DefaultTag(v1.BuildKey(req, kanikoID))
	start := time.Now()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	took := time.Since(start)
	t.Logf("publish → Job %s; HEADs answered %d, HEADs cut by their deadline %d", took, reg.count(tag), reg.count("timeout:"+tag))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	results.waitFor(t, 1, 10*time.Second)
	if reg.count("timeout:"+tag) > 0 {
		t.Errorf("the HEAD sent ahead was cut at its deadline and the handler waited for it (%s to the Job)", took)
	}
}
