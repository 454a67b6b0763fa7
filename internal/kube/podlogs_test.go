package kube

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
)

// base is a whole second: the tests place lines within and across seconds.
var base = time.Date(2025, 3, 4, 5, 6, 7, 0, time.UTC)

func at(d time.Duration) time.Time { return base.Add(d) }

// fakeKube is the informer cache and the pods/log API of one Job: pods
// with scripted container statuses, and per container a log the test
// appends to, served as the kubelet does (Follow, Timestamps, SinceTime).
type fakeKube struct {
	t        *testing.T
	mu       sync.Mutex
	pods     map[string]*corev1.Pod
	logs     map[string]*fakeLog // by pod/container
	openErrs map[string][]error  // next opens of pod/container fail so
	opens    []fakeOpen
	streams  int           // open right now
	notify   chan struct{} // closed (and replaced) on every change
	changed  chan struct{}
	finished bool
}

type fakeLog struct {
	entries []fakeEntry
	done    bool      // the container has exited: a stream ends after the last entry
	cuts    []fakeCut // the next opens break so
}

type fakeEntry struct {
	ts  time.Time
	raw []byte
}

// fakeCut breaks a stream after `after` bytes, with err (nil: a clean EOF).
type fakeCut struct {
	after int
	err   error
}

type fakeOpen struct {
	pod, container string
	since          time.Time
}

func newFakeKube(t *testing.T) *fakeKube {
	return &fakeKube{
		t:        t,
		pods:     map[string]*corev1.Pod{},
		logs:     map[string]*fakeLog{},
		openErrs: map[string][]error{},
		notify:   make(chan struct{}),
		changed:  make(chan struct{}, 1),
	}
}

// follower returns a LogFollower on k with short waits.
func (k *fakeKube) follower(withChanged bool) *LogFollower {
	f := &LogFollower{
		Namespace:   "b",
		Job:         "buildq-x",
		Logs:        k.open,
		Pods:        k.list,
		Finished:    k.isFinished,
		poll:        5 * time.Millisecond,
		finishGrace: 30 * time.Millisecond,
	}
	if withChanged {
		f.Changed = k.changed
	}
	return f
}

// change wakes blocked streams and signals Changed; call with k.mu held.
func (k *fakeKube) change() {
	close(k.notify)
	k.notify = make(chan struct{})
	select {
	case k.changed <- struct{}{}:
	default:
	}
}

func (k *fakeKube) list() []*corev1.Pod {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []*corev1.Pod
	for _, p := range k.pods {
		out = append(out, p.DeepCopy())
	}
	return out
}

func (k *fakeKube) isFinished() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.finished
}

func (k *fakeKube) finish() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.finished = true
	k.change()
}

// addPod adds a Pending pod whose containers are all waiting.
func (k *fakeKube) addPod(name string, created time.Time, initContainers, containers []string) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "b", CreationTimestamp: metav1.NewTime(created)}}
	p.Status.Phase = corev1.PodPending
	for _, c := range initContainers {
		p.Spec.InitContainers = append(p.Spec.InitContainers, corev1.Container{Name: c})
		p.Status.InitContainerStatuses = append(p.Status.InitContainerStatuses, corev1.ContainerStatus{Name: c,
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "PodInitializing"}}})
	}
	for _, c := range containers {
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: c})
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{Name: c,
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "PodInitializing"}}})
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.pods[name] = p
	k.change()
}

func (k *fakeKube) setPhase(pod string, phase corev1.PodPhase) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.pods[pod].Status.Phase = phase
	k.change()
}

func (k *fakeKube) status(pod, container string) *corev1.ContainerStatus {
	p := k.pods[pod]
	if p == nil {
		k.t.Fatalf("no pod %s", pod)
	}
	st := containerStatus(p, container)
	if st == nil {
		k.t.Fatalf("no container %s in %s", container, pod)
	}
	return st
}

func (k *fakeKube) run(pod, container string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.status(pod, container).State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(base)}}
	if k.pods[pod].Status.Phase == corev1.PodPending && !slices.ContainsFunc(k.pods[pod].Spec.InitContainers, func(c corev1.Container) bool { return c.Name == container }) {
		k.pods[pod].Status.Phase = corev1.PodRunning
	}
	k.change()
}

// exit ends the container's log (streams reach EOF) and, when cache, also
// shows it terminated in the pod's status.
func (k *fakeKube) exit(pod, container string, code int32, cache bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.log(pod, container).done = true
	if cache {
		k.terminated(pod, container, code)
	}
	k.change()
}

func (k *fakeKube) cacheTerminated(pod, container string, code int32) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.terminated(pod, container, code)
	k.change()
}

// terminated shows the container terminated in the cache, finished in the
// second of its last line; call with k.mu held.
func (k *fakeKube) terminated(pod, container string, code int32) {
	finished := base
	if e := k.log(pod, container).entries; len(e) > 0 {
		finished = e[len(e)-1].ts.Truncate(time.Second)
	}
	k.status(pod, container).State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
		ExitCode: code, FinishedAt: metav1.NewTime(finished)}}
}

