//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/registry"
)

// Real-process faults (issue 9): each test kills, cuts or breaks one real
// component while builds are in flight, and proves that every request is
// answered exactly once and nothing is lost: one stored result per request
// id (and one publish, counted by collect), the request stream empty
// afterwards, no Job left behind.

// checkSucceeded checks results of requests that must all have succeeded:
// requests of one name (one content) share one digest, and at most one of
// them reports origin build.
func checkSucceeded(t *testing.T, reqs []*v1.Request, got map[string]v1.Result) {
	t.Helper()
	digests, builds := map[string]string{}, map[string]int{}
	for _, q := range reqs {
		r := got[q.RequestID]
		if r.Data.Status != v1.StatusSucceeded || r.Data.Digest == "" {
			t.Errorf("request %s (%s): result %s", q.RequestID, q.Name, mustJSON(r))
			continue
		}
		if d, ok := digests[q.Name]; ok && d != r.Data.Digest {
			t.Errorf("requests of %s got digests %s and %s", q.Name, d, r.Data.Digest)
		}
		digests[q.Name] = r.Data.Digest
		if r.Data.Origin == v1.OriginBuild {
			builds[q.Name]++
		}
	}
	for n, b := range builds {
		if b > 1 {
			t.Errorf("%d results of %s say origin build; one build ran", b, n)
		}
	}
}

func file(content string) map[string]string {
	return map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": content}
}

// TestNATSKilledMidBuildLosesNothing kills nats-server (SIGKILL) while three
// builds run, lets one of them finish while the server is down, and
// restarts the server on the same store directory.
func TestNATSKilledMidBuildLosesNothing(t *testing.T) {
	names := []string{"nk-while-down", "nk-after-a", "nk-after-b"}
	h := newHolds(t, names...)
	s := newSuite(t, options{faults: h.fault})
	// A server killed with SIGKILL can come back with a consumer state
	// older than its last deliveries: a message is delivered again, as
	// delivery 1, to a second handler, which publishes the decision the
	// ledger holds once more (the stream stores one; answeredOnce checks
	// that). A second, different decision would still fail the test.
	s.republishOK = true
	jobs := s.jobsCreated()
	s.startWorker("w1")
	s.startWorker("w2")
	res := s.collect()
	var reqs []*v1.Request
	for _, n := range names {
		reqs = append(reqs, s.submit(contextDir(t, file("nats kill "+n+" "+s.ns)), n, 2)...)
	}
	eventually(t, time.Minute, "three jobs", func() bool { return jobs() >= 3 })
	s.waitTaken(len(reqs))

	s.killNATS()
	// A build that completes while NATS is down: its outcome can be
	// neither stored nor published until the server is back.
	h.release(names[0])
	eventually(t, time.Minute, "the first build to finish", func() bool { return s.jobFinished(names[0]) })
	if n := res.count(); n != 0 {
		t.Fatalf("%d results arrived while NATS was down", n)
	}
	s.startNATS() // same address, same store directory
	h.release(names[1])
	h.release(names[2])

	got := s.answeredOnce(res, ids(reqs), 3*time.Minute)
	checkSucceeded(t, reqs, got)
	if n := jobs(); n != 3 {
		t.Errorf("%d jobs, want 3: a NATS restart must not rebuild anything", n)
	}
	s.settled(len(reqs))
}

// s3Args makes the suite's workers (and so the Jobs' S3_ENDPOINT) use the
// proxy instead of MinIO itself.
func s3Args(p *faultProxy) []string {
	return []string{"--s3-endpoint", "http://" + p.addr}
}

