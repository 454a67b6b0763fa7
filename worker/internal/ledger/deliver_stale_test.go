package ledger

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// getHookKV runs a hook before each Get.
type getHookKV struct {
	jetstream.KeyValue
	beforeGet func()
}

func (k *getHookKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.beforeGet != nil {
		k.beforeGet()
	}
	return k.KeyValue.Get(ctx, key)
}

// Two deciders and a stale decision: a handler published "succeeded"
// first and was killed before recording it (stored, entry undecided). A
// cancel marks the request. The redelivery's handler records its
// decision first: the mark turns it into "canceled" (Record). The cancel's
// Record finds that "canceled" recorded, unpublished (stood). Before the
// cancel's publishRight reads the entry again, the redelivery publishes
// "canceled", is answered as a duplicate of "succeeded", and adopts it
// (entry: succeeded, published). publishRight sees the entry published
// and returns publishDone; Deliver returns WasPublished with the stale
// "canceled" it read in Record, so deliverCanceled reports canceled and
// the cancel replied canceled: true while the stored result was
// "succeeded". Deliver now returns the entry as it reads it published.
// (Found by an attack on the publish-first rule.)
func TestADeliveryFoundPublishedReportsTheEntrysResultNotTheOneItReadBefore(t *testing.T) {
	w := newWorld(t)
	s := newStream()
	clk := newClock()
	dead := w.firstLedger("w1", clk, s)
	open(t, dead, "acme", "r1")
	if _, err := s.Publish(t.Context(), decision("acme", "r1", v1.StatusSucceeded)); err != nil {
		t.Fatal(err) // published first; killed before the record
	}
	canceler := w.firstLedger("w2", clk, s)
	ce := read(t, canceler, "acme", "r1")
	if ok, err := canceler.MarkCanceled(t.Context(), ce); !ok || err != nil {
		t.Fatalf("MarkCanceled = %v, %v", ok, err)
	}
	redelivery := w.firstLedger("w3", clk, s)
	he := read(t, redelivery, "acme", "r1")
	cancelRecorded, hDone := make(chan struct{}), make(chan struct{})
	var hOut Delivered
	var hErr error
	go func() {
		defer close(hDone)
		// Recorded first (a cache hit from the run's end, or a failed first
		// publish): its Record meets the cancel's mark.
		hOut, hErr = redelivery.Deliver(t.Context(), he, decision("acme", "r1", v1.StatusSucceeded), Delivery{
			Publish: func(ctx context.Context, d Decision) (Ack, error) {
				<-cancelRecorded
				return s.Publish(ctx, d)
			}})
	}()
	eventually(t, func() bool { e := read(t, canceler, "acme", "r1"); return e.E.Result != nil })
	kv := &getHookKV{KeyValue: w.kv}
	var once sync.Once
	kv.beforeGet = func() {
		once.Do(func() { close(cancelRecorded); <-hDone }) // publishRight's read
	}
	c2 := w.ledger("w2", clk, grace, kv)
	c2.cfg.Results, c2.cfg.Young = s, canceler.cfg.Young
	ce = read(t, canceler, "acme", "r1")
	got, err := c2.Deliver(t.Context(), ce, decision("acme", "r1", v1.StatusCanceled), Delivery{Publish: s.Publish, Now: true})
	if err != nil {
		t.Fatal(err)
	}
	<-hDone
	e := read(t, canceler, "acme", "r1").E
	t.Logf("redelivery: %v %s, %v; cancel: %v %s; entry %s published %v; stored %d: %s",
		hOut.Status, hOut.Decision.Data.Status, hErr, got.Status, got.Decision.Data.Status, e.Result.Status, e.Published, len(s.stored), s.stored[0].Status)
	canceledSaid := (got.Status == Published || got.Status == WasPublished) && got.Decision.Data.Status == v1.StatusCanceled
	if canceledSaid && s.stored[0].Status != v1.StatusCanceled {
		t.Fatalf("the cancel's delivery reports %v %s (deliverCanceled → canceled: true), the stored result is %s and the entry holds %s",
			got.Status, got.Decision.Data.Status, s.stored[0].Status, e.Result.Status)
	}
}

func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
