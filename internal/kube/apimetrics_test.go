package kube

import (
	"context"
	"net/url"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestClassifyRequests(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ method, url, verb, resource string }{
		{"POST", "/apis/batch/v1/namespaces/{namespace}/jobs", "create", "jobs"},
		{"GET", "/apis/batch/v1/namespaces/{namespace}/jobs/{name}", "get", "jobs"},
		{"GET", "/apis/batch/v1/namespaces/{namespace}/jobs?labelSelector={value}", "list", "jobs"},
		{"GET", "/apis/batch/v1/namespaces/b/jobs?watch=true", "watch", "jobs"},
		{"DELETE", "/apis/batch/v1/namespaces/{namespace}/jobs/{name}", "delete", "jobs"},
		{"GET", "/api/v1/namespaces/{namespace}/pods", "list", "pods"},
		{"GET", "/api/v1/namespaces/{namespace}/pods/{name}/log", "get", "pods/log"},
		{"GET", "/api/v1/namespaces/{name}", "get", "namespaces"},
		{"GET", "/api/v1/nodes", "list", "nodes"},
		{"PATCH", "/apis/apps/v1/namespaces/x/deployments/y", "patch", "deployments"},
		{"GET", "/version", "get", "other"},
	} {
		u, err := url.Parse(c.url)
		if err != nil {
			t.Fatal(err)
		}
		if verb, res := Classify(c.method, *u); verb != c.verb || res != c.resource {
			t.Errorf("%s %s: %s %s, want %s %s", c.method, c.url, verb, res, c.verb, c.resource)
		}
	}
	reg := prometheus.NewRegistry()
	m := NewRequestMetrics(reg)
	u, _ := url.Parse("/apis/batch/v1/namespaces/{namespace}/jobs")
	m.Observe(context.Background(), "POST", *u, 0)
	m.Observe(context.Background(), "POST", *u, 0)
	if n := testutil.ToFloat64(m.c.WithLabelValues("create", "jobs")); n != 2 {
		t.Fatalf("creates of jobs counted %v, want 2", n)
	}
}
