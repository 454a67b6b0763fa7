//go:build integration

package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// hostileReply is a reply subject an attacker names: a subject the server
// or a worker publishes on.
type hostileReply struct {
	subject string
	// legit recognizes the legitimate traffic on the subject (nil: there
	// is none while the attack runs): anything else there is the attack's.
	legit func(data []byte) bool
}

// replyAttack is the reply-subject attack matrix. NATS checks the subject a
// client publishes to, never the reply subject it names: tenant attacker
// sends, for every subject family the server or a worker publishes on —
// each bucket's $KV subjects, each stream's, buildq.internal.>, $JS.API.>,
// victim's results, events, dead letters, services and inboxes — (a) a
// JetStream publish on its own request subject, (b) a status request and
// (c) cancel requests (buildq.api.cancel.<attacker> and
// buildq.cancel.<attacker>.<name>) with that subject as the reply. All of
// it is allowed (no permission covers a reply subject); the service imports
// give every one a reply subject of the server's (_R_.…) in BUILDQ and
// route its PubAck or answer back into the attacker's own account, under
// the subject it named, where nothing of BUILDQ's or the victim's is.
//
// Asserted: an operator subscribed in BUILDQ to every hostile subject
// receives nothing of the attack; the named keys do not exist or are
// unchanged; the streams, the bucket stream and the consumer still exist
// and hold nothing the attack put there; the victim's held request is
// untouched; the victim receives nothing; and each of the attacker's sends
// was answered — on the attacker's own subject, as the one it could read
// (_INBOX.<token>) shows — and its own PubAcks and status answers still
// come back.
//
// The victim must have only held in flight (done finished), and nobody
// else may use the tenant API while it runs: it counts the answers.
func (e *natsAuthEnv) replyAttack(t *testing.T, attacker, victim string, held *v1.Request, heldKey string, done *v1.Request) {
	s := e.s
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	js := s.js()
	token := nuid.Next() // unique in every family where legitimate traffic is
	name := "u" + strings.ToLower(token)
	slot := func() string {
		n, err := rand.Int(rand.Reader, big.NewInt(1e9))
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(1000 + n.Int64())
	}
	doneLedger := worker.RequestIndexKey(victim, done.RequestID)
	heldLedger := worker.RequestIndexKey(victim, held.RequestID)
	wake := regexp.MustCompile(`^[a-z0-9_-]+( (high|normal|low))?$`)

	kvBuilds := "$KV." + v1.BuildsBucket + "." + randomHex(t, 32)
	kvLedger := "$KV." + v1.RequestsBucket + "." + randomHex(t, 20)
	kvVictimSlot := "$KV." + v1.SlotsBucket + "." + victim + "." + slot()
	kvAttackerSlot := "$KV." + v1.SlotsBucket + "." + attacker + "." + slot()
	queueVictim := v1.QueuePrefix + "." + victim + ".high"
	queueAttacker := v1.QueuePrefix + "." + attacker + ".high"
	victimResult := v1.ResultSubject(victim, name)
	hostile := []hostileReply{
		// The buckets: new keys, and existing ones of the victim's.
		{subject: kvBuilds},
		{subject: "$KV." + v1.BuildsBucket + "." + heldKey, legit: func(d []byte) bool {
			var r v1.BuildRecord
			return json.Unmarshal(d, &r) == nil && r.Key == heldKey && r.State != ""
		}},
		{subject: kvLedger},
		{subject: "$KV." + v1.RequestsBucket + "." + doneLedger},
		{subject: "$KV." + v1.RequestsBucket + "." + heldLedger, legit: func(d []byte) bool {
			var r v1.RequestEntry
			return json.Unmarshal(d, &r) == nil && r.RequestID == held.RequestID && r.State != ""
		}},
		{subject: kvVictimSlot},
		{subject: kvAttackerSlot},
		{subject: "$KV." + v1.SlotsBucket + "." + victim + ".0", legit: func(d []byte) bool {
			return bytes.Contains(d, []byte(`"holder"`))
		}},
		// The streams.
		{subject: v1.RequestSubject(victim)},
		{subject: queueVictim},
		{subject: queueAttacker},
		{subject: victimResult},
		{subject: v1.DeadLetterSubject(victim)},
		{subject: v1.DeadLetterSubject(attacker)},
		// The workers' own subjects. buildq.internal.queued carries
		// "<tenant>[ <priority>]" as the attacker's requests are admitted.
		{subject: "buildq.internal.cancel"},
		{subject: "buildq.internal.queued", legit: wake.Match},
		{subject: "buildq.internal." + token},
		// The JetStream API.
		{subject: "$JS.API.STREAM.DELETE." + v1.ResultsStream},
		{subject: "$JS.API.STREAM.PURGE." + v1.ResultsStream},
		{subject: "$JS.API.STREAM.DELETE.KV_" + v1.BuildsBucket},
		{subject: "$JS.API.CONSUMER.DELETE." + v1.RequestsStream + "." + v1.WorkersConsumer},
		// The victim's events, services and inboxes.
		{subject: v1.EventSubject(victim, name)},
		{subject: v1.APIStatusSubject(victim)},
		{subject: v1.CancelSubject(victim, held.Name)},
		{subject: v1.InboxPrefix(victim) + "." + token},
		// The default inbox: the workers' and operators' in BUILDQ, the
		// victim's in its account — and the attacker's own in its
		// account, where the answers arrive.
		{subject: "_INBOX." + token},
	}

	// Observers, subscribed before the attack.
	var (
		mu     sync.Mutex
		landed []string
	)
	land := func(who string, m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		landed = append(landed, fmt.Sprintf("%s received on %s: %s", who, m.Subject, tail(string(m.Data), 300)))
	}
	admin := s.nc
	var subs []*nats.Subscription
	defer func() {
		for _, sub := range slices.Backward(subs) {
			_ = sub.Unsubscribe()
		}
	}()
	for _, h := range hostile {
		sub, err := admin.Subscribe(h.subject, func(m *nats.Msg) {
			if h.legit == nil || !h.legit(m.Data) {
				land("an operator in BUILDQ", m)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		subs = append(subs, sub)
	}
	// Every PubAck and answer to a request that came through a service
	// import is published on its _R_. reply in BUILDQ. The victim's own
	// earlier questions may still be answered meanwhile (a Wait that got
	// its result on its subscription before the status service answered
	// it): a status answer of one of the victim's requests other than
	// held is such an answer, and is not the attack's.
	var (
		answered atomic.Int64
		rmu      sync.Mutex
		replies  []string
	)
	rsub, err := admin.Subscribe("_R_.>", func(m *nats.Msg) {
		var rep v1.StatusReply
		if json.Unmarshal(m.Data, &rep) == nil && rep.Request != nil && rep.Request.Tenant == victim && rep.Request.RequestID != held.RequestID {
			return
		}
		answered.Add(1)
		rmu.Lock()
		replies = append(replies, tail(string(m.Data), 200))
		rmu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rsub.Unsubscribe() }()
	// The victim: its results, events and inboxes, in its own account.
	vspy := e.connect(t, victim)
	for _, subj := range []string{v1.ResultsPrefix + "." + victim + ".>", v1.EventsPrefix + "." + victim + ".>", "_INBOX.>", v1.InboxPrefix(victim) + ".>"} {
		if _, err := vspy.nc.Subscribe(subj, func(m *nats.Msg) {
			if m.Subject != v1.EventSubject(victim, held.Name) { // the held build's own progress
				land(victim, m)
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	// The attacker: a connection of its own (its errors are the attack's),
	// reading the one hostile subject it may read, and its results.
	att := e.connect(t, attacker)
	own, err := att.nc.SubscribeSync("_INBOX." + token)
	if err != nil {
		t.Fatal(err)
	}
	const attackName = "attack"
	results, err := att.nc.SubscribeSync(v1.ResultSubject(attacker, attackName))
	if err != nil {
		t.Fatal(err)
	}
	for _, nc := range []*nats.Conn{admin, vspy.nc, att.nc} {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if errs := append(vspy.errors(), att.errors()...); len(errs) != 0 {
		t.Fatalf("subscriptions refused: %v", errs)
	}

	// What must not change.
	ledger, err := js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	doneEntry, err := ledger.Get(ctx, doneLedger)
	if err != nil {
		t.Fatalf("the ledger entry of %s's finished request: %v", victim, err)
	}
	doneResult, err := lastMsg(ctx, js, v1.ResultsStream, v1.ResultSubject(victim, done.Name))
	if err != nil {
		t.Fatalf("%s's finished result: %v", victim, err)
	}
	deadLetters := streamMsgs(ctx, t, js, v1.DeadLetterStream)

	// The attack: four sends per hostile subject, every one allowed.
	attackMsg := func(id string) *nats.Msg {
		m := nats.NewMsg(v1.RequestSubject(attacker))
		m.Header.Set(v1.MsgIDHeader, v1.RequestMsgID(attacker, id, nuid.Next()))
		// No source: the worker answers it InvalidRequest, quickly and
		// on the attacker's own result subject.
		m.Data = []byte(fmt.Sprintf(`{"apiVersion":%q,"requestId":%q,"tenant":%q,"name":%q}`, v1.APIVersion, id, attacker, attackName))
		return m
	}
	var ids []string
	for _, h := range hostile {
		id := publisher.NewRequestID()
		ids = append(ids, id)
		m := attackMsg(id)
		m.Reply = h.subject
		if err := att.nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
		for _, r := range []struct{ subject, payload string }{
			{v1.APIStatusSubject(attacker), held.RequestID},
			{v1.APICancelSubject(attacker), held.RequestID},
			{v1.CancelSubject(attacker, held.Name), heldKey},
		} {
			if err := att.nc.PublishRequest(r.subject, h.subject, []byte(r.payload)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := att.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	sends := int64(4 * len(hostile))
	eventually(t, time.Minute, fmt.Sprintf("the server and the worker to answer the %d sends", sends), func() bool {
		return answered.Load() >= sends
	})

	// Each answer went back into the attacker's account under the subject
	// it named: the one it may read got all four.
	kinds := map[string]int{}
	for range 4 {
		m, err := own.NextMsg(10 * time.Second)
		if err != nil {
			t.Fatalf("the answers on %s, the attacker's own default inbox: %v (got %v)", "_INBOX."+token, err, kinds)
		}
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(m.Data, &fields); err != nil {
			t.Fatalf("answer %s: %v", m.Data, err)
		}
		switch {
		case fields["stream"] != nil:
			var pa jetstream.PubAck
			if json.Unmarshal(m.Data, &pa) != nil || pa.Stream != v1.RequestsStream {
				t.Fatalf("PubAck %s", m.Data)
			}
			kinds["puback"]++
		case fields["canceled"] != nil:
			var rep v1.CancelReply
			if json.Unmarshal(m.Data, &rep) != nil || rep.Canceled || rep.Stopped || rep.Requests != 0 {
				t.Fatalf("cancel answer %s", m.Data)
			}
			kinds["cancel"]++
		default:
			var rep v1.StatusReply
			if json.Unmarshal(m.Data, &rep) != nil || rep.Error == "" || rep.Request != nil || rep.Build != nil {
				t.Fatalf("status answer %s", m.Data)
			}
			kinds["status"]++
		}
	}
	if kinds["puback"] != 1 || kinds["status"] != 1 || kinds["cancel"] != 2 {
		t.Fatalf("answers on the attacker's inbox: %v, want a PubAck, a status answer, two cancel answers", kinds)
	}

	// Its legitimate requests are answered as ever: a PubAck and the
	// status of its own request, on its own inboxes.
	ajs, err := jetstream.New(att.nc)
	if err != nil {
		t.Fatal(err)
	}
	ownID := publisher.NewRequestID()
	pa, err := ajs.PublishMsg(ctx, attackMsg(ownID))
	if err != nil || pa.Stream != v1.RequestsStream {
		t.Fatalf("the attacker's own JetStream publish: %v %+v", err, pa)
	}
	ids = append(ids, ownID)
	// The worker answers every request the attack stored, on the
	// attacker's own result subject.
	answers := map[string]bool{}
	for len(answers) < len(ids) {
		m, err := results.NextMsg(time.Minute)
		if err != nil {
			t.Fatalf("results of the attacker's %d requests: %d came: %v", len(ids), len(answers), err)
		}
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil || r.Data.Tenant != attacker || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest {
			t.Fatalf("result %v %s", err, m.Data)
		}
		answers[r.Data.RequestID] = true
	}
	for _, id := range ids {
		if !answers[id] {
			t.Fatalf("no result for the attacker's request %s", id)
		}
	}
	var rep v1.StatusReply
	request(t, att, v1.APIStatusSubject(attacker), ownID, &rep) // default inbox
	if rep.Request == nil || rep.Request.RequestID != ownID || rep.Request.State != string(v1.StatusFailed) {
		t.Fatalf("the attacker's status of its own request: %+v", rep)
	}
	apub, err := publisher.New(att.nc)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := apub.Wait(ctx, attacker, attackName, ownID, time.Time{}); err != nil || r.Data.RequestID != ownID { // _INBOX_<attacker>
		t.Fatalf("the attacker's wait for its own result: %v %+v", err, r)
	}

	// Everything is delivered: every connection's earlier messages come
	// before the answer to its flush.
	for _, nc := range []*nats.Conn{admin, vspy.nc, att.nc} {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	if len(landed) > 0 {
		t.Errorf("the attack's replies landed:\n%s", strings.Join(landed, "\n"))
	}
	mu.Unlock()
	if errs := att.errors(); len(errs) != 0 {
		t.Errorf("the server refused some of the attack (it must let all of it through; nothing may land): %v", errs)
	}

	// The keys named: absent, or unchanged.
	for _, subj := range []string{kvBuilds, kvLedger, kvVictimSlot, kvAttackerSlot} {
		bucket := strings.SplitN(subj, ".", 3)[1]
		if m, err := lastMsg(ctx, js, "KV_"+bucket, subj); !errors.Is(err, jetstream.ErrMsgNotFound) {
			t.Errorf("%s: %v %v, want no message", subj, err, m)
		}
	}
	if got, err := ledger.Get(ctx, doneLedger); err != nil {
		t.Errorf("the ledger entry of %s's finished request: %v", victim, err)
	} else if got.Revision() != doneEntry.Revision() || !bytes.Equal(got.Value(), doneEntry.Value()) {
		t.Errorf("the ledger entry of %s's finished request: revision %d, had %d: %s", victim, got.Revision(), doneEntry.Revision(), got.Value())
	}
	if got, err := ledger.Get(ctx, heldLedger); err != nil {
		t.Errorf("the ledger entry of %s's held request: %v", victim, err)
	} else {
		var le v1.RequestEntry
		if err := json.Unmarshal(got.Value(), &le); err != nil || le.RequestID != held.RequestID || le.Canceled || le.Result != nil {
			t.Errorf("the ledger entry of %s's held request: %v %s", victim, err, got.Value())
		}
	}
	// The streams: still there, and nothing of the attack's in them.
	for _, c := range []struct{ stream, subject string }{
		{v1.QueueStream, queueVictim},
		{v1.QueueStream, queueAttacker},
		{v1.ResultsStream, victimResult},
	} {
		if m, err := lastMsg(ctx, js, c.stream, c.subject); !errors.Is(err, jetstream.ErrMsgNotFound) {
			t.Errorf("%s in %s: %v %v, want no message", c.subject, c.stream, err, m)
		}
	}
	if m, err := lastMsg(ctx, js, v1.ResultsStream, v1.ResultSubject(victim, done.Name)); err != nil || m.Sequence != doneResult.Sequence {
		t.Errorf("%s's finished result after the attack: %v %v, was at sequence %d", victim, err, m, doneResult.Sequence)
	}
	if n := streamMsgs(ctx, t, js, v1.DeadLetterStream); n != deadLetters {
		t.Errorf("%s holds %d messages, had %d", v1.DeadLetterStream, n, deadLetters)
	}
	if _, err := js.Stream(ctx, "KV_"+v1.BuildsBucket); err != nil {
		t.Errorf("the bucket %s: %v", v1.BuildsBucket, err)
	}
	if _, err := js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer); err != nil {
		t.Errorf("the consumer %s: %v", v1.WorkersConsumer, err)
	}
	// The worker answered each send once (the attacker's own requests
	// since then: the PubAck, the status request, and Wait's status
	// request).
	if got, want := answered.Load(), sends+3; got != want {
		rmu.Lock()
		t.Errorf("%d answers on _R_. replies, want %d:\n%s", got, want, strings.Join(replies, "\n"))
		rmu.Unlock()
	}
}

func randomHex(t *testing.T, n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// lastMsg is the last message on subject in stream.
func lastMsg(ctx context.Context, js jetstream.JetStream, stream, subject string) (*jetstream.RawStreamMsg, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	return st.GetLastMsgForSubject(ctx, subject)
}

func streamMsgs(ctx context.Context, t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	return info.State.Msgs
}
