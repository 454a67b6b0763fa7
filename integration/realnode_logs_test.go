//go:build integration

package integration

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// logLine is one line `buildq logs -f -o json` printed, with when it did.
type logLine struct {
	Time    time.Time `json:"time"`
	Stream  string    `json:"stream"`
	Attempt int       `json:"attempt"`
	Own     bool      `json:"own"`
	Text    string    `json:"text"`
	Note    string    `json:"note"`
	Done    bool      `json:"done"`
	State   string    `json:"state"`
	at      time.Time
}

// follower runs `buildq logs -f -o json` and collects what it prints.
type follower struct {
	cmd   *exec.Cmd
	mu    sync.Mutex
	lines []logLine
	done  chan struct{}
	err   error
	out   bytes.Buffer
}

func (s *suite) followLogs(t *testing.T, tenant, id string) *follower {
	t.Helper()
	f := &follower{done: make(chan struct{})}
	f.cmd = exec.Command(filepath.Join(shared.bin, "buildq"), "logs", "-f", "-o", "json", "--tenant", tenant, "--nats-url", s.natsURL, id)
	stdout, err := f.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	f.cmd.Stderr = &f.out
	if err := f.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(f.done)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var l logLine
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				f.mu.Lock()
				f.out.WriteString("unreadable line: " + sc.Text() + "\n")
				f.mu.Unlock()
				continue
			}
			l.at = time.Now()
			f.mu.Lock()
			f.lines = append(f.lines, l)
			f.mu.Unlock()
		}
		f.err = f.cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = f.cmd.Process.Kill()
		<-f.done
	})
	return f
}

func (f *follower) snapshot() []logLine {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]logLine(nil), f.lines...)
}

func (f *follower) has(re *regexp.Regexp) bool {
	for _, l := range f.snapshot() {
		if re.MatchString(l.Text) {
			return true
		}
	}
	return false
}

func (f *follower) wait(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case <-f.done:
	case <-time.After(d):
		t.Fatalf("buildq logs -f did not end within %s; stderr:\n%s", d, f.out.String())
	}
}

// buildqLogs runs `buildq logs` (no -f) and returns its text output.
func (s *suite) buildqLogs(t *testing.T, tenant, id string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(filepath.Join(shared.bin, "buildq"), append(append([]string{"logs", "--tenant", tenant, "--nats-url", s.natsURL}, args...), id)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.String(), fmt.Errorf("%w: %s", err, stderr.String())
	}
	return stdout.String(), nil
}

// tickRe matches a tick line: its number and the host's uptime when it
// was printed (/proc/uptime: busybox's date has no sub-second format).
var tickRe = regexp.MustCompile(`^tick (\d+) (\d+\.\d+)$`)

// uptimeClock turns /proc/uptime readings into wall-clock times.
func uptimeClock(t *testing.T) func(up string) time.Time {
	t.Helper()
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	cur, err := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	if err != nil {
		t.Fatal(err)
	}
	boot := now.Add(-time.Duration(cur * float64(time.Second)))
	return func(up string) time.Time {
		f, _ := strconv.ParseFloat(up, 64)
		return boot.Add(time.Duration(f * float64(time.Second)))
	}
}

