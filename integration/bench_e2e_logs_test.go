//go:build integration && benche2e

package integration

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/kaniko"
)

// TestBenchE2ELogs measures P10 on the real node: the lag from a line a
// RUN step prints to `buildq logs -f` printing it, against the same line
// read straight from the API server's pods/log follow stream (what
// kubectl logs -f does) in the same run; and the worker's CPU per MiB of
// log it captures.
func TestBenchE2ELogs(t *testing.T) {
	start := time.Now()
	node := startRealNode(t)
	s := newSuite(t, options{node: node})
	w := s.startBenchWorker("w1", "--build-log-cap", strconv.Itoa(256<<20))
	res := s.collect()

	// Lag: 100 lines, 10 a second; each is stamped by the container
	// runtime as it reads it from the container (the time pods/log gives
	// with timestamps, and buildq keeps).
	const lines = 100
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\n" +
		"RUN for i in $(seq 1 " + strconv.Itoa(lines) + "); do echo \"lag $i\"; sleep 0.1; done\n"})
	req := s.submitWith(dir, "lag", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": node.images.base} })[0]
	f := s.followLogs(t, req.Tenant, req.RequestID)
	// The baseline: the kaniko container's own pods/log stream.
	var (
		mu   sync.Mutex
		bare []float64
	)
	lagRe := regexp.MustCompile(`^lag \d+$`)
	go func() {
		var pod string
		eventually(t, 3*time.Minute, "the build's Pod", func() bool {
			list, err := shared.kube.CoreV1().Pods(s.ns).List(context.Background(), metav1.ListOptions{})
			if err == nil && len(list.Items) > 0 {
				pod = list.Items[0].Name
			}
			return pod != ""
		})
		var rc interface {
			Read([]byte) (int, error)
			Close() error
		}
		eventually(t, 3*time.Minute, "the kaniko container's log", func() bool {
			s, err := shared.kube.CoreV1().Pods(s.ns).GetLogs(pod, &corev1.PodLogOptions{Container: kaniko.ContainerName, Follow: true, Timestamps: true}).Stream(context.Background())
			if err == nil {
				rc = s
			}
			return err == nil
		})
		defer rc.Close()
		sc := bufio.NewScanner(rc)
		for sc.Scan() {
			ts, text, ok := strings.Cut(sc.Text(), " ")
			at, err := time.Parse(time.RFC3339Nano, ts)
			if ok && err == nil && lagRe.MatchString(text) {
				mu.Lock()
				bare = append(bare, ms(time.Since(at)))
				mu.Unlock()
			}
		}
	}()
	if r := res.wait(t, 1, 5*time.Minute)[0]; r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	f.wait(t, time.Minute)
	var lag []float64
	for _, l := range f.snapshot() {
		if lagRe.MatchString(l.Text) && !l.Own {
			lag = append(lag, ms(l.at.Sub(l.Time)))
		}
	}
	mu.Lock()
	bareLag := append([]float64(nil), bare...)
	mu.Unlock()
	if len(lag) != lines || len(bareLag) < lines/2 {
		t.Fatalf("%d lines followed through buildq (want %d), %d straight from the API server", len(lag), lines, len(bareLag))
	}
	lagP50, lagP99 := pct(lag)
	bareP50, bareP99 := pct(bareLag)

	// CPU per MiB: a RUN that prints 48 MiB, captured whole.
	cpuBefore := procCPU(t, w.cmd.Process.Pid)
	dir2 := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\n" +
		"RUN head -c 50331648 /dev/zero | tr '\\0' 'b' | fold -w 99\n"})
	s.submitWith(dir2, "volume", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": node.images.base} })
	r2 := res.wait(t, 2, 10*time.Minute)[1]
	if r2.Data.Status != v1.StatusSucceeded || r2.Data.Logs == nil || r2.Data.Logs.Truncated {
		t.Fatalf("result %s", mustJSON(r2))
	}
	cpu := procCPU(t, w.cmd.Process.Pid) - cpuBefore
	mib := float64(r2.Data.Logs.Bytes) / (1 << 20)

	writeResult(t, benchfmt.Result{ID: "P10", Title: "build logs: a printed line to buildq logs -f, and the worker's CPU per MiB captured",
		Baseline: "the same lines read straight from pods/log (follow), as kubectl logs -f does, in the same run",
		Rows: []benchfmt.Row{
			benchfmt.Compared("line printed → shown by buildq logs -f, p50", "ms", lagP50, bareP50),
			benchfmt.Compared("line printed → shown by buildq logs -f, p99", "ms", lagP99, bareP99),
			benchfmt.Plain("worker CPU per MiB of log captured and archived", "ms", cpu/mib),
			benchfmt.Plain("log captured", "MiB", mib),
		},
		Goal:    "a printed line shown by buildq logs -f within 2 s (p99)",
		Met:     benchfmt.Bool(lagP99 < 2000),
		Notes:   []string{"Both lags are measured from the container runtime's timestamp of the line. buildq's path adds the chunking (a line after a quiet 250 ms is stored at once; the lines that follow it within 250 ms share the next chunk), the stream and the logs service's long poll to the kubelet's own stream: 10 lines a second, as here, are the worst case of that batching; a line a second is stored as it comes."},
		Seconds: time.Since(start).Seconds()})
}

// procCPU is the CPU time (user + system) process pid used so far, in
// milliseconds.
func procCPU(t *testing.T, pid int) float64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command's closing parenthesis: utime and stime are
	// the 12th and 13th.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	const clockTicks = 100 // USER_HZ on Linux
	return (utime + stime) * 1000 / clockTicks
}
