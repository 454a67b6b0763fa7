package kube

import (
	"context"
	"errors"
	"io"
	"math"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// LogPosition is where a follower resumes: the last line already stored.
//
// A caller derives it from the events it stored: after a NewAttempt event
// it is {Pod: e.Pod}; after a line event it is {e.Pod, e.Container, e.Time,
// n}, n being how many events of that container, the last included, carry
// exactly e.Time (every piece of a split line counts as one).
type LogPosition struct {
	Pod       string    // pod name; "" = start at the Job's first pod
	Container string    // container of Pod; "" = start at Pod's first container
	Time      time.Time // kubelet timestamp of the last stored line of Container (zero: none yet)
	Count     int       // how many stored lines of Container carry exactly Time
}

// PodLogEvent is what the follower reports, in log order.
type PodLogEvent struct {
	Pod       string
	Container string
	Attempt   int // 1-based index of Pod among the Job's pods in creation order (ties by name)
	// NewAttempt: the follower moved on to a pod after the first (the Job retried):
	// no Time/Text; Reason says why the previous pod ended (e.g. "pod buildq-x-abc failed: kaniko exited 1" — best effort from its status).
	NewAttempt bool
	Reason     string
	Time       time.Time // the kubelet's timestamp of the line
	// Text is the line's bytes exactly as printed, without the timestamp
	// prefix and without the trailing newline. Each event has its own
	// slice: the receiver may keep it.
	Text []byte
}

// LogSource opens one container's log; the default uses client.CoreV1().Pods(ns).GetLogs(pod, opts).Stream(ctx).
type LogSource func(ctx context.Context, pod string, opts *corev1.PodLogOptions) (io.ReadCloser, error)

// LogFollower follows the logs of every Pod of one Job (see Follow).
type LogFollower struct {
	Namespace string
	Job       string
	Logs      LogSource
	// Pods returns the Job's pods as the informer cache has them (any order; may lag).
	Pods func() []*corev1.Pod
	// Changed fires when the Job or its Pods change (may be nil: poll every second).
	Changed <-chan struct{}
	// Finished reports whether the Job has finished (no new Pod will come).
	// Nil: never (Follow then ends only with ctx or emit).
	Finished func() bool

	// poll is how long a wait lasts without a Changed signal (default
	// one second); finishGrace how long Follow still waits for a Pod the
	// cache may not show yet once the Job has finished (default one
	// second). Tests shorten them.
	poll        time.Duration
	finishGrace time.Duration
}

const (
	// maxLogPiece bounds the Text of one event: a longer line is split.
	maxLogPiece = 1 << 20
	// logReadBuffer is the bufio.Reader's size; lines may be longer.
	logReadBuffer = 64 << 10
	// maxEndedOpenFailures is how many times in a row opening (or reading)
	// the log of a container that has ended may fail before the follower
	// gives up on what is left of it: its logs may be gone for good (the
	// node is lost, the container removed), and the Job must still end.
	maxEndedOpenFailures = 4
	// endedRetry is the wait between those tries: an ended container's
	// log is there at once or not at all, and the build's outcome waits.
	endedRetry = 250 * time.Millisecond

	defaultLogPoll     = time.Second
	defaultFinishGrace = time.Second
)

// NewLogSource returns the LogSource reading pods/log in namespace through client.
func NewLogSource(client kubernetes.Interface, namespace string) LogSource {
	return func(ctx context.Context, pod string, opts *corev1.PodLogOptions) (io.ReadCloser, error) {
		return client.CoreV1().Pods(namespace).GetLogs(pod, opts).Stream(ctx)
	}
}

// Follow reports every line of every container of every pod of the Job
// after from, in order: pods by creation, and in each pod its init
// containers then its containers, each container's lines in order. It
// follows live (PodLogOptions{Follow: true, Timestamps: true, Container: c}),
// and returns nil once Finished() holds and every container of the last pod
// has ended and been read to its end; ctx.Err() when ctx ends first; the
// error of emit when emit returns one (the caller then resumes later with
// a new position).
//
// Order of pods. Pods are taken by creation time; pods created within the
// same second (the API's precision) are ordered ended before running, then
// by when their containers finished, then by name. The follower never goes
// back: a pod the cache shows only after the follower moved past its place
// is followed next. Attempt counts the pods the follower has passed (or
// skipped as before from) plus one, so a pod deleted before Follow started
// does not count.
//
// Resume. The pods before from.Pod and the containers of from.Pod before
// from.Container are not reopened; from.Container is opened with SinceTime
// from.Time truncated to the second, and of what it returns the lines before
// from.Time, and the first from.Count lines at exactly from.Time, are
// skipped. When from.Pod is no longer among the pods (deleted since), its
// place is inferred from from.Time: the pods created before that second, or
// whose containers all finished before it, are earlier and skipped; a pod
// created in that very second is followed but only its lines after from.Time
// are reported (and its NewAttempt only before the first of them), pods
// created later are followed whole. With from.Time zero there is nothing to
// infer from: the pods that have ended by the time Follow starts are taken
// as earlier and skipped (dropping a later attempt that also ended is
// preferred to repeating an earlier one), the others are followed. Either
// way the lost pod counts as an attempt. A from.Container the pod does not
// have skips from.Pod (never re-emit). With from.Pod "", the rest of from is
// ignored.
//
// Within a container nothing is lost or repeated: a stream that ends while
// the cache still shows the container running, or breaks, is reopened from
// the last line reported, as for from. A partial last line is reported only
// from a stream opened after the container ended (until then it may be a
// break mid-line). The follower moves on from a container once the cache
// shows it terminated (or its pod ended or gone) and a stream opened after
// that has been read to its end; a container that never started in a pod
// that ended is skipped; a 404 from pods/log (the pod is gone) ends the pod.
// If the logs of a container that has ended cannot be read
// maxEndedOpenFailures times in a row, the rest of them is given up.
//
// End. Once Finished() holds and no pod is left to follow, Follow still
// waits a moment (a second) for a Pod the cache may not show yet, unless
// the last pod it followed succeeded.
func (f *LogFollower) Follow(ctx context.Context, from LogPosition, emit func(PodLogEvent) error) error {
	if f.Logs == nil || f.Pods == nil || emit == nil {
		return errors.New("kube: LogFollower needs Logs, Pods and an emit function")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	r := &followRun{
		f:       f,
		emit:    emit,
		changed: f.Changed,
		poll:    f.poll,
		passed:  map[string]bool{},
	}
	if r.poll <= 0 {
		r.poll = defaultLogPoll
	}
	grace := f.finishGrace
	if grace <= 0 {
		grace = defaultFinishGrace
	}
	if from.Count < 0 || from.Time.IsZero() {
		from.Count = 0
	}

	resume := r.resume(from, f.Pods())
	var graceUntil time.Time
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		var pl podPlan
		if resume != nil {
			pl, resume = *resume, nil
		} else {
			finished := f.Finished != nil && f.Finished()
			p := r.next(f.Pods())
			if p == nil {
				if !finished {
					if err := r.wait(ctx, r.poll); err != nil {
						return err
					}
					continue
				}
				// The Job is done, but a Pod the Job controller made may
				// still be on its way to the cache: wait a moment for it,
				// unless the last pod succeeded (nothing comes after).
				if r.lastSucceeded {
					return nil
				}
				now := time.Now()
				if graceUntil.IsZero() {
					graceUntil = now.Add(grace)
				}
				if !now.Before(graceUntil) {
					return nil
				}
				if err := r.wait(ctx, min(r.poll, graceUntil.Sub(now))); err != nil {
					return err
				}
				continue
			}
			graceUntil = time.Time{}
			pl = r.plan(p)
		}
		if err := r.followPod(ctx, pl); err != nil {
			return err
		}
		r.passed[pl.pod] = true
		r.prev = pl.pod
		r.lastSucceeded = false
		if p := r.lookup(pl.pod); p != nil && p.Status.Phase == corev1.PodSucceeded && !r.prevGone {
			r.lastSucceeded = true
		}
	}
}

// followRun is the state of one Follow call.
type followRun struct {
	f       *LogFollower
	emit    func(PodLogEvent) error
	changed <-chan struct{}
	poll    time.Duration

	// passed holds the pods the follower is done with, or took as before
	// from: they are never opened again.
	passed map[string]bool
	// prev is the pod followed last (or from.Pod); prevGone: it went away
	// (404) before it was read to its end.
	prev          string
	prevGone      bool
	lastSucceeded bool
	// goneAt is from.Time when from.Pod was gone at the start: it places
	// the pods relative to the lost one (see Follow).
	goneAt time.Time
}

// podPlan is how to follow one pod.
type podPlan struct {
	pod     string
	attempt int
	// newAttempt: report a NewAttempt event (reason) first; lazily, only
	// before its first line, when lazy.
	newAttempt bool
	lazy       bool
	reason     string
	// container and pos: where to resume within the pod ("": its start).
	container string
	pos       logPos
	// floor, when set, hides the lines at or before it (a pod that may
	// precede a lost from.Pod).
	floor time.Time
}

// logPos is the last line reported of a container: its time and how many
// lines (pieces) reported carry exactly that time.
type logPos struct {
	Time  time.Time
	Count int
}

func (p *logPos) advance(ts time.Time) {
	if !p.Time.IsZero() && ts.Equal(p.Time) {
		p.Count++
		return
	}
	p.Time, p.Count = ts, 1
}

// resume places from among pods; it returns the plan for from.Pod when the
// cache has it.
func (r *followRun) resume(from LogPosition, pods []*corev1.Pod) *podPlan {
	if from.Pod == "" {
		return nil
	}
	r.prev = from.Pod
	var fp *corev1.Pod
	for _, p := range pods {
		if p.Name == from.Pod {
			fp = p
		}
	}
	if fp != nil {
		for _, p := range pods {
			if p.Name != fp.Name && podLess(p, fp) {
				r.passed[p.Name] = true
			}
		}
		return &podPlan{
			pod:       fp.Name,
			attempt:   len(r.passed) + 1,
			container: from.Container,
			pos:       logPos{Time: from.Time, Count: from.Count},
		}
	}
	r.passed[from.Pod] = true
	r.prevGone = true
	if !from.Time.IsZero() {
		r.goneAt = from.Time
		return nil
	}
	for _, p := range pods {
		if podEnded(p) {
			r.passed[p.Name] = true
		}
	}
	return nil
}

// next is the first pod not passed yet, or nil.
func (r *followRun) next(pods []*corev1.Pod) *corev1.Pod {
	var best *corev1.Pod
	for _, p := range pods {
		if r.passed[p.Name] {
			continue
		}
		if r.beforeGone(p) {
			r.passed[p.Name] = true // an attempt, and done with
			continue
		}
		if best == nil || podLess(p, best) {
			best = p
		}
	}
	return best
}

// beforeGone reports whether p is known to precede the lost from.Pod: it
// was created before the second of from.Time, or all its containers
// finished before it (a later pod starts after from.Pod's last line).
func (r *followRun) beforeGone(p *corev1.Pod) bool {
	if r.goneAt.IsZero() {
		return false
	}
	sec := r.goneAt.Truncate(time.Second)
	if p.CreationTimestamp.Time.Before(sec) {
		return true
	}
	if !podEnded(p) {
		return false
	}
	var last time.Time
	for _, st := range allStatuses(p) {
		t := st.State.Terminated
		if t == nil {
			return false
		}
		if t.FinishedAt.Time.After(last) {
			last = t.FinishedAt.Time
		}
	}
	return !last.IsZero() && last.Before(sec)
}

func (r *followRun) plan(p *corev1.Pod) podPlan {
	pl := podPlan{pod: p.Name, attempt: len(r.passed) + 1}
	if r.prev != "" {
		pl.newAttempt = true
		pl.reason = endReason(r.prev, r.lookup(r.prev), r.prevGone)
	}
	if !r.goneAt.IsZero() && !p.CreationTimestamp.Time.After(r.goneAt.Truncate(time.Second)) {
		// Created in the second of the lost pod's last line: before or
		// after it, its lines tell.
		pl.floor = r.goneAt
		pl.lazy = true
	}
	r.prevGone = false
	return pl
}

func (r *followRun) lookup(name string) *corev1.Pod {
	for _, p := range r.f.Pods() {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// wait returns after a Changed signal, d, or ctx's end (its error).
func (r *followRun) wait(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case _, ok := <-r.changed:
		if !ok {
			r.changed = nil // closed: poll from now on
		}
	case <-t.C:
	}
	return nil
}

func (r *followRun) followPod(ctx context.Context, pl podPlan) error {
	announced := !pl.newAttempt
	announce := func() error {
		if announced {
			return nil
		}
		announced = true
		return r.emit(PodLogEvent{Pod: pl.pod, Attempt: pl.attempt, NewAttempt: true, Reason: pl.reason})
	}
	if !pl.lazy {
		if err := announce(); err != nil {
			return err
		}
	}
	p := r.lookup(pl.pod)
	if p == nil {
		r.prevGone = true
		return nil
	}
	names := containerNames(p)
	start := 0
	if pl.container != "" {
		start = slices.Index(names, pl.container)
		if start < 0 {
			return nil // not a container of the pod: skip it rather than repeat it
		}
	}
	for i := start; i < len(names); i++ {
		var pos logPos
		switch {
		case !pl.floor.IsZero():
			// Skip every line up to the floor (a count never reached).
			pos = logPos{Time: pl.floor, Count: math.MaxInt}
		case i == start && pl.container != "":
			pos = pl.pos
		}
		gone, err := r.followContainer(ctx, pl, names[i], &pos, announce)
		if err != nil {
			return err
		}
		if gone {
			r.prevGone = true
			return nil
		}
	}
	return nil
}

// followContainer reports container's lines after pos until it has ended
// and been read to its end. gone: the pod is gone (the rest of it cannot
// be read).
func (r *followRun) followContainer(ctx context.Context, pl podPlan, container string, pos *logPos, announce func() error) (gone bool, err error) {
	failures := 0
	needWait := false
	for {
		if needWait {
			d := r.poll
			if failures > 0 {
				d = min(d, endedRetry)
			}
			if err := r.wait(ctx, d); err != nil {
				return false, err
			}
		}
		if err := ctx.Err(); err != nil {
			return false, err
		}
		p := r.lookup(pl.pod)
		if p == nil {
			return true, nil
		}
		st := containerStatus(p, container)
		ended := podEnded(p)
		if !started(st) {
			if ended {
				return false, nil // it never ran
			}
			needWait = true
			continue
		}
		// A stream opened once the container is known to have ended holds
		// all of its log: its end is the end.
		final := ended || (st != nil && st.State.Terminated != nil)
		opts := &corev1.PodLogOptions{Container: container, Follow: true, Timestamps: true}
		if !pos.Time.IsZero() {
			since := metav1.NewTime(pos.Time.Truncate(time.Second))
			opts.SinceTime = &since
		}
		rc, err := r.f.Logs(ctx, pl.pod, opts)
		if err != nil {
			if ctx.Err() != nil {
				return false, ctx.Err()
			}
			if apierrors.IsNotFound(err) {
				return true, nil
			}
			// 400 "is waiting to start" (the cache is ahead of the
			// kubelet), or the API server is unavailable: retry.
			if final {
				if failures++; failures >= maxEndedOpenFailures {
					return false, nil
				}
			}
			needWait = true
			continue
		}
		progress, readErr, emitErr := r.read(ctx, rc, final, pl, container, pos, announce)
		if emitErr != nil {
			return false, emitErr
		}
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if final && errors.Is(readErr, io.EOF) {
			return false, nil
		}
		if progress {
			failures = 0
		} else if final {
			if failures++; failures >= maxEndedOpenFailures {
				return false, nil
			}
		}
		// The stream ended early (or the container ended while it was
		// read): reopen at once after progress, else after a wait.
		needWait = !progress
	}
}

// read reports the lines of one stream after pos, advancing pos. progress:
// at least one line was reported.
func (r *followRun) read(ctx context.Context, rc io.ReadCloser, final bool, pl podPlan, container string, pos *logPos, announce func() error) (progress bool, readErr, emitErr error) {
	var once sync.Once
	closeRC := func() { once.Do(func() { _ = rc.Close() }) }
	stop := context.AfterFunc(ctx, closeRC) // unblocks a Read when ctx ends
	defer func() {
		stop()
		closeRC()
	}()

	skipping := !pos.Time.IsZero()
	skipAt, skipLeft := pos.Time, pos.Count
	handle := func(ts time.Time, text []byte) error {
		if skipping {
			if ts.Before(skipAt) {
				return nil
			}
			if ts.Equal(skipAt) && skipLeft > 0 {
				skipLeft--
				return nil
			}
			skipping = false
		}
		if err := announce(); err != nil {
			return err
		}
		if err := r.emit(PodLogEvent{Pod: pl.pod, Container: container, Attempt: pl.attempt, Time: ts, Text: text}); err != nil {
			return err
		}
		progress = true
		pos.advance(ts)
		return nil
	}
	readErr, emitErr = splitLines(rc, final, pos.Time, handle)
	return progress, readErr, emitErr
}