// log returns pod/container's log; call with k.mu held.
func (k *fakeKube) log(pod, container string) *fakeLog {
	key := pod + "/" + container
	if k.logs[key] == nil {
		k.logs[key] = &fakeLog{}
	}
	return k.logs[key]
}

// line appends a line as the kubelet prints it; raw without "\n" when
// !newline.
func (k *fakeKube) line(pod, container string, ts time.Time, text string) {
	k.rawLine(pod, container, ts, text, true)
}

func (k *fakeKube) rawLine(pod, container string, ts time.Time, text string, newline bool) {
	raw := []byte(ts.UTC().Format("2006-01-02T15:04:05.000000000Z07:00") + " " + text)
	if newline {
		raw = append(raw, '\n')
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	l := k.log(pod, container)
	l.entries = append(l.entries, fakeEntry{ts: ts, raw: raw})
	k.change()
}

func (k *fakeKube) cut(pod, container string, cuts ...fakeCut) {
	k.mu.Lock()
	defer k.mu.Unlock()
	l := k.log(pod, container)
	l.cuts = append(l.cuts, cuts...)
}

func (k *fakeKube) failOpen(pod, container string, errs ...error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.openErrs[pod+"/"+container] = append(k.openErrs[pod+"/"+container], errs...)
}

func (k *fakeKube) openStreams() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.streams
}

func (k *fakeKube) opened() []fakeOpen {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.opens)
}

func (k *fakeKube) open(ctx context.Context, pod string, opts *corev1.PodLogOptions) (io.ReadCloser, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !opts.Follow || !opts.Timestamps || opts.Container == "" {
		k.t.Errorf("pods/log of %s opened with %+v", pod, opts)
	}
	key := pod + "/" + opts.Container
	o := fakeOpen{pod: pod, container: opts.Container}
	if opts.SinceTime != nil {
		o.since = opts.SinceTime.Time
	}
	k.opens = append(k.opens, o)
	if errs := k.openErrs[key]; len(errs) > 0 {
		k.openErrs[key] = errs[1:]
		return nil, errs[0]
	}
	p := k.pods[pod]
	if p == nil {
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, pod)
	}
	if !started(containerStatus(p, opts.Container)) {
		return nil, apierrors.NewBadRequest(fmt.Sprintf("container %q in pod %q is waiting to start: PodInitializing", opts.Container, pod))
	}
	s := &fakeStream{k: k, l: k.log(pod, opts.Container), since: o.since, ctx: ctx, closed: make(chan struct{})}
	if len(s.l.cuts) > 0 {
		s.cut, s.l.cuts = &s.l.cuts[0], s.l.cuts[1:]
	}
	k.streams++
	return s, nil
}

type fakeStream struct {
	k       *fakeKube
	l       *fakeLog
	since   time.Time
	ctx     context.Context
	cut     *fakeCut
	idx     int
	pending []byte
	sent    int
	closed  chan struct{}
	isClose bool
}

func (s *fakeStream) Read(p []byte) (int, error) {
	for {
		s.k.mu.Lock()
		if s.isClose {
			s.k.mu.Unlock()
			return 0, errors.New("read on closed stream")
		}
		if len(s.pending) == 0 && s.idx < len(s.l.entries) {
			e := s.l.entries[s.idx]
			s.idx++
			if e.ts.Before(s.since) { // the kubelet's SinceTime
				s.k.mu.Unlock()
				continue
			}
			s.pending = e.raw
		}
		if s.cut != nil && s.sent >= s.cut.after && (len(s.pending) > 0 || !s.l.done) {
			err := s.cut.err
			if err == nil {
				err = io.EOF
			}
			s.k.mu.Unlock()
			return 0, err
		}
		if len(s.pending) > 0 {
			n := min(len(p), len(s.pending))
			if s.cut != nil {
				n = min(n, s.cut.after-s.sent)
			}
			copy(p, s.pending[:n])
			s.pending = s.pending[n:]
			s.sent += n
			s.k.mu.Unlock()
			return n, nil
		}
		if s.l.done {
			s.k.mu.Unlock()
			return 0, io.EOF
		}
		ch := s.k.notify
		s.k.mu.Unlock()
		select {
		case <-ch:
		case <-s.closed:
		case <-s.ctx.Done():
			return 0, s.ctx.Err()
		}
	}
}

func (s *fakeStream) Close() error {
	s.k.mu.Lock()
	defer s.k.mu.Unlock()
	if s.isClose {
		s.k.t.Errorf("stream closed twice")
		return nil
	}
	s.isClose = true
	s.k.streams--
	close(s.closed)
	return nil
}

// collector records emitted events; failAt (1-based) makes that call fail.
type collector struct {
	mu      sync.Mutex
	events  []PodLogEvent
	failAt  int
	failErr error
	grew    chan struct{}
}

func newCollector() *collector { return &collector{grew: make(chan struct{}, 1)} }

func (c *collector) emit(e PodLogEvent) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.events = append(c.events, e)
	select {
	case c.grew <- struct{}{}:
	default:
	}
	if len(c.events) == c.failAt {
		return c.failErr
	}
	return nil
}