// TestS3DownDuringUpload runs `buildq submit --wait -o json` while MinIO,
// seen through a proxy, fails: first it dies once the upload has begun and
// stays down; then it drops two part uploads and recovers.
func TestS3DownDuringUpload(t *testing.T) {
	s := newSuite(t, options{})
	s3 := startFaultProxy(t, shared.minioEndpoint)
	s.workerArgs = s3Args(s3)
	s.startWorker("w1")
	res := s.collect()
	dir := contextDir(t, file("s3 down during upload "+s.ns))
	sum, err := contexttar.Write(context.Background(), dir, io.Discard, contexttar.Options{Dockerfile: "Dockerfile"})
	if err != nil {
		t.Fatal(err)
	}
	// The objects whose key names the context's digest, whatever the key
	// layout (tenant-scoped or not).
	contextObjects := func() []string {
		u, _ := url.Parse(shared.minioEndpoint)
		mc, err := minio.New(u.Host, &minio.Options{Creds: credentials.NewStaticV4(shared.minioUser, shared.minioPassword, "")})
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for o := range mc.ListObjects(context.Background(), shared.bucket, minio.ListObjectsOptions{Recursive: true}) {
			if o.Err != nil {
				t.Fatal(o.Err)
			}
			if strings.Contains(o.Key, strings.TrimPrefix(sum.Digest, "sha256:")) {
				keys = append(keys, o.Key)
			}
		}
		return keys
	}
	submit := func() (string, string, int) {
		return runCLI(t, 3*time.Minute, "submit", dir, "--tenant", "acme", "--name", "s3up",
			"--nats-url", s.natsURL, "--s3-endpoint", "http://"+s3.addr, "--s3-bucket", shared.bucket,
			"--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword,
			"--wait", "--wait-timeout", "2m", "-o", "json")
	}

	// 1. MinIO goes away at the first part upload and does not come back.
	var down atomic.Bool
	s3.setRule(func(r *http.Request) int {
		if r.Method == http.MethodPut {
			down.Store(true)
		}
		if down.Load() {
			return dropConn
		}
		return 0
	})
	start := time.Now()
	out, errOut, code := submit()
	t.Logf("submit with MinIO gone mid-upload: exit %d after %s; stderr:\n%s", code, time.Since(start).Round(time.Millisecond), errOut)
	if code != 1 || strings.TrimSpace(out) != "" || !strings.Contains(errOut, "upload context to http://"+s3.addr) {
		t.Errorf("submit exited %d, stdout %q: want exit 1, nothing on stdout and the upload error on stderr", code, out)
	}
	if s3.count(http.MethodPut, "") == 0 {
		t.Fatalf("the upload never reached a part upload (faulted: %d requests)", s3.count("", ""))
	}
	// Nothing half-published: no request, no context object.
	if si := s.streamInfo(v1.RequestsStream); si.State.LastSeq != 0 {
		t.Errorf("%d request(s) published although the upload failed", si.State.LastSeq)
	}
	if keys := contextObjects(); len(keys) != 0 {
		t.Errorf("context objects after the failed upload: %v", keys)
	}

	// 2. MinIO drops the first two part uploads, then works again: the
	// upload retries and the submission goes through.
	var drops atomic.Int32
	s3.setRule(func(r *http.Request) int {
		if r.Method == http.MethodPut && drops.Add(1) <= 2 {
			return dropConn
		}
		return 0
	})
	before := s3.count(http.MethodPut, "")
	out, errOut, code = submit()
	if code != 0 {
		t.Fatalf("submit through a MinIO blip exited %d; stderr:\n%s", code, errOut)
	}
	if n := s3.count(http.MethodPut, "") - before; n != 2 {
		t.Errorf("%d part uploads dropped, want 2", n)
	}
	var data v1.ResultData
	if err := json.Unmarshal([]byte(out), &data); err != nil || data.Status != v1.StatusSucceeded {
		t.Fatalf("submit printed %q (%v)", out, err)
	}
	if keys := contextObjects(); len(keys) != 1 {
		t.Errorf("context objects after the retried upload: %v, want one", keys)
	}
	s.answeredOnce(res, []string{data.RequestID}, time.Minute)
	s.settled(1)
}

