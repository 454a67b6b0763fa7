//go:build integration

package integration

import (
	"bytes"
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
)

// fetchImage is what the fetch-context init containers name; the emulated
// kubelet runs their contract without pulling it.
const fetchImage = "ghcr.io/buildq/buildq-emulated@sha256:0000000000000000000000000000000000000000000000000000000000000002"

func fetchArgs() []string {
	return []string{"--fetch-image", fetchImage, "--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword}
}

// TestFetchContextKeepsS3KeysOutOfBuildPods: with --fetch-image the Job's
// build container has no S3 key, no S3 setting and no URL; the init
// container has a presigned URL for exactly the request's object.
func TestFetchContextKeepsS3KeysOutOfBuildPods(t *testing.T) {
	s := newSuite(t, options{workerArgs: append(fetchArgs(), "--keep-jobs", "--s3-credentials-secret", "buildq-s3")})
	s.startWorker("w1")
	res := s.collect()
	req := s.submit(contextDir(t, siteFiles), "fetched", 1)[0]
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	job, err := shared.kube.BatchV1().Jobs(s.ns).Get(context.Background(), r.Data.Job, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod := job.Spec.Template.Spec
	for _, c := range pod.Containers {
		for _, e := range c.Env {
			if strings.HasPrefix(e.Name, "AWS_") || strings.HasPrefix(e.Name, "S3_") || e.ValueFrom != nil {
				t.Errorf("build container %s has %s", c.Name, e.Name)
			}
		}
		for _, a := range c.Args {
			if strings.Contains(a, "s3://") || strings.Contains(a, "X-Amz") {
				t.Errorf("build container %s has arg %s", c.Name, a)
			}
		}
	}
	if len(pod.InitContainers) != 1 || pod.InitContainers[0].Name != kaniko.FetchContainerName {
		t.Fatalf("init containers %+v", pod.InitContainers)
	}
	var u string
	for i, a := range pod.InitContainers[0].Args {
		if a == "--url" && i+1 < len(pod.InitContainers[0].Args) {
			u = pod.InitContainers[0].Args[i+1]
		}
	}
	parsed, err := url.Parse(u)
	if err != nil || parsed.Path != "/"+req.Source.S3.Bucket+"/"+req.Source.S3.Key || parsed.Query().Get("X-Amz-Signature") == "" {
		t.Fatalf("init container URL %q: not a presigned URL of %s/%s", u, req.Source.S3.Bucket, req.Source.S3.Key)
	}
}

// TestFetchContextRefusesReplacedBytes: an object replaced after the
// request named it (a party that can write the bucket poisoning a
// tenant's context) is never built. Replaced before the worker took the
// request, the worker's own possession check refuses it before any Job
// (ContextMismatch, no Pod); replaced after the worker had shown its
// tenant holds those bytes (the proof is kept per tenant and digest), the
// build Pod's fetch-context init container refuses it: ContextMismatch,
// one Pod (a mismatch is not retried).
func TestFetchContextRefusesReplacedBytes(t *testing.T) {
	s := newSuite(t, options{workerArgs: fetchArgs()})
	s.startWorker("w1")
	res := s.collect()

	t.Run("replaced before the request was taken", func(t *testing.T) {
		req := s.submitWith(contextDir(t, siteFiles), "poisoned", 1, func(r *v1.Request) { replaceContext(t, s, r) })[0]
		r := res.wait(t, 1, 2*time.Minute)[0]
		if r.ID != req.RequestID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMismatch || r.Data.Job != "" {
			t.Fatalf("result %s, want failed/%s and no Job", mustJSON(r), v1.ReasonContextMismatch)
		}
		if n := s.kubelet.podsRun(); n != 0 {
			t.Errorf("%d pods ran, want 0 (refused before any Job)", n)
		}
	})

	t.Run("replaced after the worker checked it", func(t *testing.T) {
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nARG V\nCOPY f /f\n", "f": "genuine"})
		first := s.submitWith(dir, "checked", 1, nil)[0]
		if r := res.wait(t, 2, 2*time.Minute)[1]; r.ID != first.RequestID || r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("the genuine build: %s", mustJSON(r))
		}
		before := s.kubelet.podsRun()
		// The same context, another build (another key): the worker
		// holds the proof and does not read the object again; the
		// build Pod does.
		req := s.submitWith(dir, "checked", 1, func(r *v1.Request) {
			r.BuildArgs = map[string]string{"V": "2"}
			replaceContext(t, s, r)
		})[0]
		r := res.wait(t, 3, 2*time.Minute)[2]
		if r.ID != req.RequestID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMismatch || r.Data.Job == "" {
			t.Fatalf("result %s, want failed/%s from the build Pod", mustJSON(r), v1.ReasonContextMismatch)
		}
		if n := s.kubelet.podsRun() - before; n != 1 {
			t.Errorf("%d pods ran, want 1 (a mismatch is not retried)", n)
		}
	})
}

// replaceContext overwrites the object r names with another context's
// bytes, as a party that can write the bucket would, before r is published.
func replaceContext(t *testing.T, s *suite, r *v1.Request) {
	t.Helper()
	ctx := context.Background()
	var buf bytes.Buffer
	if _, err := contexttar.Write(ctx, contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY evil /evil\n", "evil": "x"}), &buf, contexttar.Options{}); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(s.minioEndpoint)
	mc, err := minio.New(u.Host, &minio.Options{Creds: credentials.NewStaticV4(shared.minioUser, shared.minioPassword, "")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mc.PutObject(ctx, r.Source.S3.Bucket, r.Source.S3.Key, &buf, int64(buf.Len()), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestTenantRegistryCredentials: with --tenant-registry-secret a build Pod
// mounts its tenant's own Secret (the shared one holds a wrong password
// here, so using it would fail the push), and a tenant without credentials
// is refused before anything is created.
func TestTenantRegistryCredentials(t *testing.T) {
	s := newSuite(t, options{tenantCreds: true, workerArgs: []string{"--keep-jobs"}})
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, siteFiles), "own-creds", 1)
	r := res.wait(t, 1, 2*time.Minute)[0]
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	job, err := shared.kube.BatchV1().Jobs(s.ns).Get(context.Background(), r.Data.Job, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var mounted []string
	for _, v := range job.Spec.Template.Spec.Volumes {
		if v.Secret != nil {
			mounted = append(mounted, v.Secret.SecretName)
		}
	}
	if len(mounted) != 1 || mounted[0] != "buildq-registry-acme" {
		t.Fatalf("the build Pod mounts %v, want only buildq-registry-acme", mounted)
	}

	// Tenant beta has no Secret and no credentials file.
	ctx := context.Background()
	up, err := s.store.ForTenant("beta").UploadContext(ctx, contextDir(t, siteFiles), contexttar.Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.pub.Publish(ctx, &v1.Request{Tenant: "beta", Name: "nocreds",
		Source: v1.Source{S3: &v1.S3Source{Bucket: up.Bucket, Key: up.Key}}, ContextDigest: up.Digest}); err != nil {
		t.Fatal(err)
	}
	got := res.wait(t, 2, time.Minute)
	r = got[1]
	if r.Data.Tenant != "beta" || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest ||
		!strings.Contains(r.Data.Message, `tenant "beta" has no registry credentials`) || !strings.Contains(r.Data.Message, "buildq-registry-beta") {
		t.Fatalf("result %s", mustJSON(r))
	}
	if n := jobs(); n != 1 {
		t.Errorf("%d jobs, want 1 (none for the tenant without credentials)", n)
	}
}

// TestAllowedRegistryRefusesOthers: a worker told which registries it may
// contact refuses a request for any other before contacting it.
func TestAllowedRegistryRefusesOthers(t *testing.T) {
	s := newSuite(t, options{workerArgs: []string{"--allowed-registry", "registry.example.com"}})
	jobs := s.jobsCreated()
	s.startWorker("w1")
	res := s.collect()
	s.submit(contextDir(t, siteFiles), "elsewhere", 1)
	r := res.wait(t, 1, time.Minute)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest ||
		!strings.Contains(r.Data.Message, "registry "+s.registryHost+" is not one this worker contacts (--allowed-registry: registry.example.com)") {
		t.Fatalf("result %s", mustJSON(r))
	}
	if n := jobs(); n != 0 {
		t.Errorf("%d jobs", n)
	}
}