func (c *collector) got() []PodLogEvent {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.events)
}

// waitFor waits until n events were emitted.
func (c *collector) waitFor(t *testing.T, n int) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		if len(c.got()) >= n {
			return
		}
		select {
		case <-c.grew:
		case <-deadline:
			t.Fatalf("timed out waiting for %d events; have:\n%s", n, strings.Join(render(c.got()), "\n"))
		}
	}
}

func render(events []PodLogEvent) []string {
	var out []string
	for _, e := range events {
		if e.NewAttempt {
			s := fmt.Sprintf("NEW %s#%d %s", e.Pod, e.Attempt, e.Reason)
			if !e.Time.IsZero() || e.Text != nil || e.Container != "" {
				s += " (with line fields!)"
			}
			out = append(out, s)
			continue
		}
		s := fmt.Sprintf("%s/%s#%d %s %s", e.Pod, e.Container, e.Attempt, e.Time.Sub(base), textRepr(e.Text))
		if e.Reason != "" {
			s += " reason " + e.Reason
		}
		out = append(out, s)
	}
	return out
}

func line(pod, container string, attempt int, ts time.Time, text string) string {
	return fmt.Sprintf("%s/%s#%d %s %s", pod, container, attempt, ts.Sub(base), textRepr([]byte(text)))
}

// textRepr quotes a text, a long one by its length and digest.
func textRepr(b []byte) string {
	if len(b) > 200 {
		return fmt.Sprintf("[%d bytes %x]", len(b), sha256.Sum256(b))
	}
	return fmt.Sprintf("%q", b)
}

func newAttempt(pod string, attempt int, reason string) string {
	return fmt.Sprintf("NEW %s#%d %s", pod, attempt, reason)
}

func assertEvents(t *testing.T, got []PodLogEvent, want ...string) {
	t.Helper()
	g := render(got)
	if !slices.Equal(g, want) {
		t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(g, "\n"), strings.Join(want, "\n"))
	}
}

// follow runs f.Follow in the background; the returned func waits for it.
func follow(ctx context.Context, t *testing.T, f *LogFollower, from LogPosition, c *collector) func() error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f.Follow(ctx, from, c.emit) }()
	return func() error {
		t.Helper()
		select {
		case err := <-done:
			return err
		case <-time.After(5 * time.Second):
			t.Fatalf("Follow did not return; events:\n%s", strings.Join(render(c.got()), "\n"))
			return nil
		}
	}
}

func checkClosed(t *testing.T, k *fakeKube) {
	t.Helper()
	if n := k.openStreams(); n != 0 {
		t.Errorf("%d log streams left open", n)
	}
}

func TestPodLogTwoContainersLive(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("p1", base, []string{"fetch-context"}, []string{"kaniko"})
	// The API server says "waiting to start" once more after the cache
	// shows kaniko running.
	k.failOpen("p1", "kaniko", apierrors.NewBadRequest(`container "kaniko" in pod "p1" is waiting to start: ContainerCreating`))
	c := newCollector()
	wait := follow(t.Context(), t, k.follower(true), LogPosition{}, c)

	time.Sleep(20 * time.Millisecond) // nothing has started: the follower waits
	k.run("p1", "fetch-context")
	k.line("p1", "fetch-context", at(100*time.Millisecond), "fetching context")
	c.waitFor(t, 1)
	k.line("p1", "fetch-context", at(200*time.Millisecond), "digest ok")
	k.exit("p1", "fetch-context", 0, true)
	c.waitFor(t, 2)
	k.run("p1", "kaniko")
	k.line("p1", "kaniko", at(1100*time.Millisecond), "INFO[0000] step 1")
	c.waitFor(t, 3)
	k.line("p1", "kaniko", at(2*time.Second), "INFO[0001] pushed")
	c.waitFor(t, 4)
	// The stream ends before the cache knows: the follower must not stop.
	k.line("p1", "kaniko", at(2*time.Second), "same second, after the exit was seen by the log")
	k.exit("p1", "kaniko", 0, false)
	c.waitFor(t, 5)
	time.Sleep(20 * time.Millisecond)
	k.cacheTerminated("p1", "kaniko", 0)
	k.setPhase("p1", corev1.PodSucceeded)
	k.finish()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	assertEvents(t, c.got(),
		line("p1", "fetch-context", 1, at(100*time.Millisecond), "fetching context"),
		line("p1", "fetch-context", 1, at(200*time.Millisecond), "digest ok"),
		line("p1", "kaniko", 1, at(1100*time.Millisecond), "INFO[0000] step 1"),
		line("p1", "kaniko", 1, at(2*time.Second), "INFO[0001] pushed"),
		line("p1", "kaniko", 1, at(2*time.Second), "same second, after the exit was seen by the log"),
	)
	checkClosed(t, k)
	var kaniko int
	for _, o := range k.opened() {
		if o.container == "kaniko" {
			kaniko++
		}
	}
	if kaniko < 3 { // the 400, the live stream, the stream after the exit
		t.Errorf("kaniko opened %d times, want at least 3", kaniko)
	}
}