// TestS3DownDuringBuild cuts MinIO off from the build pods while a build
// runs: the emulated kaniko cannot fetch its context. The requests get
// their failed results once; once MinIO is back, the same content builds.
func TestS3DownDuringBuild(t *testing.T) {
	const name = "s3build"
	h := newHolds(t, name)
	s := newSuite(t, options{faults: h.fault})
	s3 := startFaultProxy(t, shared.minioEndpoint)
	s.workerArgs = s3Args(s3)
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	dir := contextDir(t, file("s3 down during build "+s.ns))
	first := s.submit(dir, name, 2)
	eventually(t, time.Minute, "the job", func() bool { return jobs() >= 1 })
	s.waitTaken(len(first))

	s3.setRule(func(*http.Request) int { return dropConn })
	h.release(name)
	got := s.answeredOnce(res, ids(first), 2*time.Minute)
	if s3.count(http.MethodGet, "") == 0 {
		t.Errorf("the build never tried to fetch its context through the proxy")
	}
	key := ""
	for _, q := range first {
		r := got[q.RequestID]
		if r.Data.Status != v1.StatusFailed || (r.Data.Reason != v1.ReasonContextMissing && r.Data.Reason != v1.ReasonBuildFailed) ||
			!strings.Contains(r.Data.LogTail, "error retrieving context") {
			t.Errorf("result while S3 was down: %s", mustJSON(r))
		}
		if key != "" && r.Data.Key != key {
			t.Errorf("keys %s and %s for the same content", key, r.Data.Key)
		}
		key = r.Data.Key
	}
	t.Logf("result while S3 was down: %s/%s: %s", got[first[0].RequestID].Data.Status, got[first[0].RequestID].Data.Reason, got[first[0].RequestID].Data.LogTail)

	// MinIO is back: the failure is not the key's answer for good.
	s3.setRule(nil)
	second := s.submit(dir, name, 1)
	got2 := s.answeredOnce(res, ids(second), 2*time.Minute)
	r := got2[second[0].RequestID]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Key != key {
		t.Errorf("result after S3 came back: %s", mustJSON(r))
	}
	if n := jobs(); n != 2 {
		t.Errorf("%d jobs, want 2 (the failed build, the rebuild)", n)
	}
	s.settled(len(first) + len(second))
}

// waitRetried waits until the consumer shows a redelivered request and,
// after that, until the proxy faulted one more request matching method and
// part: the worker failed, handed the request back, and tried again.
func (s *suite) waitRetried(p *faultProxy, method, part string) {
	s.t.Helper()
	eventually(s.t, time.Minute, "a redelivery", func() bool {
		return s.queueState().Redelivered >= 1
	})
	n := p.count(method, part)
	eventually(s.t, time.Minute, "a faulted request after the redelivery", func() bool {
		return p.count(method, part) > n
	})
}

