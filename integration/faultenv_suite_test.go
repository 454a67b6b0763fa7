//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"sort"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker"
)

// killNATS ends the suite's nats-server with SIGKILL and waits for it.
func (s *suite) killNATS() {
	s.t.Helper()
	s.natsMu.Lock()
	cmd := s.nats
	s.natsMu.Unlock()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		s.t.Fatal(err)
	}
	_, _ = cmd.Process.Wait()
}

// submitWith uploads dir and publishes n requests for it, each changed by
// mutate (may be nil).
func (s *suite) submitWith(dir, name string, n int, mutate func(*v1.Request)) []*v1.Request {
	s.t.Helper()
	ctx := context.Background()
	up, err := s.store.ForTenant("acme").UploadContext(ctx, dir, contexttar.Options{}, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	var reqs []*v1.Request
	for range n {
		req := &v1.Request{
			Tenant: "acme", Name: name,
			Source:        v1.Source{S3: &v1.S3Source{Bucket: up.Bucket, Key: up.Key}},
			ContextDigest: up.Digest,
		}
		if mutate != nil {
			mutate(req)
		}
		if _, err := s.pub.Publish(ctx, req); err != nil {
			s.t.Fatal(err)
		}
		reqs = append(reqs, req)
	}
	return reqs
}

func ids(reqs []*v1.Request) []string {
	var out []string
	for _, r := range reqs {
		out = append(out, r.RequestID)
	}
	return out
}

// js is a JetStream handle on the test's own connection.
func (s *suite) js() jetstream.JetStream {
	s.t.Helper()
	js, err := jetstream.New(s.nc)
	if err != nil {
		s.t.Fatal(err)
	}
	return js
}

// retry runs f until it succeeds (a cluster may be electing a leader, a
// restarted server may still be recovering its streams).
func retry[T any](t *testing.T, what string, f func(context.Context) (T, error)) T {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		v, err := f(ctx)
		cancel()
		if err == nil {
			return v
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (s *suite) streamInfo(name string) *jetstream.StreamInfo {
	s.t.Helper()
	js := s.js()
	return retry(s.t, "stream info "+name, func(ctx context.Context) (*jetstream.StreamInfo, error) {
		st, err := js.Stream(ctx, name)
		if err != nil {
			return nil, err
		}
		return st.Info(ctx)
	})
}

// queueState reads where the requests are: intake (buildq-workers on
// BUILDQ_REQUESTS) and the tenants' queues (BUILDQ_QUEUE).
func (s *suite) queueState() worker.QueueState {
	s.t.Helper()
	js := s.js()
	return *retry(s.t, "queue state", func(ctx context.Context) (*worker.QueueState, error) {
		q, err := worker.ReadQueueState(ctx, js)
		return &q, err
	})
}

// waitTaken waits until the workers took n requests and none waits in the
// stream: each is held (delivered, not yet acked) or parked on a build in
// progress (its message acked, its waiter entry parked).
func (s *suite) waitTaken(n int) {
	s.t.Helper()
	eventually(s.t, time.Minute, fmt.Sprintf("the workers to hold or park %d requests", n), func() bool {
		q := s.queueState()
		return q.Waiting == 0 && q.Held+s.parkedRequests() == n
	})
}

// parkedRequests counts the waiter entries of parked requests.
func (s *suite) parkedRequests() int {
	s.t.Helper()
	js := s.js()
	return retry(s.t, "count parked requests", func(ctx context.Context) (int, error) {
		kv, err := js.KeyValue(ctx, v1.RequestsBucket)
		if err != nil {
			return 0, err
		}
		lister, err := kv.ListKeysFiltered(ctx, "w.>")
		if errors.Is(err, jetstream.ErrNoKeysFound) {
			return 0, nil
		}
		if err != nil {
			return 0, err
		}
		defer func() { _ = lister.Stop() }()
		n := 0
		for k := range lister.Keys() {
			e, err := kv.Get(ctx, k)
			if err == nil && bytes.Contains(e.Value(), []byte(`"parked":true`)) {
				n++
			}
		}
		return n, nil
	})
}

// streamResults reads BUILDQ_RESULTS, the authority on what subscribers
// get: every stored result by request id.
func (s *suite) streamResults() map[string][]v1.Result {
	s.t.Helper()
	js := s.js()
	return retry(s.t, "read the results stream", func(ctx context.Context) (map[string][]v1.Result, error) {
		st, err := js.Stream(ctx, v1.ResultsStream)
		if err != nil {
			return nil, err
		}
		info, err := st.Info(ctx)
		if err != nil {
			return nil, err
		}
		out := map[string][]v1.Result{}
		if info.State.Msgs == 0 {
			return out, nil
		}
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			if err != nil {
				return nil, err
			}
			var r v1.Result
			if err := json.Unmarshal(m.Data, &r); err != nil {
				return nil, fmt.Errorf("result at %d: %w", seq, err)
			}
			// By the CloudEvents id (= requestId); the Nats-Msg-Id header
			// may be tenant-scoped.
			out[r.ID] = append(out[r.ID], r)
		}
		return out, nil
	})
}

// storedResultCounts counts the stored results by request id.
func (s *suite) storedResultCounts() map[string]int {
	s.t.Helper()
	counts := map[string]int{}
	for id, rs := range s.streamResults() {
		counts[id] = len(rs)
	}
	return counts
}

// answeredOnce waits until the results stream holds a result for each
// request id, checks that it holds exactly one per id, and returns them by
// id. It also checks that the test's subscriber (publisher.Watch, what
// `buildq watch --all` uses) got each of them, except in clusters whose
// nodes are killed (watchMayLag).
func (s *suite) answeredOnce(res *results, want []string, timeout time.Duration) map[string]v1.Result {
	s.t.Helper()
	var stored map[string][]v1.Result
	deadline := time.Now().Add(timeout)
	for {
		stored = s.streamResults()
		var missing []string
		for _, id := range want {
			if len(stored[id]) == 0 {
				missing = append(missing, id)
			}
		}
		if len(missing) == 0 {
			break
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("after %s, no result stored for %d of %d requests: %v", timeout, len(missing), len(want), missing)
		}
		time.Sleep(100 * time.Millisecond)
	}
	out := map[string]v1.Result{}
	for _, id := range want {
		if n := len(stored[id]); n != 1 {
			s.t.Errorf("request %s: %d results stored, want exactly 1", id, n)
		}
		out[id] = stored[id][0]
	}
	seen := func() []string {
		res.mu.Lock()
		defer res.mu.Unlock()
		got := map[string]bool{}
		for _, r := range res.got {
			got[r.ID] = true
		}
		var missing []string
		for _, id := range want {
			if !got[id] {
				missing = append(missing, id)
			}
		}
		return missing
	}
	if s.watchMayLag {
		return out
	}
	wdeadline := time.Now().Add(30 * time.Second)
	for missing := seen(); len(missing) > 0; missing = seen() {
		if time.Now().After(wdeadline) {
			s.t.Errorf("publisher.Watch has not delivered %d stored result(s) 30s after they were stored: %v", len(missing), missing)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return out
}

// settled checks the end state after every request of the test was
// answered: total results stored, one per request; the request stream and
// the consumer empty; no Job left in the namespace.
func (s *suite) settled(total int) {
	s.t.Helper()
	eventually(s.t, time.Minute, "the request streams to empty", func() bool {
		return s.queueState().Messages == 0
	})
	eventually(s.t, 30*time.Second, "the consumers to have nothing pending", func() bool {
		q := s.queueState()
		return q.Held == 0 && q.Waiting == 0
	})
	counts := s.storedResultCounts()
	n := 0
	for id, c := range counts {
		n += c
		if c != 1 {
			s.t.Errorf("request %s: %d results stored", id, c)
		}
	}
	if n != total {
		s.t.Errorf("%d results stored, want %d (one per request)", n, total)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		list, err := shared.kube.BatchV1().Jobs(s.ns).List(context.Background(), metav1.ListOptions{})
		if err == nil && len(list.Items) == 0 {
			return
		}
		if time.Now().After(deadline) {
			var left []string
			if list != nil {
				for _, j := range list.Items {
					left = append(left, fmt.Sprintf("%s(active=%d succeeded=%d failed=%d deleting=%v)", j.Name, j.Status.Active, j.Status.Succeeded, j.Status.Failed, j.DeletionTimestamp != nil))
				}
			}
			sort.Strings(left)
			s.t.Errorf("Jobs left in the namespace a minute after the last result: %v (%v)", left, err)
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// jobFinished reports whether the Job of request name has finished (as
// the shared API server sees it).
func (s *suite) jobFinished(name string) bool {
	list, err := shared.kube.BatchV1().Jobs(s.ns).List(context.Background(), metav1.ListOptions{LabelSelector: kaniko.LabelName + "=" + name})
	if err != nil {
		return false
	}
	for _, j := range list.Items {
		for _, c := range j.Status.Conditions {
			switch c.Type {
			case batchv1.JobComplete, batchv1.JobFailed, batchv1.JobSuccessCriteriaMet, batchv1.JobFailureTarget:
				if c.Status == corev1.ConditionTrue {
					return true
				}
			}
		}
	}
	return false
}

// count is the number of distinct results seen so far.
func (r *results) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// runCLI runs the buildq command line and returns its stdout, stderr and
// exit code.
func runCLI(t *testing.T, timeout time.Duration, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(shared.bin, "buildq"), args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatalf("buildq %v: %v", args, err)
	}
	if ctx.Err() != nil {
		t.Fatalf("buildq %v did not finish within %s; stderr:\n%s", args, timeout, errOut.String())
	}
	return out.String(), errOut.String(), code
}