// testLogsOnRealNode: a RUN that prints a line a second, followed with
// `buildq logs -f` while it runs — through the kill of the worker that
// follows it — and read back from the archive afterwards.
func testLogsOnRealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node})
	w1 := s.startWorker("w1")
	res := s.collect()
	const ticks = 14
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\n" +
		"RUN for i in $(seq 1 " + strconv.Itoa(ticks) + "); do echo \"tick $i $(cut -d' ' -f1 /proc/uptime)\"; sleep 1; done\n"})
	req := s.submitWith(dir, "ticks", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": node.images.base} })[0]
	f := s.followLogs(t, req.Tenant, req.RequestID)

	// Live: the first tick is shown while the RUN still prints.
	eventually(t, 3*time.Minute, "tick 3 to be shown by buildq logs -f", func() bool { return f.has(regexp.MustCompile(`^tick 3 `)) })
	// The worker that follows the build dies; another takes it over, and
	// the log goes on with no line lost and none twice.
	_ = w1.cmd.Process.Signal(syscall.SIGKILL)
	<-w1.done
	s.startWorker("w2")
	r := res.wait(t, 1, 5*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	f.wait(t, time.Minute)
	if f.err != nil {
		t.Fatalf("buildq logs -f of a succeeded build: %v\n%s", f.err, f.out.String())
	}
	lines := f.snapshot()
	wall := uptimeClock(t)
	var (
		seen    = map[int]int{}
		lags    []time.Duration
		end     logLine
		printed = map[int]time.Time{}
		shown   = map[int]time.Time{}
	)
	for _, l := range lines {
		if l.Done {
			end = l
		}
		m := tickRe.FindStringSubmatch(l.Text)
		if m == nil || l.Own {
			continue
		}
		i, _ := strconv.Atoi(m[1])
		at := wall(m[2])
		seen[i]++
		printed[i], shown[i] = at, l.at
		lags = append(lags, l.at.Sub(at))
	}
	for i := 1; i <= ticks; i++ {
		if seen[i] != 1 {
			t.Errorf("tick %d shown %d times, want once", i, seen[i])
		}
	}
	if !end.Done || end.State != "succeeded" {
		t.Errorf("the follower's last object %+v, want done and succeeded", end)
	}
	// Followed live, not replayed at the end: tick 1 was shown before the
	// RUN printed its last tick.
	if !shown[1].Before(printed[ticks]) {
		t.Errorf("tick 1 shown at %s, after the last tick was printed at %s", shown[1], printed[ticks])
	}
	if seen[1] == 1 && seen[2] == 1 {
		t.Logf("lag of the lines printed before the kill: tick 1 %s, tick 2 %s", shown[1].Sub(printed[1]).Round(time.Millisecond), shown[2].Sub(printed[2]).Round(time.Millisecond))
	}
	sort.Slice(lags, func(i, j int) bool { return lags[i] < lags[j] })
	if len(lags) > 0 {
		t.Logf("lag from a line printed to buildq logs -f showing it: p50 %s, max %s (a worker killed and replaced in between)",
			lags[len(lags)/2].Round(time.Millisecond), lags[len(lags)-1].Round(time.Millisecond))
	}

	// The archive: the result says where, and it holds what was shown.
	ref := r.Data.Logs
	if !ref.Archived() || ref.Truncated {
		t.Fatalf("result's logs %s", mustJSON(ref))
	}
	rc, err := s.store.Open(context.Background(), ref.Bucket, ref.Object)
	if err != nil {
		t.Fatalf("open the archive %s: %v", ref.Object, err)
	}
	z, _ := io.ReadAll(rc)
	_ = rc.Close()
	zr, err := gzip.NewReader(bytes.NewReader(z))
	if err != nil {
		t.Fatal(err)
	}
	archived, _ := io.ReadAll(zr)
	var archivedTexts []string
	if err := v1.EachLogLine(archived, func(l v1.LogLine) bool {
		archivedTexts = append(archivedTexts, l.Stream+" "+string(l.Text))
		return true
	}); err != nil {
		t.Fatal(err)
	}
	var liveTexts []string
	for _, l := range lines {
		if !l.Done && l.Note == "" {
			liveTexts = append(liveTexts, l.Stream+" "+l.Text)
		}
	}
	if strings.Join(liveTexts, "\n") != strings.Join(archivedTexts, "\n") {
		t.Errorf("the archive differs from the live lines:\nlive:\n%s\narchive:\n%s", strings.Join(liveTexts, "\n"), strings.Join(archivedTexts, "\n"))
	}
	if !strings.Contains(string(archived), "worker w2 runs the build from here") {
		t.Errorf("the archive does not say that w2 took the build over:\n%s", archived)
	}
	// Read again after the end: from the archive, the same lines.
	text, err := s.buildqLogs(t, req.Tenant, req.RequestID)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= ticks; i++ {
		if n := len(regexp.MustCompile(fmt.Sprintf(`(?m)^tick %d [\d.]+$`, i)).FindAllString(text, -1)); n != 1 {
			t.Errorf("buildq logs after the build shows tick %d %d times:\n%s", i, n, text)
		}
	}

	// Another tenant gets nothing: by request id, by build key.
	for _, target := range []string{req.RequestID, r.Data.Key} {
		out, err := s.buildqLogs(t, "globex", target)
		if err == nil || strings.Contains(out, "tick") {
			t.Errorf("tenant globex read the log of acme's build by %s: %v\n%s", target, err, out)
		}
	}
}

// testLogCapOnRealNode: 50 MiB of output keep the first 10 MiB and a
// marker line; the build itself succeeds.
func testLogCapOnRealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node})
	s.startWorker("w1")
	res := s.collect()
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\n" +
		"RUN head -c 52428800 /dev/zero | tr '\\0' 'a' | fold -w 99 && echo printed-$((25*2))MiB\n"})
	req := s.submitWith(dir, "loud", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": node.images.base} })[0]
	r := res.wait(t, 1, 10*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	ref := r.Data.Logs
	if ref == nil || !ref.Truncated || ref.Bytes > v1DefaultLogCap+64<<10 || ref.Bytes < v1DefaultLogCap-128<<10 {
		t.Fatalf("result's logs %s, want truncated near %d bytes", mustJSON(ref), v1DefaultLogCap)
	}
	text, err := s.buildqLogs(t, req.Tenant, req.RequestID)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text, "[buildq] log truncated: it reached the cap of") || strings.Contains(text, "\nprinted-50MiB") {
		t.Fatalf("the capped log's end:\n%s", tail(text, 2000))
	}
	if !strings.HasSuffix(strings.TrimSpace(text), "[buildq] build succeeded") {
		t.Fatalf("the capped log does not end with the build's end:\n%s", tail(text, 500))
	}
}

// v1DefaultLogCap is the worker's default per-build log cap.
const v1DefaultLogCap = 10 << 20