// TestRegistry5xxDuringPreflightAndTagCopy puts a proxy in front of the
// registry that answers 503 to manifest requests: first every one, while a
// new build's preflight HEAD asks for its tag; then those of another
// repository, while a request for the built key but that repository gets
// the image copied.
func TestRegistry5xxDuringPreflightAndTagCopy(t *testing.T) {
	s := newSuite(t, options{})
	reg := startFaultProxy(t, "http://"+shared.registryHost)
	// The worker and the Jobs reach the registry through the proxy only,
	// with the same credentials.
	cfg, err := registry.DockerConfigJSON(reg.addr, shared.registryUser, shared.registryPass)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(t.TempDir(), "config.json")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := shared.kube.CoreV1().Secrets(s.ns).Create(context.Background(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry-proxy", Namespace: s.ns}, Type: corev1.SecretTypeDockerConfigJson,
		Data: map[string][]byte{corev1.DockerConfigJsonKey: cfg}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.workerArgs = []string{"--registry", reg.addr, "--insecure-registry", reg.addr,
		"--registry-config", cfgPath, "--registry-secret", "buildq-registry-proxy"}
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	dir := contextDir(t, file("registry 5xx "+s.ns))

	// 1. Preflight: the registry answers 503 to every manifest request.
	reg.setRule(func(r *http.Request) int {
		if strings.Contains(r.URL.Path, "/manifests/") {
			return http.StatusServiceUnavailable
		}
		return 0
	})
	first := s.submit(dir, "preflight", 1)
	s.waitRetried(reg, http.MethodHead, "/v2/acme/preflight/manifests/")
	if n := jobs(); n != 0 {
		t.Errorf("%d job(s) created while the preflight check failed", n)
	}
	if n := res.count(); n != 0 {
		t.Errorf("%d result(s) while the registry answered 503", n)
	}
	reg.setRule(nil)
	r1 := s.answeredOnce(res, ids(first), 2*time.Minute)[first[0].RequestID]
	if r1.Data.Status != v1.StatusSucceeded || r1.Data.Origin != v1.OriginBuild {
		t.Fatalf("result after the registry recovered: %s", mustJSON(r1))
	}

	// 2. Tag copy: the same content for another repository and tag; that
	// repository's manifests answer 503.
	const other = "/v2/acme/copied/manifests/"
	reg.setRule(func(r *http.Request) int {
		if strings.HasPrefix(r.URL.Path, other) {
			return http.StatusServiceUnavailable
		}
		return 0
	})
	second := s.submitWith(dir, "copied", 1, func(r *v1.Request) {
		r.Image = reg.addr + "/acme/copied"
		r.Tags = []string{"v1"}
	})
	s.waitRetried(reg, "", other)
	if n := jobs(); n != 1 {
		t.Errorf("%d jobs while the copy failed, want 1: a known key is copied, not rebuilt", n)
	}
	reg.setRule(nil)
	r2 := s.answeredOnce(res, ids(second), 2*time.Minute)[second[0].RequestID]
	if r2.Data.Status != v1.StatusSucceeded || r2.Data.Origin != v1.OriginCache || r2.Data.Digest != r1.Data.Digest ||
		!strings.HasPrefix(r2.Data.Image, reg.addr+"/acme/copied:") {
		t.Fatalf("copy result %s (build was %s)", mustJSON(r2), r1.Data.Digest)
	}
	// Both tags are in the registry itself, with the built digest.
	for _, tag := range []string{strings.TrimPrefix(r2.Data.Image, reg.addr+"/acme/copied:"), "v1"} {
		ref := shared.registryHost + "/acme/copied:" + tag
		if d, err := s.regClient.Head(context.Background(), ref); err != nil || d != r1.Data.Digest {
			t.Errorf("registry has %s as %s (%v), want %s", ref, d, err, r1.Data.Digest)
		}
	}
	if n := jobs(); n != 1 {
		t.Errorf("%d jobs, want 1", n)
	}
	s.settled(2)
}

// TestAPIServerRestartedMidWatch gives the worker its own kube-apiserver
// process on the suite's etcd and kills it (SIGKILL) while two builds are
// held: one finishes while that server is down, the other after it was
// restarted on the same port. The Job controller and the kubelet go on
// through the shared API server.
func TestAPIServerRestartedMidWatch(t *testing.T) {
	names := []string{"as-while-down", "as-after"}
	h := newHolds(t, names...)
	s := newSuite(t, options{faults: h.fault})
	api := startPrivateAPIServer(t)
	s.kubeconfig = api.kubeconfig
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	var reqs []*v1.Request
	for _, n := range names {
		reqs = append(reqs, s.submit(contextDir(t, file("apiserver restart "+n+" "+s.ns)), n, 2)...)
	}
	eventually(t, time.Minute, "two jobs", func() bool { return jobs() >= 2 })
	s.waitTaken(len(reqs))

	api.kill()
	h.release(names[0])
	eventually(t, time.Minute, "the first build to finish", func() bool { return s.jobFinished(names[0]) })
	if n := res.count(); n != 0 {
		t.Fatalf("%d results while the worker's API server was down", n)
	}
	api.start() // same port, same etcd
	h.release(names[1])

	got := s.answeredOnce(res, ids(reqs), 3*time.Minute)
	checkSucceeded(t, reqs, got)
	if n := jobs(); n != 2 {
		t.Errorf("%d jobs, want 2", n)
	}
	s.settled(len(reqs))
}
