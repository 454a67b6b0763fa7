package gateway

import (
	"sort"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Routes, as the metrics and logs name them.
const (
	routeEvents = "cloudevents"
	routeGitHub = "github"
	routeGitLab = "gitlab"
)

// Outcomes of a request, as buildq_gateway_requests_total counts them.
const (
	outcomeAccepted     = "accepted"     // 202, stored
	outcomeDuplicate    = "duplicate"    // 202, JetStream had it already
	outcomeIgnored      = "ignored"      // 2xx, nothing to build
	outcomeInvalid      = "invalid"      // 400, 415, 422
	outcomeUnauthorized = "unauthorized" // 401
	outcomeForbidden    = "forbidden"    // 403
	outcomeNotFound     = "not_found"    // 404
	outcomeTooLarge     = "too_large"    // 413
	outcomeDenied       = "denied"       // 502: NATS refused the tenant
	outcomeUnavailable  = "unavailable"  // 503: NATS
	outcomeBusy         = "busy"         // 503: MaxInFlight requests in flight
)

// unknownTenant labels requests whose tenant is not (yet) known: no
// label value ever comes from an unauthenticated client.
const unknownTenant = "unknown"

type metrics struct {
	requests *prometheus.CounterVec
	publish  *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer, s *Server) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "buildq_gateway_requests_total",
			Help: "HTTP requests to the gateway by route (cloudevents, github, gitlab), tenant and outcome.",
		}, []string{"route", "tenant", "outcome"}),
		publish: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "buildq_gateway_publish_seconds",
			Help:    "Time from publishing a build request to its JetStream PubAck, by tenant and result (ok, error).",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"tenant", "result"}),
	}
	reg.MustRegister(m.requests, m.publish, &linkCollector{s: s})
	return m
}

func (m *metrics) published(tenant string, took time.Duration, err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.publish.WithLabelValues(tenant, result).Observe(took.Seconds())
}

// linkCollector reports each link's connection state at scrape time.
type linkCollector struct{ s *Server }

var connectedDesc = prometheus.NewDesc("buildq_gateway_nats_connected",
	"1 while the link's NATS connection is up: one link per tenant (\"*\": buildq dev's shared link).",
	[]string{"tenant"}, nil)

func (c *linkCollector) Describe(ch chan<- *prometheus.Desc) { ch <- connectedDesc }

func (c *linkCollector) Collect(ch chan<- prometheus.Metric) {
	names := make([]string, 0, len(c.s.links))
	for n := range c.s.links {
		names = append(names, n)
	}
	sort.Strings(names)
	gauge := func(name string, l *Link) {
		v := 0.0
		if l.Connected() {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(connectedDesc, prometheus.GaugeValue, v, name)
	}
	for _, n := range names {
		gauge(n, c.s.links[n])
	}
	if c.s.shared != nil {
		gauge("*", c.s.shared)
	}
}