func TestPodLogRetryNewAttempt(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("buildq-x-abc", base, nil, []string{"kaniko"})
	k.run("buildq-x-abc", "kaniko")
	k.line("buildq-x-abc", "kaniko", at(time.Second), "building")
	c := newCollector()
	wait := follow(t.Context(), t, k.follower(false), LogPosition{}, c) // no Changed: polls
	c.waitFor(t, 1)
	k.line("buildq-x-abc", "kaniko", at(2*time.Second), "error building image")
	k.exit("buildq-x-abc", "kaniko", 1, true)
	k.setPhase("buildq-x-abc", corev1.PodFailed)
	c.waitFor(t, 2)
	time.Sleep(20 * time.Millisecond) // the next pod comes later
	// Created in a later second, but its name sorts first.
	k.addPod("buildq-x-aaa", at(10*time.Second), nil, []string{"kaniko"})
	c.waitFor(t, 3)
	k.run("buildq-x-aaa", "kaniko")
	k.line("buildq-x-aaa", "kaniko", at(11*time.Second), "building again")
	k.exit("buildq-x-aaa", "kaniko", 0, true)
	k.setPhase("buildq-x-aaa", corev1.PodSucceeded)
	k.finish()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	assertEvents(t, c.got(),
		line("buildq-x-abc", "kaniko", 1, at(time.Second), "building"),
		line("buildq-x-abc", "kaniko", 1, at(2*time.Second), "error building image"),
		newAttempt("buildq-x-aaa", 2, "pod buildq-x-abc failed: kaniko exited 1"),
		line("buildq-x-aaa", "kaniko", 2, at(11*time.Second), "building again"),
	)
	checkClosed(t, k)
}

// resumeFixture: p1 (fetch-context, kaniko; failed) and p2 (kaniko;
// succeeded), the Job finished.
func resumeFixture(t *testing.T) *fakeKube {
	k := newFakeKube(t)
	k.addPod("p1", base, []string{"fetch-context"}, []string{"kaniko"})
	k.run("p1", "fetch-context")
	k.line("p1", "fetch-context", at(100*time.Millisecond), "f1")
	k.exit("p1", "fetch-context", 0, true)
	k.run("p1", "kaniko")
	k.line("p1", "kaniko", at(1200*time.Millisecond), "a")
	k.line("p1", "kaniko", at(1500*time.Millisecond), "b")
	k.line("p1", "kaniko", at(1500*time.Millisecond), "c")
	k.line("p1", "kaniko", at(1500*time.Millisecond), "d")
	k.line("p1", "kaniko", at(2*time.Second), "e")
	k.exit("p1", "kaniko", 137, true)
	k.mu.Lock()
	k.status("p1", "kaniko").State.Terminated.Reason = "OOMKilled"
	k.mu.Unlock()
	k.setPhase("p1", corev1.PodFailed)
	k.addPod("p2", at(30*time.Second), nil, []string{"kaniko"})
	k.run("p2", "kaniko")
	k.line("p2", "kaniko", at(31*time.Second), "x")
	k.exit("p2", "kaniko", 0, true)
	k.setPhase("p2", corev1.PodSucceeded)
	k.finish()
	return k
}

