//go:build integration

package integration

import (
	"context"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// TestRealNode runs builds through the production path: the kaniko
// executor in Pods that a real kubelet starts on containerd and runc, with
// the securityContext buildq renders. The node comes up once for all its
// subtests (node_test.go).
func TestRealNode(t *testing.T) {
	node := startRealNode(t)

	t.Run("build", func(t *testing.T) {
		s := newSuite(t, options{node: node})
		s.startWorker("w1")
		res := s.collect()
		dir := contextDir(t, map[string]string{
			"Dockerfile": "FROM " + node.images.base + "\nRUN echo hi > /hi\n",
		})
		req := s.submit(dir, "hello", 1)[0]
		r := res.wait(t, 1, 2*time.Minute)[0]
		if r.ID != req.RequestID || r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(r))
		}
		d, err := s.regClient.Head(context.Background(), r.Data.Image)
		if err != nil || d != r.Data.Digest {
			t.Fatalf("registry has %s (%v), result says %s", d, err, r.Data.Digest)
		}
	})
}
