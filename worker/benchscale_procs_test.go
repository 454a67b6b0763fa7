//go:build benchscale && linux

package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/loopback"
)

// The scale benchmark's processes and the figures read from them.

func (p *scaleProc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// stop sends SIGTERM, waits for the exit and reads the child's report.
func (p *scaleProc) stop(t *testing.T, timeout time.Duration) scaleReport {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		t.Errorf("%s did not stop within %s:\n%s", p.spec.Name, timeout, p.tail())
	}
	var rep scaleReport
	b, err := os.ReadFile(p.spec.Report)
	if err == nil {
		err = json.Unmarshal(b, &rep)
	}
	if err != nil || p.err != nil {
		t.Errorf("%s: exit %v, report %v:\n%s", p.spec.Name, p.err, err, p.tail())
	}
	return rep
}

// cpuTicks reads the machine's busy and total CPU time (/proc/stat).
func cpuTicks() (busy, total uint64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	for i, f := range fields[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total
}

// procCPU is the CPU time (s) process pid has used, from /proc/<pid>/stat.
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command name, which is in parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	return (utime + stime) / 100 // USER_HZ
}

// cpuSample is the CPU time the benchmark's processes had used by a moment.
type cpuSample struct {
	at  time.Time
	cpu float64
}

// cpuBetween is the CPU time used between from and to, from the samples.
func cpuBetween(samples []cpuSample, from, to time.Time) float64 {
	at := func(t time.Time) float64 {
		v := 0.0
		for _, s := range samples {
			if s.at.After(t) {
				break
			}
			v = s.cpu
		}
		return v
	}
	return at(to) - at(from)
}

func freePort(t *testing.T) int {
	t.Helper()
	_, port, _ := net.SplitHostPort(loopback.FreeAddr())
	n, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// duBytes is the disk space the files under dir use (du).
func duBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil //nolint:nilerr // a file gone meanwhile counts nothing; the walk goes on
		}
		if info, err := d.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}

// scaleStreams are the streams P9 reports, with their short names.
var scaleStreams = []struct{ stream, label string }{
	{v1.RequestsStream, v1.RequestsStream},
	{v1.QueueStream, v1.QueueStream},
	{v1.ResultsStream, v1.ResultsStream},
	{"KV_" + v1.BuildsBucket, "KV " + v1.BuildsBucket},
	{"KV_" + v1.RequestsBucket, "KV " + v1.RequestsBucket + " (ledger)"},
	{"KV_" + v1.SlotsBucket, "KV " + v1.SlotsBucket},
}

type streamSize struct {
	msgs, bytes, lastSeq uint64
	leader               string // the stream's leader (clusters)
}

func streamSizes(ctx context.Context, js jetstream.JetStream) map[string]streamSize {
	out := map[string]streamSize{}
	for _, s := range scaleStreams {
		st, err := js.Stream(ctx, s.stream)
		if err != nil {
			continue
		}
		info, err := st.Info(ctx)
		if err != nil {
			continue
		}
		out[s.stream] = streamSize{msgs: info.State.Msgs, bytes: info.State.Bytes, lastSeq: info.State.LastSeq}
		if info.Cluster != nil {
			sz := out[s.stream]
			sz.leader = info.Cluster.Leader
			out[s.stream] = sz
		}
	}
	return out
}

// scaleTopology is one NATS deployment P9 runs against.
type scaleTopology struct {
	name, label string
	nodes       int
	bare        bool // the bare baseline (benchscale_bare_test.go), not buildq
}

var scaleTopologies = map[string]scaleTopology{
	"single":       {name: "single", label: "single NATS", nodes: 1},
	"cluster":      {name: "cluster", label: "3-node NATS cluster, replicas 3", nodes: 3},
	"cluster-bare": {name: "cluster-bare", label: "the bare protocol on a 3-node NATS cluster, replicas 3", nodes: 3, bare: true},
}

// scaleRequest is request i: key i mod keys (so the requests of a key
// are interleaved with all the others), of the key's tenant.
func scaleRequest(s scaleSettings, i int) *v1.Request {
	k := i % s.Keys
	tenant := fmt.Sprintf("t%02d", k%s.Tenants)
	d := hex64(fmt.Sprint("scale-key-", k))
	return &v1.Request{
		Tenant: tenant, Name: "app", RequestID: fmt.Sprintf("r%07d", i),
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/" + tenant + "/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
	}
}

// scaleOutcome is what one topology's run measured.
type scaleOutcome struct {
	rows   []benchfmt.Row
	series benchfmt.Series
	notes  []string
	sum    scaleSummary
}

// scaleSummary is what a topology's run is compared by.
type scaleSummary struct {
	wall, hitRate, msgsIn, cpuPerAnswer, natsCPU, clientCPU float64
	hitCPU                                                  float64 // CPU per answer, answers 50–100%: cache hits
}