func TestPodLogResume(t *testing.T) {
	t.Parallel()
	const reason = "pod p1 failed: kaniko exited 137 (OOMKilled)"
	second := at(time.Second) // 1.5s truncated
	cases := []struct {
		name      string
		from      LogPosition
		want      []string
		firstOpen fakeOpen
	}{
		{name: "from the start", from: LogPosition{},
			firstOpen: fakeOpen{pod: "p1", container: "fetch-context"},
			want: []string{
				line("p1", "fetch-context", 1, at(100*time.Millisecond), "f1"),
				line("p1", "kaniko", 1, at(1200*time.Millisecond), "a"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "b"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "c"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "d"),
				line("p1", "kaniko", 1, at(2*time.Second), "e"),
				newAttempt("p2", 2, reason),
				line("p2", "kaniko", 2, at(31*time.Second), "x"),
			}},
		{name: "third of three lines with one timestamp", from: LogPosition{Pod: "p1", Container: "kaniko", Time: at(1500 * time.Millisecond), Count: 2},
			firstOpen: fakeOpen{pod: "p1", container: "kaniko", since: second},
			want: []string{
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "d"),
				line("p1", "kaniko", 1, at(2*time.Second), "e"),
				newAttempt("p2", 2, reason),
				line("p2", "kaniko", 2, at(31*time.Second), "x"),
			}},
		{name: "count zero", from: LogPosition{Pod: "p1", Container: "kaniko", Time: at(1500 * time.Millisecond)},
			firstOpen: fakeOpen{pod: "p1", container: "kaniko", since: second},
			want: []string{
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "b"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "c"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "d"),
				line("p1", "kaniko", 1, at(2*time.Second), "e"),
				newAttempt("p2", 2, reason),
				line("p2", "kaniko", 2, at(31*time.Second), "x"),
			}},
		{name: "start of a container", from: LogPosition{Pod: "p1", Container: "kaniko"},
			firstOpen: fakeOpen{pod: "p1", container: "kaniko"},
			want: []string{
				line("p1", "kaniko", 1, at(1200*time.Millisecond), "a"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "b"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "c"),
				line("p1", "kaniko", 1, at(1500*time.Millisecond), "d"),
				line("p1", "kaniko", 1, at(2*time.Second), "e"),
				newAttempt("p2", 2, reason),
				line("p2", "kaniko", 2, at(31*time.Second), "x"),
			}},
		{name: "end of the first pod", from: LogPosition{Pod: "p1", Container: "kaniko", Time: at(2 * time.Second), Count: 1},
			firstOpen: fakeOpen{pod: "p1", container: "kaniko", since: at(2 * time.Second)},
			want: []string{
				newAttempt("p2", 2, reason),
				line("p2", "kaniko", 2, at(31*time.Second), "x"),
			}},
		{name: "after the new attempt", from: LogPosition{Pod: "p2"},
			firstOpen: fakeOpen{pod: "p2", container: "kaniko"},
			want: []string{
				line("p2", "kaniko", 2, at(31*time.Second), "x"),
			}},
		{name: "all stored", from: LogPosition{Pod: "p2", Container: "kaniko", Time: at(31 * time.Second), Count: 1},
			firstOpen: fakeOpen{pod: "p2", container: "kaniko", since: at(31 * time.Second)},
			want:      nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			k := resumeFixture(t)
			c := newCollector()
			if err := k.follower(true).Follow(t.Context(), tc.from, c.emit); err != nil {
				t.Fatal(err)
			}
			assertEvents(t, c.got(), tc.want...)
			opens := k.opened()
			if len(opens) == 0 || opens[0] != tc.firstOpen {
				t.Errorf("first open %+v, want %+v", opens, tc.firstOpen)
			}
			for _, o := range opens {
				if tc.from.Pod != "" && (o.pod == "p1" && tc.from.Pod == "p2" || o.container == "fetch-context" && tc.from.Container == "kaniko") {
					t.Errorf("reopened %+v before the position", o)
				}
			}
			checkClosed(t, k)
		})
	}
}

func TestPodLogStreamBreaks(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("p1", base, nil, []string{"kaniko"})
	k.run("p1", "kaniko")
	l1 := at(3100 * time.Millisecond)
	t2 := at(3700 * time.Millisecond) // same second as l1
	t3 := at(4 * time.Second)
	k.line("p1", "kaniko", l1, "one")
	k.line("p1", "kaniko", t2, "two")
	k.line("p1", "kaniko", t2, "three, same time as two")
	k.line("p1", "kaniko", t3, "four")
	k.mu.Lock()
	raw := func(i int) int { return len(k.log("p1", "kaniko").entries[i].raw) }
	// 1st stream: a clean EOF in the middle of "three" (container running).
	// 2nd stream (since the second of t2: from "one" again): a read error in
	// the middle of "four"; 3rd: a clean EOF inside its timestamp; 4th: no
	// break.
	cuts := []fakeCut{
		{after: raw(0) + raw(1) + 40},
		{after: raw(0) + raw(1) + raw(2) + 33, err: io.ErrUnexpectedEOF},
		{after: raw(0) + raw(1) + raw(2) + 10}, // inside the timestamp of "four"
	}
	k.mu.Unlock()
	k.cut("p1", "kaniko", cuts...)
	c := newCollector()
	wait := follow(t.Context(), t, k.follower(true), LogPosition{}, c)
	c.waitFor(t, 4)
	k.line("p1", "kaniko", at(5*time.Second), "five")
	k.exit("p1", "kaniko", 0, true)
	k.setPhase("p1", corev1.PodSucceeded)
	k.finish()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	assertEvents(t, c.got(),
		line("p1", "kaniko", 1, l1, "one"),
		line("p1", "kaniko", 1, t2, "two"),
		line("p1", "kaniko", 1, t2, "three, same time as two"),
		line("p1", "kaniko", 1, t3, "four"),
		line("p1", "kaniko", 1, at(5*time.Second), "five"),
	)
	opens := k.opened()
	want := []fakeOpen{
		{pod: "p1", container: "kaniko"},
		{pod: "p1", container: "kaniko", since: at(3 * time.Second)},
		{pod: "p1", container: "kaniko", since: at(3 * time.Second)},
		{pod: "p1", container: "kaniko", since: at(3 * time.Second)},
	}
	if len(opens) < len(want) || !slices.Equal(opens[:len(want)], want) {
		t.Errorf("opens %+v, want first %+v", opens, want)
	}
	checkClosed(t, k)
}

