package fairq

// Fair queueing (docs/design.md §2d). Requests arrive on BUILDQ_REQUESTS,
// the contract's work queue, and are admitted from it by intake: a cheap
// step that applies the tenant's queue-length limit and moves each request
// to BUILDQ_QUEUE under buildq.queue.<tenant>.<priority>. Build slots are
// filled from there by each worker's dispatcher, which picks the tenant
// with the fewest running requests per weight among those with work and
// below their concurrency limit, and within the tenant the highest
// priority first.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// ---- the queued message ----

// queuedMsg is a message of BUILDQ_QUEUE seen as the request message it
// was admitted from: its subject, headers, stream sequence and time are
// the original's, so the request's identity and queue wait are unchanged.
// Settling it (ack or term) deletes it from the queue.
type queuedMsg struct {
	jetstream.Msg
	subject string
	hdr     nats.Header
	meta    *jetstream.MsgMetadata
	qseq    uint64
	queue   jetstream.Stream
}

// asRequest restores the request message behind a queued message.
func asRequest(m jetstream.Msg, queue jetstream.Stream) (*queuedMsg, error) {
	qm, err := m.Metadata()
	if err != nil {
		return nil, err
	}
	h := m.Headers()
	seq, err := strconv.ParseUint(h.Get(HdrIntakeSeq), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("queued message %d has no intake sequence", qm.Sequence.Stream)
	}
	at, err := time.Parse(time.RFC3339Nano, h.Get(HdrIntakeTime))
	if err != nil {
		return nil, fmt.Errorf("queued message %d has no intake time", qm.Sequence.Stream)
	}
	subj := h.Get(HdrIntakeSubject)
	if subj == "" {
		return nil, fmt.Errorf("queued message %d has no intake subject", qm.Sequence.Stream)
	}
	hdr := nats.Header{}
	for k, vs := range h {
		if !strings.HasPrefix(k, "Buildq-Intake-") && k != v1.MsgIDHeader {
			hdr[k] = vs
		}
	}
	if id := h.Get(HdrIntakeMsgID); id != "" {
		hdr.Set(v1.MsgIDHeader, id)
	}
	meta := *qm
	if before, err := strconv.ParseUint(h.Get(HdrIntakeDelivered), 10, 64); err == nil && before < 1<<16 {
		meta.NumDelivered += before
	}
	meta.Sequence.Stream = seq
	meta.Timestamp = at
	meta.Stream = v1.RequestsStream
	return &queuedMsg{Msg: m, subject: subj, hdr: hdr, meta: &meta, qseq: qm.Sequence.Stream, queue: queue}, nil
}

func (q *queuedMsg) Subject() string                           { return q.subject }
func (q *queuedMsg) Headers() nats.Header                      { return q.hdr }
func (q *queuedMsg) Metadata() (*jetstream.MsgMetadata, error) { m := *q.meta; return &m, nil }

// remove deletes the message from the queue; a message already gone is
// fine. Until it is deleted, it counts as queued and would be handled
// again (publishing the same, recorded result).
func (q *queuedMsg) remove(ctx context.Context) error {
	err := q.queue.DeleteMsg(ctx, q.qseq)
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) && !isMsgDeleted(err) {
		return err
	}
	return nil
}

func isMsgDeleted(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeMessageNotFound
}

func (q *queuedMsg) Ack() error { return q.DoubleAck(context.Background()) }

func (q *queuedMsg) DoubleAck(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := q.remove(ctx); err != nil {
		return err // not acked: redelivered after AckWait and settled again
	}
	_ = q.Msg.Ack()
	return nil
}

func (q *queuedMsg) Term() error { return q.TermWithReason("") }

func (q *queuedMsg) TermWithReason(reason string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := q.remove(ctx); err != nil {
		return err
	}
	if reason == "" {
		return q.Msg.Term()
	}
	_ = q.Msg.TermWithReason(reason)
	return nil
}
