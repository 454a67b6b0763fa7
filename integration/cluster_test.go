//go:build integration

package integration

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// A JetStream cluster of nats-server processes on loopback, for the tests
// that kill one node of it. The workers run with --replicas 3 and every
// node's URL.

type natsNode struct {
	name      string
	addr      string // client address
	routeAddr string // cluster address
	dir       string // store directory, kept across restarts
	cmd       *exec.Cmd
	done      chan struct{}
	logs      *lockedBuffer
}

type natsCluster struct {
	t     *testing.T
	mu    sync.Mutex
	nodes []*natsNode
}

func startNATSCluster(t *testing.T, n int) *natsCluster {
	t.Helper()
	c := &natsCluster{t: t}
	for i := range n {
		c.nodes = append(c.nodes, &natsNode{name: fmt.Sprintf("n%d", i+1), addr: freeAddr(), routeAddr: freeAddr(), dir: t.TempDir()})
	}
	t.Cleanup(func() {
		for i := range c.nodes {
			c.kill(i)
		}
		if t.Failed() {
			c.mu.Lock()
			defer c.mu.Unlock()
			for _, nd := range c.nodes {
				if nd.logs != nil {
					t.Logf("nats-server %s log (routes left out):\n%s", nd.name, tail(withoutRoutes(nd.logs.String()), 3000))
				}
			}
		}
	})
	for i := range c.nodes {
		c.start(i)
	}
	// JetStream answers once the cluster has elected its meta leader.
	nc, err := nats.Connect(c.url())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "the JetStream cluster", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(ctx)
		return err == nil
	})
	// A quorum answers the above; a node that exited at start (a port
	// it could not bind) would leave the cluster short without a word.
	for _, nd := range c.nodes {
		c.exited(nd)
	}
	return c
}

// exited fails the test if node nd's process has ended.
func (c *natsCluster) exited(nd *natsNode) {
	c.t.Helper()
	c.mu.Lock()
	done := nd.done
	c.mu.Unlock()
	select {
	case <-done:
		c.t.Fatalf("nats-server %s exited at start:\n%s", nd.name, tail(nd.logs.String(), 2000))
	default:
	}
}