func TestPodLogSkipsNeverStarted(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("p1", base, []string{"fetch-context"}, []string{"kaniko"})
	k.run("p1", "fetch-context")
	k.line("p1", "fetch-context", at(time.Second), "digest mismatch")
	k.exit("p1", "fetch-context", 3, true)
	k.setPhase("p1", corev1.PodFailed) // kaniko stays Waiting (PodInitializing)
	k.addPod("p2", at(20*time.Second), []string{"fetch-context"}, []string{"kaniko"})
	k.run("p2", "fetch-context")
	k.exit("p2", "fetch-context", 0, true) // prints nothing
	k.run("p2", "kaniko")
	k.line("p2", "kaniko", at(22*time.Second), "built")
	k.exit("p2", "kaniko", 0, true)
	k.setPhase("p2", corev1.PodSucceeded)
	k.finish()
	c := newCollector()
	if err := k.follower(true).Follow(t.Context(), LogPosition{}, c.emit); err != nil {
		t.Fatal(err)
	}
	assertEvents(t, c.got(),
		line("p1", "fetch-context", 1, at(time.Second), "digest mismatch"),
		newAttempt("p2", 2, "pod p1 failed: fetch-context exited 3"),
		line("p2", "kaniko", 2, at(22*time.Second), "built"),
	)
	for _, o := range k.opened() {
		if o.pod == "p1" && o.container == "kaniko" {
			t.Errorf("opened the log of a container that never ran: %+v", o)
		}
	}
	checkClosed(t, k)
}

func TestPodLogPodGone(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("p1", base, []string{"fetch-context"}, []string{"kaniko"})
	k.run("p1", "fetch-context")
	k.line("p1", "fetch-context", at(time.Second), "fetched")
	k.exit("p1", "fetch-context", 0, true)
	k.run("p1", "kaniko")
	// The cache still has p1, the API server no more.
	k.failOpen("p1", "kaniko", apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, "p1"))
	k.addPod("p2", at(40*time.Second), nil, []string{"kaniko"})
	k.run("p2", "kaniko")
	k.line("p2", "kaniko", at(41*time.Second), "again")
	k.exit("p2", "kaniko", 0, true)
	k.setPhase("p2", corev1.PodSucceeded)
	k.finish()
	c := newCollector()
	if err := k.follower(true).Follow(t.Context(), LogPosition{}, c.emit); err != nil {
		t.Fatal(err)
	}
	assertEvents(t, c.got(),
		line("p1", "fetch-context", 1, at(time.Second), "fetched"),
		newAttempt("p2", 2, "pod p1 is gone"),
		line("p2", "kaniko", 2, at(41*time.Second), "again"),
	)
	checkClosed(t, k)
}

func TestPodLogResumeAfterPodDeleted(t *testing.T) {
	t.Parallel()
	build := func() *fakeKube {
		k := newFakeKube(t)
		k.addPod("p1", base, nil, []string{"kaniko"})
		k.run("p1", "kaniko")
		k.line("p1", "kaniko", at(time.Second), "first attempt")
		k.exit("p1", "kaniko", 1, true)
		k.setPhase("p1", corev1.PodFailed)
		// p2 ran from 10s to 50.3s, its last stored line at 50.3s; it was
		// deleted since. p3 was created in the same second.
		k.addPod("p3", at(50*time.Second), nil, []string{"kaniko"})
		k.run("p3", "kaniko")
		k.line("p3", "kaniko", at(50600*time.Millisecond), "third attempt")
		k.line("p3", "kaniko", at(51*time.Second), "done")
		k.exit("p3", "kaniko", 0, true)
		k.setPhase("p3", corev1.PodSucceeded)
		k.finish()
		return k
	}
	t.Run("with a time", func(t *testing.T) {
		t.Parallel()
		k := build()
		c := newCollector()
		from := LogPosition{Pod: "p2", Container: "kaniko", Time: at(50300 * time.Millisecond), Count: 1}
		if err := k.follower(true).Follow(t.Context(), from, c.emit); err != nil {
			t.Fatal(err)
		}
		assertEvents(t, c.got(),
			newAttempt("p3", 3, "pod p2 is gone"),
			line("p3", "kaniko", 3, at(50600*time.Millisecond), "third attempt"),
			line("p3", "kaniko", 3, at(51*time.Second), "done"),
		)
		for _, o := range k.opened() {
			if o.pod == "p1" {
				t.Errorf("reopened an earlier pod: %+v", o)
			}
		}
		checkClosed(t, k)
	})
	t.Run("without a time", func(t *testing.T) {
		t.Parallel()
		k := build()
		k.setPhase("p3", corev1.PodRunning) // p3 still runs: it is after p2
		k.mu.Lock()
		k.status("p3", "kaniko").State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
		k.mu.Unlock()
		c := newCollector()
		wait := follow(t.Context(), t, k.follower(true), LogPosition{Pod: "p2"}, c)
		c.waitFor(t, 3)
		k.cacheTerminated("p3", "kaniko", 0)
		k.setPhase("p3", corev1.PodSucceeded)
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		assertEvents(t, c.got(),
			newAttempt("p3", 3, "pod p2 is gone"),
			line("p3", "kaniko", 3, at(50600*time.Millisecond), "third attempt"),
			line("p3", "kaniko", 3, at(51*time.Second), "done"),
		)
		checkClosed(t, k)
	})
}

