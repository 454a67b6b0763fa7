package worker

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	v1 "github.com/buildq/buildq/api/v1"
)

// Metrics are the worker's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	results   *prometheus.CounterVec
	inFlight  prometheus.Gauge
	queueWait *prometheus.HistogramVec
	running   *prometheus.GaugeVec
	queued    *prometheus.GaugeVec
	buildTime *prometheus.HistogramVec
	retries   prometheus.Counter
	dupes     prometheus.Counter
	parks     prometheus.Counter
	requeues  prometheus.Counter
	parkedNow prometheus.Gauge
	heldNow   prometheus.Gauge
	dead      prometheus.Counter
	ready     prometheus.Gauge
	refused   *prometheus.CounterVec
	logs      *prometheus.CounterVec
	logBytes  prometheus.Counter
	attests   prometheus.Counter
	hits      *prometheus.CounterVec
	direct    prometheus.Counter
}

// NewMetrics registers the worker's metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "buildq_results_total",
			Help: "Results published, by status, origin (build, inflight, cache) and reason.",
		}, []string{"status", "origin", "reason"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "buildq_requests_in_flight",
			Help: "Requests this worker holds.",
		}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "buildq_queue_wait_seconds",
			Help:    "Time from a request's publication to a worker taking it, by tenant.",
			Buckets: prometheus.ExponentialBuckets(0.01, 4, 10),
		}, []string{"tenant"}),
		running: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "buildq_builds_running",
			Help: "Builds this worker runs now, by the tenant whose request claimed them (sum over workers for the total).",
		}, []string{"tenant"}),
		queued: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "buildq_requests_queued",
			Help: "Request messages stored in BUILDQ_REQUESTS by tenant: waiting or being handled (every worker reports the same count; take max over workers).",
		}, []string{"tenant"}),
		buildTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "buildq_build_duration_seconds",
			Help:    "Duration of the builds results came from, by status.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 13),
		}, []string{"status"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "buildq_retries_total",
			Help: "Requests handed back for a later try (transient trouble).",
		}),
		dupes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "buildq_duplicate_requests_total",
			Help: "Request messages terminated without a result because an earlier message holds their request id.",
		}),
	}
	m.parks = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "buildq_parked_requests_total",
		Help: "Requests parked on a build in progress: their message acked, their result brought by the build's end.",
	})
	m.requeues = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "buildq_requeued_requests_total",
		Help: "Parked requests published again: their run failed for its claimer's own inputs, or nobody ran it any more.",
	})
	m.heldNow = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "buildq_requests_held_at_intake",
		Help: "Requests this worker's intake holds, unqueued, until the build of their key (for another request) ends.",
	})
	m.parkedNow = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "buildq_requests_waiting_on_builds",
		Help: "Requests parked on builds in progress, as this worker's last sweep of the waiter index counted them.",
	})
	m.dead = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "buildq_dead_letters_total",
		Help: "Requests that exhausted their transient-failure budget: failed, with a copy on buildq.deadletter.<tenant>.",
	})
	m.ready = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "buildq_worker_ready",
		Help: "1 while this worker takes requests (streams set up, loops running), else 0.",
	})
	m.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "buildq_api_replies_refused_total",
		Help: "Tenant API requests (status, cancel) left unanswered because their reply subject is not one a tenant's import or inbox produces, by the subject's tenant.",
	}, []string{"tenant"})
	m.logs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "buildq_build_logs_total",
		Help: "Build runs' logs ended by this worker, by outcome: archived (written to the archive), failed (the end or the archive could not be written; the stream keeps the log until it ages out).",
	}, []string{"outcome"})
	m.logBytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "buildq_build_log_bytes_total",
		Help: "Bytes of build log lines this worker stored into BUILDQ_LOGS.",
	})
	m.attests = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "buildq_attestations_total",
		Help: "Signed provenance statements this worker attached to the images it built.",
	})
	m.direct = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "buildq_requests_taken_direct_total",
		Help: "Requests this worker's handlers took straight from intake, past the tenant's queue: the worker had a build slot free and nothing queued to take (no concurrency or queue limit on the tenant).",
	})
	m.hits = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "buildq_cache_hits_answered_total",
		Help: "Cache hits answered with one ledger write (the entry created with its decision), by where: intake (never queued), held (held at intake until its key's build for another request ended) or queue (queued while its key was building, a plain hit when taken).",
	}, []string{"at"})
	reg.MustRegister(m.results, m.inFlight, m.queueWait, m.buildTime, m.retries, m.dupes, m.parks, m.requeues, m.parkedNow, m.heldNow,
		m.running, m.queued, m.dead, m.ready, m.refused, m.logs, m.logBytes, m.attests, m.hits, m.direct)
	return m
}

