package worker

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// losingJS loses the first requests of the named JetStream API calls the
// way a dropped connection does: the request goes unanswered and waits
// out its context.
type losingJS struct {
	jetstream.JetStream
	mu   sync.Mutex
	lose map[string]int // call → how many more to lose
	lost map[string]int
}

func (j *losingJS) drop(ctx context.Context, call string) error {
	j.mu.Lock()
	n := j.lose[call]
	if n > 0 {
		j.lose[call]--
	}
	j.mu.Unlock()
	if n == 0 {
		return nil
	}
	<-ctx.Done()
	j.mu.Lock()
	j.lost[call]++
	j.mu.Unlock()
	return ctx.Err()
}

func (j *losingJS) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	if err := j.drop(ctx, "Stream"); err != nil {
		return nil, err
	}
	st, err := j.JetStream.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return losingStream{st, j}, nil
}

func (j *losingJS) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	if err := j.drop(ctx, "CreateConsumer"); err != nil {
		return nil, err
	}
	return j.JetStream.CreateConsumer(ctx, stream, cfg)
}

func (j *losingJS) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	if strings.HasPrefix(m.Subject, v1.ResultsIngestPrefix+".") {
		if err := j.drop(ctx, "PublishMsg"); err != nil {
			return nil, err
		}
	}
	return j.JetStream.PublishMsg(ctx, m, opts...)
}

type losingStream struct {
	jetstream.Stream
	j *losingJS
}

func (s losingStream) GetLastMsgForSubject(ctx context.Context, subject string) (*jetstream.RawStreamMsg, error) {
	if err := s.j.drop(ctx, "GetLastMsgForSubject"); err != nil {
		return nil, err
	}
	return s.Stream.GetLastMsgForSubject(ctx, subject)
}

func (s losingStream) GetMsg(ctx context.Context, seq uint64, opts ...jetstream.GetMsgOpt) (*jetstream.RawStreamMsg, error) {
	if err := s.j.drop(ctx, "GetMsg"); err != nil {
		return nil, err
	}
	return s.Stream.GetMsg(ctx, seq, opts...)
}

// A look for a stored result whose JetStream API requests are lost to a
// dropped connection sends each again once its attempt runs out, and
// finds the result while its own context still allows: a lost request
// no longer holds the request's decision until that context's end.
func TestALookForAStoredResultOutlivesLostAPIRequests(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	store := func(id, state string) {
		m := nats.NewMsg(v1.ResultsIngestPrefix + ".acme.web")
		m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", id))
		m.Data = []byte(`{"data":{"status":"` + state + `"}}`)
		if _, err := e.js.PublishMsg(t.Context(), m); err != nil {
			t.Fatal(err)
		}
	}
	since := time.Now().Add(-time.Minute)
	store("older", "failed")
	store("newest", "succeeded")

	for _, tc := range []struct {
		id, want string
		lose     map[string]int
	}{
		// The subject's last result is the request's: two reads.
		{"newest", "succeeded", map[string]int{"Stream": 2, "GetLastMsgForSubject": 1}},
		// An older one: the headers read by a consumer, then the message.
		{"older", "failed", map[string]int{"CreateConsumer": 1, "GetMsg": 2}},
	} {
		js := &losingJS{JetStream: e.js, lose: map[string]int{}, lost: map[string]int{}}
		for k, v := range tc.lose {
			js.lose[k] = v
		}
		r := storedResults{js: js, attempt: 200 * time.Millisecond}
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		d, err := r.Find(ctx, "acme", "web", tc.id, since)
		cancel()
		if err != nil || d == nil {
			t.Fatalf("look for %s with requests lost %v: %v, %v", tc.id, tc.lose, d, err)
		}
		if string(d.Status) != tc.want {
			t.Errorf("look for %s: status %q, want %q", tc.id, d.Status, tc.want)
		}
		for call, n := range tc.lose {
			if js.lost[call] != n {
				t.Errorf("look for %s: %d %s requests lost, want %d", tc.id, js.lost[call], call, n)
			}
		}
	}
}

// A look's retries stop with its context: a request lost every time
// ends the look at the context's deadline, with that error.
func TestALookStopsRetryingWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	tries := 0
	_, err := retry(ctx, 100*time.Millisecond, func(ctx context.Context) (int, error) {
		tries++
		<-ctx.Done()
		return 0, ctx.Err()
	})
	if !errors.Is(err, context.DeadlineExceeded) || ctx.Err() == nil {
		t.Fatalf("retry returned %v with its context alive: %v", err, ctx.Err())
	}
	if tries < 2 {
		t.Errorf("%d tries, want the lost request sent again", tries)
	}
	// Any other error is returned at once.
	tries = 0
	boom := errors.New("no stream")
	if _, err := retry(t.Context(), time.Second, func(context.Context) (int, error) { tries++; return 0, boom }); !errors.Is(err, boom) || tries != 1 {
		t.Errorf("retry of a failing request: %v after %d tries, want it returned after one", err, tries)
	}
}

// A result's publish whose PubAck is lost to a dropped connection fails
// once its attempt runs out, with the caller's context still alive: the
// ledger's rules for a failed publish (record, publish again; or retry
// the request) take over then, not when the caller's 15 s are spent.
func TestAResultsPublishWhosePubAckIsLostFailsOnItsOwn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	js := &losingJS{JetStream: w.js, lose: map[string]int{"PublishMsg": 1}, lost: map[string]int{}}
	w.js, w.publishAttempt = js, 200*time.Millisecond
	d := ledger.Decision{Tenant: "acme", Name: "web", Data: v1.ResultData{RequestID: "lost-ack", Tenant: "acme", Name: "web", Status: v1.StatusSucceeded}}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := w.publish(ctx, d); !errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
		t.Fatalf("publish with its PubAck lost: %v, the caller's context: %v; want the attempt's deadline, the caller's context alive", err, ctx.Err())
	}
	ack, err := w.publish(ctx, d)
	if err != nil || ack.Duplicate {
		t.Fatalf("the publish sent again: %+v, %v", ack, err)
	}
	got, err := storedResults{js: e.js}.Stored(ctx, ack.Seq)
	if err != nil || got.RequestID != "lost-ack" || got.Status != v1.StatusSucceeded {
		t.Fatalf("stored result: %+v, %v", got, err)
	}
}
