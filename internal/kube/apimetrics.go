package kube

import (
	"context"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientmetrics "k8s.io/client-go/tools/metrics"
)

// RequestMetrics counts a process's Kubernetes API requests by verb and
// resource (buildq_kube_requests_total): what a build costs the API server.
// It is client-go's request-latency hook; watches, which are long-lived
// streams, do not pass through it.
type RequestMetrics struct{ c *prometheus.CounterVec }

// NewRequestMetrics registers buildq_kube_requests_total with reg.
func NewRequestMetrics(reg prometheus.Registerer) *RequestMetrics {
	m := &RequestMetrics{c: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "buildq_kube_requests_total",
		Help: "Kubernetes API requests of this worker by verb (get, list, create, update, patch, delete) and resource (watches are not counted).",
	}, []string{"verb", "resource"})}
	reg.MustRegister(m.c)
	return m
}

// Install makes client-go report every request of this process to m. It
// takes effect once per process, before the first client is made.
func (m *RequestMetrics) Install() {
	clientmetrics.Register(clientmetrics.RegisterOpts{RequestLatency: m})
}

// Observe counts one request (client-go's LatencyMetric).
func (m *RequestMetrics) Observe(_ context.Context, method string, u url.URL, _ time.Duration) {
	verb, resource := Classify(method, u)
	m.c.WithLabelValues(verb, resource).Inc()
}

// Classify names a request's verb and resource from its HTTP method and
// URL: /api/v1/namespaces/ns/pods/name/log is a get of pods/log, and a GET
// of a collection is a list.
func Classify(method string, u url.URL) (verb, resource string) {
	parts := strings.Split(strings.Trim(u.Path, "/"), "/")
	// /api/v1/... or /apis/group/version/...
	var rest []string
	switch {
	case len(parts) >= 2 && parts[0] == "api":
		rest = parts[2:]
	case len(parts) >= 3 && parts[0] == "apis":
		rest = parts[3:]
	default:
		return strings.ToLower(method), "other"
	}
	if len(rest) >= 2 && rest[0] == "namespaces" {
		if len(rest) == 2 { // a namespace itself
			rest = []string{"namespaces", rest[1]}
		} else {
			rest = rest[2:]
		}
	}
	named := len(rest) >= 2
	resource = "other"
	if len(rest) >= 1 {
		resource = rest[0]
	}
	if len(rest) >= 3 {
		resource += "/" + rest[2]
	}
	switch method {
	case "GET":
		if u.Query().Get("watch") == "true" || u.Query().Get("watch") == "1" {
			return "watch", resource
		}
		if named {
			return "get", resource
		}
		return "list", resource
	case "POST":
		return "create", resource
	case "PUT":
		return "update", resource
	case "PATCH":
		return "patch", resource
	case "DELETE":
		if !named {
			return "deletecollection", resource
		}
		return "delete", resource
	}
	return strings.ToLower(method), resource
}