// withoutRoutes drops the route connection chatter from a server log.
func withoutRoutes(log string) string {
	var keep []string
	for _, l := range strings.Split(log, "\n") {
		if !strings.Contains(l, "Route connection") && !strings.Contains(l, "Router connection") && !strings.Contains(l, "to connect to route") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

// url lists every node, comma-separated.
func (c *natsCluster) url() string {
	var urls []string
	for _, nd := range c.nodes {
		urls = append(urls, "nats://"+nd.addr)
	}
	return strings.Join(urls, ",")
}

// start runs node i on its address and store directory.
func (c *natsCluster) start(i int) {
	c.t.Helper()
	nd := c.nodes[i]
	var routes []string
	for _, o := range c.nodes {
		if o != nd {
			routes = append(routes, "nats://"+o.routeAddr)
		}
	}
	host, port, _ := strings.Cut(nd.addr, ":")
	cmd := exec.Command(filepath.Join(shared.bin, "nats-server"), "-js", "-a", host, "-p", port, "-sd", nd.dir,
		"-n", nd.name, "--cluster_name", "buildq-it", "--cluster", "nats://"+nd.routeAddr, "--routes", strings.Join(routes, ","))
	logs := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	c.mu.Lock()
	nd.cmd, nd.done, nd.logs = cmd, done, logs
	c.mu.Unlock()
	eventually(c.t, 20*time.Second, "nats-server "+nd.name, func() bool {
		c.exited(nd)
		nc, err := nats.Connect("nats://" + nd.addr)
		if err != nil {
			return false
		}
		nc.Close()
		return true
	})
}

// kill ends node i with SIGKILL and waits for it.
func (c *natsCluster) kill(i int) {
	c.mu.Lock()
	nd := c.nodes[i]
	cmd, done := nd.cmd, nd.done
	c.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

func (c *natsCluster) index(name string) int {
	for i, nd := range c.nodes {
		if nd.name == name {
			return i
		}
	}
	c.t.Fatalf("no node %q", name)
	return -1
}

// clusterStreams are the streams behind buildq's streams and buckets.
var clusterStreams = []string{v1.RequestsStream, v1.QueueStream, v1.ResultsStream, "KV_" + v1.BuildsBucket, "KV_buildq-requests", "KV_" + v1.SlotsBucket}

// waitCurrent waits until every stream has a leader and all its other
// replicas are online and current.
func (s *suite) waitCurrent() {
	s.t.Helper()
	for _, name := range clusterStreams {
		eventually(s.t, time.Minute, "stream "+name+" to have all replicas current", func() bool {
			ci := s.streamInfo(name).Cluster
			if ci == nil || ci.Leader == "" || len(ci.Replicas) != len(s.cluster.nodes)-1 {
				return false
			}
			for _, r := range ci.Replicas {
				if !r.Current || r.Offline {
					return false
				}
			}
			return true
		})
	}
}

// logLeaders logs the leader of every stream of buildq.
func (s *suite) logLeaders() {
	s.t.Helper()
	var ls []string
	for _, name := range clusterStreams {
		if ci := s.streamInfo(name).Cluster; ci != nil {
			ls = append(ls, name+"="+ci.Leader)
		}
	}
	s.t.Logf("stream leaders: %s", strings.Join(ls, " "))
}

func (s *suite) streamLeader(name string) string {
	s.t.Helper()
	ci := s.streamInfo(name).Cluster
	if ci == nil || ci.Leader == "" {
		s.t.Fatalf("stream %s has no leader: %+v", name, ci)
	}
	return ci.Leader
}

// clusterSuite starts three nodes, two workers with --replicas 3, and
// submits two requests for each name; it returns when every build's Job is
// running (held) and the workers hold every request. The second worker
// starts once the first has created the streams and buckets (starting
// both at once is TestClusterWorkersStartTogether).
func clusterSuite(t *testing.T, names []string) (*suite, *holds, func() int, *results, []*v1.Request) {
	t.Helper()
	h := newHolds(t, names...)
	s := newSuite(t, options{clusterNodes: 3, faults: h.fault, workerArgs: []string{"--replicas", "3"}})
	// A node's death loses acks, PubAcks and ledger writes in flight; the
	// worker then publishes the same result again, which the stream drops
	// as a duplicate. Different results for one request still fail.
	s.republishOK = true
	s.watchMayLag = true
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	s.waitCurrent()
	s.startWorker("w2")
	for _, name := range clusterStreams {
		if r := s.streamInfo(name).Config.Replicas; r != 3 {
			t.Errorf("stream %s has %d replicas, want 3 (--replicas 3)", name, r)
		}
	}
	var reqs []*v1.Request
	for _, n := range names {
		reqs = append(reqs, s.submit(contextDir(t, file("cluster "+n+" "+s.ns)), n, 2)...)
	}
	eventually(t, time.Minute, fmt.Sprintf("%d jobs", len(names)), func() bool { return jobs() >= len(names) })
	s.waitTaken(len(reqs))
	return s, h, jobs, res, reqs
}

// finishCluster releases the remaining builds and checks the outcome.
func finishCluster(t *testing.T, s *suite, h *holds, jobs func() int, res *results, names []string, reqs []*v1.Request) {
	t.Helper()
	for _, n := range names[1:] {
		h.release(n)
	}
	got := s.answeredOnce(res, ids(reqs), 3*time.Minute)
	checkSucceeded(t, reqs, got)
	if n := jobs(); n != len(names) {
		t.Errorf("%d jobs, want %d: losing a node must not rebuild anything", n, len(names))
	}
	s.settled(len(reqs))
}

// TestClusterNodeKilledMidBuild kills (SIGKILL) a node that does not lead
// the request stream while three builds run. With two of three nodes up,
// a build that finishes meanwhile is answered at once; the node is
// restarted on its store directory and catches up.
func TestClusterNodeKilledMidBuild(t *testing.T) {
	names := []string{"cn-while-down", "cn-after-a", "cn-after-b"}
	s, h, jobs, res, reqs := clusterSuite(t, names)
	s.logLeaders()
	leader := s.streamLeader(v1.RequestsStream)
	victim := (s.cluster.index(leader) + 1) % len(s.cluster.nodes)
	t.Logf("request stream leader %s; killing %s", leader, s.cluster.nodes[victim].name)
	s.cluster.kill(victim)

	s.logLeaders()
	h.release(names[0])
	s.answeredOnce(res, ids(reqs[:2]), 2*time.Minute)
	s.cluster.start(victim)
	s.waitCurrent()
	finishCluster(t, s, h, jobs, res, names, reqs)
}

// TestClusterStreamLeaderKilledMidBuild kills (SIGKILL) the node that leads
// BUILDQ_REQUESTS while three builds run; another node takes the lead, a
// build that finishes meanwhile is answered, and the old leader is
// restarted on its store directory.
func TestClusterStreamLeaderKilledMidBuild(t *testing.T) {
	names := []string{"cl-while-down", "cl-after-a", "cl-after-b"}
	s, h, jobs, res, reqs := clusterSuite(t, names)
	s.logLeaders()
	leader := s.streamLeader(v1.RequestsStream)
	victim := s.cluster.index(leader)
	t.Logf("killing %s, the leader of %s", leader, v1.RequestsStream)
	s.cluster.kill(victim)
	eventually(t, time.Minute, "a new leader of the request stream", func() bool {
		ci := s.streamInfo(v1.RequestsStream).Cluster
		return ci != nil && ci.Leader != "" && ci.Leader != leader
	})

	s.logLeaders()
	h.release(names[0])
	s.answeredOnce(res, ids(reqs[:2]), 2*time.Minute)
	s.cluster.start(victim)
	s.waitCurrent()
	finishCluster(t, s, h, jobs, res, names, reqs)
}

// TestClusterWorkersStartTogether starts two workers at the same moment
// against a fresh three-node cluster, as a Deployment with two replicas
// does: both must set up the streams and buckets (idempotently, "safe to
// run from many workers at once") and serve.
func TestClusterWorkersStartTogether(t *testing.T) {
	s := newSuite(t, options{clusterNodes: 3, workerArgs: []string{"--replicas", "3"}})
	start := time.Now()
	ws := []*workerProc{s.startWorker("w1"), s.startWorker("w2")}
	res := s.collect()
	for i, w := range ws {
		eventually(t, time.Minute, fmt.Sprintf("worker w%d to start", i+1), func() bool {
			select {
			case <-w.done:
				t.Fatalf("worker w%d exited at start:\n%s", i+1, tail(w.out.String(), 2000))
			default:
			}
			return strings.Contains(w.out.String(), "worker started")
		})
	}
	t.Logf("both workers started %s after they were launched together", time.Since(start).Round(100*time.Millisecond))
	reqs := s.submit(contextDir(t, file("cluster start together "+s.ns)), "cstart", 2)
	got := s.answeredOnce(res, ids(reqs), 2*time.Minute)
	checkSucceeded(t, reqs, got)
	for i, w := range ws {
		select {
		case <-w.done:
			t.Errorf("worker w%d exited:\n%s", i+1, tail(w.out.String(), 2000))
		default:
		}
	}
	s.settled(len(reqs))
}