// bareNote compares buildq's run on the cluster with the bare protocol's
// on a cluster of its own in the same session.
func bareNote(s scaleSettings, q, bare scaleSummary) string {
	return fmt.Sprintf("Against the bare protocol (benchscale_bare_test.go: the same requests, published the same way, answered with one decision per request and one build per key and nothing else) on a 3-node cluster of its own in this run: %.0f s where buildq took %.0f s (%.2f× the floor); after the builds, cache hits at %.0f/s where buildq answered %.0f/s; %.1f messages into the servers per request where buildq sent %.1f; %.2f ms of CPU per answer, all processes, from the first publish to the last answer, where buildq spent %.2f — over the answers 50–100%% (cache hits), %.2f ms where buildq spent %.2f (NATS %.0f and its clients %.0f CPU-s over the whole run, against buildq's %.0f and %.0f, where buildq's clients include the emulated Kubernetes API servers and nodes, the registry and the results read back). The builds alone take at least %.0f s on either (%d keys × %s ÷ %d slots).",
		bare.wall, q.wall, q.wall/max(bare.wall, 1e-9), bare.hitRate, q.hitRate, bare.msgsIn, q.msgsIn, bare.cpuPerAnswer, q.cpuPerAnswer,
		bare.hitCPU, q.hitCPU, bare.natsCPU, bare.clientCPU, q.natsCPU, q.clientCPU,
		float64(s.Keys)*s.Build.Seconds()/float64(s.Workers*s.InFlight), s.Keys, s.Build, s.Workers*s.InFlight)
}

// answerLog is every result publish a core subscriber saw, by message id.
type answerLog struct {
	mu        sync.Mutex
	firstAt   map[string]time.Time
	publishes map[string]int
	answered  atomic.Int64
}

// logAnswers subscribes to subject's results on nc.
func logAnswers(t *testing.T, nc *nats.Conn, subject string) *answerLog {
	t.Helper()
	l := &answerLog{firstAt: map[string]time.Time{}, publishes: map[string]int{}}
	sub, err := nc.Subscribe(subject, func(m *nats.Msg) {
		id := m.Header.Get(v1.MsgIDHeader)
		now := time.Now()
		l.mu.Lock()
		l.publishes[id]++
		if _, ok := l.firstAt[id]; !ok {
			l.firstAt[id] = now
			l.answered.Add(1)
		}
		l.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return l
}

// arrivals are the first arrivals of every answer, in order.
func (l *answerLog) arrivals() []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]time.Time, 0, len(l.firstAt))
	for _, at := range l.firstAt {
		out = append(out, at)
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out
}

// publishBacklog publishes every request of s as one backlog, 32 at once,
// each waiting for its PubAck (publish), tried up to 20 times; the
// returned channel gets the time it took, published counts the requests
// stored.
func publishBacklog(t *testing.T, s scaleSettings, publish func(ctx context.Context, req *v1.Request) error) (done <-chan time.Duration, published *atomic.Int64) {
	start := time.Now()
	out := make(chan time.Duration, 1)
	published = &atomic.Int64{}
	go func() {
		next := make(chan int)
		var wg sync.WaitGroup
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					req := scaleRequest(s, i)
					var err error
					for range 20 {
						pctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
						err = publish(pctx, req)
						cancel()
						if err == nil {
							break
						}
						time.Sleep(200 * time.Millisecond)
					}
					if err != nil {
						t.Errorf("publish %s: %v", req.RequestID, err)
						continue
					}
					published.Add(1)
				}
			}()
		}
		for i := range s.Requests {
			next <- i
		}
		close(next)
		wg.Wait()
		out <- time.Since(start)
	}()
	return out, published
}

// benchImages returns the emulated node's image of a Job: an image of its
// own (its config names the Job), made without compressing a layer per
// build. Every image shares one small random layer, compressed once; its
// blob is pushed once and found in the registry after. The emulated node
// stands in for kaniko on the cluster's nodes, whose work is not the
// worker machine's: with a random layer per build, the node's gzip was
// about a tenth of the worker processes' CPU, counted against buildq.
func benchImages() (func(*batchv1.Job) (ggcrv1.Image, error), error) {
	base, err := random.Image(512, 1)
	if err != nil {
		return nil, err
	}
	if _, err := base.Digest(); err != nil { // the layer's digest, computed once
		return nil, err
	}
	return func(job *batchv1.Job) (ggcrv1.Image, error) {
		cf, err := base.ConfigFile()
		if err != nil {
			return nil, err
		}
		cf = cf.DeepCopy()
		cf.Config.Labels = map[string]string{"buildq.bench/job": job.Namespace + "/" + job.Name + "/" + string(job.UID)}
		return mutate.ConfigFile(base, cf)
	}, nil
}
