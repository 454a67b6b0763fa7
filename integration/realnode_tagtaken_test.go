//go:build integration

package integration

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/random"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// testTagTakenOnRealNode: an image pushed to a build's first tag after the
// worker's own check and before its Pod starts is never pushed over. The
// Pod waits for its tenant's registry Secret, which the test takes away
// before the request and gives back only once the image is there (the
// worker checks with its own credentials file, not the Secret); the
// Pod's fetch-context then finds the tag taken (exit 6), kaniko never
// runs, and the request is answered with the image found there, origin
// cache.
func testTagTakenOnRealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node})
	ctx := context.Background()
	const secretName = "buildq-registry-acme"
	secret, err := shared.kube.CoreV1().Secrets(s.ns).Get(ctx, secretName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the tenant's registry Secret: %v", err)
	}
	if err := shared.kube.CoreV1().Secrets(s.ns).Delete(ctx, secretName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	fetchExits := s.fetchExits()
	s.startWorker("w1")
	res := s.collect()
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nCOPY f /f\n", "f": "built by buildq"})
	req := s.submitWith(dir, "taken", 1, func(r *v1.Request) { r.BuildArgs = map[string]string{"BASE": node.images.base} })[0]

	var absent string
	eventually(t, time.Minute, "the build's Job, its Pod waiting for its Secret", func() bool {
		jobs, err := shared.kube.BatchV1().Jobs(s.ns).List(ctx, metav1.ListOptions{LabelSelector: kaniko.ManagedBySelector})
		if err != nil || len(jobs.Items) != 1 {
			return false
		}
		for _, c := range jobs.Items[0].Spec.Template.Spec.InitContainers {
			if i := slices.Index(c.Args, "--absent"); i >= 0 && i+1 < len(c.Args) {
				absent = c.Args[i+1]
			}
		}
		return true
	})
	if absent == "" {
		t.Fatal("the build Pod's fetch-context checks no tag (no --absent)")
	}
	img, err := random.Image(128, 1)
	if err != nil {
		t.Fatal(err)
	}
	hand, err := s.regClient.Push(ctx, img, []string{absent})
	if err != nil {
		t.Fatal(err)
	}
	secret.ResourceVersion, secret.UID = "", ""
	if _, err := shared.kube.CoreV1().Secrets(s.ns).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	r := res.wait(t, 1, 5*time.Minute)[0]
	if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != hand {
		t.Fatalf("result %s, want the image found at %s (%s), origin cache", mustJSON(r), absent, hand)
	}
	if d, err := s.regClient.Head(ctx, absent); err != nil || d != hand {
		t.Errorf("%s holds %s (%v), want the image pushed there first (%s)", absent, d, err, hand)
	}
	if got := fetchExits(); !slices.Contains(got, kaniko.FetchExitTagTaken) {
		t.Errorf("fetch-context exit codes seen %v, want %d (the tag found taken in the Pod)", got, kaniko.FetchExitTagTaken)
	}
}

// fetchExits watches the namespace's Pods and returns the exit codes their
// fetch-context init containers terminated with so far.
func (s *suite) fetchExits() func() []int32 {
	s.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.t.Cleanup(cancel)
	w, err := shared.kube.CoreV1().Pods(s.ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		s.t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[types.UID]int32{}
	go func() {
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type == watch.Error {
				continue
			}
			for _, cs := range p.Status.InitContainerStatuses {
				if cs.Name == kaniko.FetchContainerName && cs.State.Terminated != nil {
					mu.Lock()
					seen[p.UID] = cs.State.Terminated.ExitCode
					mu.Unlock()
				}
			}
		}
	}()
	return func() []int32 {
		mu.Lock()
		defer mu.Unlock()
		var out []int32
		for _, c := range seen {
			out = append(out, c)
		}
		return out
	}
}