func (m *Metrics) logArchived(outcome string) {
	if m != nil {
		m.logs.WithLabelValues(outcome).Inc()
	}
}

func (m *Metrics) logStored(bytes int) {
	if m != nil {
		m.logBytes.Add(float64(bytes))
	}
}

func (m *Metrics) replyRefused(tenant string) {
	if m != nil {
		m.refused.WithLabelValues(tenant).Inc()
	}
}

func (m *Metrics) taken() {
	if m != nil {
		m.inFlight.Inc()
	}
}

func (m *Metrics) released() {
	if m != nil {
		m.inFlight.Dec()
	}
}

func (m *Metrics) retried() {
	if m != nil {
		m.retries.Inc()
	}
}

func (m *Metrics) duplicate() {
	if m != nil {
		m.dupes.Inc()
	}
}

func (m *Metrics) published(d v1.ResultData) {
	if m == nil {
		return
	}
	m.results.WithLabelValues(string(d.Status), string(d.Origin), d.Reason).Inc()
	m.queueWait.WithLabelValues(d.Tenant).Observe(time.Duration(d.Timings.QueueWaitMs * int64(time.Millisecond)).Seconds())
	if d.Origin == v1.OriginBuild && d.Timings.BuildMs > 0 {
		m.buildTime.WithLabelValues(string(d.Status)).Observe(float64(d.Timings.BuildMs) / 1000)
	}
}

// takenDirect counts a request taken straight from intake.
func (m *Metrics) takenDirect() {
	if m != nil {
		m.direct.Inc()
	}
}

// hitAnswered counts a cache hit answered with its entry created decided,
// at "intake" or "queue".
func (m *Metrics) hitAnswered(at string) {
	if m != nil {
		m.hits.WithLabelValues(at).Inc()
	}
}

func (m *Metrics) heldAtIntake(n int) {
	if m != nil {
		m.heldNow.Set(float64(n))
	}
}

func (m *Metrics) parkedRequest() {
	if m != nil {
		m.parks.Inc()
	}
}

func (m *Metrics) requeued() {
	if m != nil {
		m.requeues.Inc()
	}
}

func (m *Metrics) setParked(n int) {
	if m != nil {
		m.parkedNow.Set(float64(n))
	}
}

// attested counts an attestation attached.
func (m *Metrics) attested() {
	if m != nil {
		m.attests.Inc()
	}
}

// buildStarted and buildEnded count the builds this worker runs.
func (m *Metrics) buildStarted(tenant string) {
	if m != nil {
		m.running.WithLabelValues(tenant).Inc()
	}
}

func (m *Metrics) buildEnded(tenant string) {
	if m != nil {
		m.running.WithLabelValues(tenant).Dec()
	}
}

// setQueued replaces the per-tenant queue counts.
func (m *Metrics) setQueued(byTenant map[string]uint64) {
	if m == nil {
		return
	}
	m.queued.Reset()
	for t, n := range byTenant {
		m.queued.WithLabelValues(t).Set(float64(n))
	}
}

func (m *Metrics) deadLettered() {
	if m != nil {
		m.dead.Inc()
	}
}

func (m *Metrics) setReady(ready bool) {
	if m == nil {
		return
	}
	if ready {
		m.ready.Set(1)
	} else {
		m.ready.Set(0)
	}
}