func TestPodLogLongLines(t *testing.T) {
	t.Parallel()
	const mib = 1 << 20
	long := make([]byte, 2*mib+mib/2)
	for i := range long {
		long[i] = "0123456789abcdefghijklmnopqrstuvwxyz"[i%36]
	}
	exact := bytes.Repeat([]byte{'y'}, mib)
	t1, t2, t3, t4 := at(time.Second), at(2*time.Second), at(3*time.Second), at(4*time.Second)
	build := func() *fakeKube {
		k := newFakeKube(t)
		k.addPod("p1", base, nil, []string{"kaniko"})
		k.run("p1", "kaniko")
		k.line("p1", "kaniko", t1, string(long))
		k.line("p1", "kaniko", t2, string(exact))
		k.line("p1", "kaniko", t3, "")
		k.rawLine("p1", "kaniko", t4, "tail without newline", false)
		return k
	}
	all := []string{
		line("p1", "kaniko", 1, t1, string(long[:mib])),
		line("p1", "kaniko", 1, t1, string(long[mib:2*mib])),
		line("p1", "kaniko", 1, t1, string(long[2*mib:])),
		line("p1", "kaniko", 1, t2, string(exact)),
		line("p1", "kaniko", 1, t3, ""),
		line("p1", "kaniko", 1, t4, "tail without newline"),
	}

	t.Run("live with a break inside the long line", func(t *testing.T) {
		t.Parallel()
		k := build()
		k.cut("p1", "kaniko", fakeCut{after: 36 + mib + mib/2})
		c := newCollector()
		wait := follow(t.Context(), t, k.follower(true), LogPosition{}, c)
		c.waitFor(t, 5)
		time.Sleep(30 * time.Millisecond)
		if n := len(c.got()); n != 5 { // the last line may still grow
			t.Fatalf("%d events while the container runs, want 5", n)
		}
		k.exit("p1", "kaniko", 0, true)
		k.setPhase("p1", corev1.PodSucceeded)
		k.finish()
		if err := wait(); err != nil {
			t.Fatal(err)
		}
		assertEvents(t, c.got(), all...)
		checkClosed(t, k)
	})
	t.Run("resume after the first two pieces", func(t *testing.T) {
		t.Parallel()
		k := build()
		k.exit("p1", "kaniko", 0, true)
		k.setPhase("p1", corev1.PodSucceeded)
		k.finish()
		c := newCollector()
		from := LogPosition{Pod: "p1", Container: "kaniko", Time: t1, Count: 2}
		if err := k.follower(true).Follow(t.Context(), from, c.emit); err != nil {
			t.Fatal(err)
		}
		assertEvents(t, c.got(), all[2:]...)
		checkClosed(t, k)
	})
}

func TestPodLogInvalidUTF8(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("p1", base, nil, []string{"kaniko"})
	k.run("p1", "kaniko")
	texts := []string{"\xff\xfe bad \x80", "carriage\rreturn", "  two spaces", "tab\tand\x00nul", "2025-01-01T00:00:00Z looks like a stamp"}
	for i, s := range texts {
		k.line("p1", "kaniko", at(time.Duration(i)*time.Second), s)
	}
	k.rawLine("p1", "kaniko", at(9*time.Second), "cut rune \xc3", false)
	k.exit("p1", "kaniko", 2, true)
	k.setPhase("p1", corev1.PodFailed)
	k.finish()
	c := newCollector()
	if err := k.follower(true).Follow(t.Context(), LogPosition{}, c.emit); err != nil {
		t.Fatal(err)
	}
	var want []string
	for i, s := range texts {
		want = append(want, line("p1", "kaniko", 1, at(time.Duration(i)*time.Second), s))
	}
	want = append(want, line("p1", "kaniko", 1, at(9*time.Second), "cut rune \xc3"))
	assertEvents(t, c.got(), want...)
	checkClosed(t, k)
}

func TestPodLogEmitError(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.addPod("p1", base, nil, []string{"kaniko"})
	k.run("p1", "kaniko") // running: the stream would block after "c"
	k.line("p1", "kaniko", at(time.Second), "a")
	k.line("p1", "kaniko", at(2*time.Second), "b")
	k.line("p1", "kaniko", at(3*time.Second), "c")
	boom := errors.New("store unavailable")
	c := newCollector()
	c.failAt, c.failErr = 2, boom
	err := k.follower(true).Follow(t.Context(), LogPosition{}, c.emit)
	if !errors.Is(err, boom) {
		t.Fatalf("Follow = %v, want %v", err, boom)
	}
	assertEvents(t, c.got(),
		line("p1", "kaniko", 1, at(time.Second), "a"),
		line("p1", "kaniko", 1, at(2*time.Second), "b"),
	)
	checkClosed(t, k)
}

func TestPodLogEmitErrorOnNewAttempt(t *testing.T) {
	t.Parallel()
	k := resumeFixture(t)
	boom := errors.New("store unavailable")
	c := newCollector()
	c.failAt, c.failErr = 1, boom
	err := k.follower(true).Follow(t.Context(), LogPosition{Pod: "p1", Container: "kaniko", Time: at(2 * time.Second), Count: 1}, c.emit)
	if !errors.Is(err, boom) {
		t.Fatalf("Follow = %v, want %v", err, boom)
	}
	assertEvents(t, c.got(), newAttempt("p2", 2, "pod p1 failed: kaniko exited 137 (OOMKilled)"))
	checkClosed(t, k)
}

func TestPodLogContextEnds(t *testing.T) {
	t.Parallel()
	t.Run("reading", func(t *testing.T) {
		t.Parallel()
		k := newFakeKube(t)
		k.addPod("p1", base, nil, []string{"kaniko"})
		k.run("p1", "kaniko")
		k.line("p1", "kaniko", at(time.Second), "a")
		ctx, cancel := context.WithCancel(t.Context())
		c := newCollector()
		wait := follow(ctx, t, k.follower(true), LogPosition{}, c)
		c.waitFor(t, 1)
		cancel()
		if err := wait(); !errors.Is(err, context.Canceled) {
			t.Fatalf("Follow = %v, want context.Canceled", err)
		}
		assertEvents(t, c.got(), line("p1", "kaniko", 1, at(time.Second), "a"))
		checkClosed(t, k)
	})
	t.Run("waiting", func(t *testing.T) {
		t.Parallel()
		k := newFakeKube(t)
		k.addPod("p1", base, nil, []string{"kaniko"}) // never starts
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Millisecond)
		defer cancel()
		c := newCollector()
		if err := k.follower(true).Follow(ctx, LogPosition{}, c.emit); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Follow = %v, want context.DeadlineExceeded", err)
		}
		assertEvents(t, c.got())
		checkClosed(t, k)
	})
	t.Run("finished job, pod never terminates in the cache", func(t *testing.T) {
		t.Parallel()
		k := newFakeKube(t)
		k.addPod("p1", base, nil, []string{"kaniko"})
		k.run("p1", "kaniko")
		k.line("p1", "kaniko", at(time.Second), "a")
		k.exit("p1", "kaniko", 0, false)
		k.finish()
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		c := newCollector()
		if err := k.follower(true).Follow(ctx, LogPosition{}, c.emit); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Follow = %v, want context.DeadlineExceeded", err)
		}
		assertEvents(t, c.got(), line("p1", "kaniko", 1, at(time.Second), "a"))
		checkClosed(t, k)
	})
}

func TestPodLogFinishedBeforePodCached(t *testing.T) {
	t.Parallel()
	k := newFakeKube(t)
	k.finish()
	f := k.follower(true)
	f.finishGrace = 2 * time.Second
	c := newCollector()
	wait := follow(t.Context(), t, f, LogPosition{}, c)
	time.Sleep(20 * time.Millisecond)
	k.addPod("p1", base, nil, []string{"kaniko"})
	k.run("p1", "kaniko")
	k.line("p1", "kaniko", at(time.Second), "late")
	k.exit("p1", "kaniko", 0, true)
	k.setPhase("p1", corev1.PodSucceeded)
	start := time.Now()
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("Follow took %s after the last pod succeeded", d)
	}
	assertEvents(t, c.got(), line("p1", "kaniko", 1, at(time.Second), "late"))

	// No pod at all: the grace ends it.
	k2 := newFakeKube(t)
	k2.finish()
	if err := k2.follower(true).Follow(t.Context(), LogPosition{}, c.emit); err != nil {
		t.Fatal(err)
	}
}

func TestPodLogNewLogSource(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p1", Namespace: "b"}})
	rc, err := NewLogSource(client, "b")(t.Context(), "p1", &corev1.PodLogOptions{Container: "kaniko", Follow: true, Timestamps: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil || string(b) != "fake logs" {
		t.Fatalf("read %q, %v", b, err)
	}
	var sawLogs bool
	for _, a := range client.Actions() {
		if a.GetResource().Resource == "pods" && a.GetSubresource() == "log" && a.GetNamespace() == "b" {
			sawLogs = true
		}
	}
	if !sawLogs {
		t.Errorf("no pods/log action in namespace b: %v", client.Actions())
	}
}

func TestPodLogSplitLines(t *testing.T) {
	t.Parallel()
	in := "2025-03-04T05:06:08.000000000Z a\n" +
		"not a stamp\n" +
		"2025-03-04T05:06:09.5Z \n" +
		"2025-03-04T05:06:10Z\n" +
		"2025-03-04T05:06:11.000000000Z partial"
	for _, final := range []bool{false, true} {
		var got []string
		rerr, herr := splitLines(strings.NewReader(in), final, time.Time{}, func(ts time.Time, text []byte) error {
			got = append(got, fmt.Sprintf("%s %q", ts.Sub(base), text))
			return nil
		})
		if !errors.Is(rerr, io.EOF) || herr != nil {
			t.Fatalf("splitLines = %v, %v", rerr, herr)
		}
		want := []string{`1s "a"`, `1s "not a stamp"`, `2.5s ""`, `3s ""`}
		if final {
			want = append(want, `4s "partial"`)
		}
		if !slices.Equal(got, want) {
			t.Errorf("final=%v: %q, want %q", final, got, want)
		}
	}
}
