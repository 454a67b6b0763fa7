// Package gateway is buildq's event ingress: a stateless HTTP service
// that turns CloudEvents and forge push webhooks into build requests on
// JetStream, for producers that cannot speak NATS.
//
// Routes:
//
//	POST /                       a CloudEvent (binary or structured mode) of
//	                             type dev.buildq.build.requested.v1 whose
//	                             data is a build request (api/v1.Request)
//	POST /hooks/github/<tenant>  a GitHub webhook (X-Hub-Signature-256)
//	POST /hooks/gitlab/<tenant>  a GitLab webhook (X-Gitlab-Token)
//	GET  /healthz                live
//	GET  /readyz                 ready: every tenant's NATS connection is up
//	GET  /metrics                Prometheus metrics
//
// A request is answered 202 once JetStream has stored it (the PubAck came
// back). Every tenant's requests are published over that tenant's own NATS
// connection and identity (DialTenant), so whatever its NATS account may
// not do, the gateway cannot do for it either. Request ids and Nats-Msg-Id
// headers are deterministic (see EventRequestID and msgID), so a
// redelivered event or webhook, on any replica, stores nothing new within
// JetStream's duplicate window; the gateway keeps no state of its own.
package gateway

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// RequestedType is the CloudEvents type the gateway accepts (DESIGN §3).
const RequestedType = "dev.buildq.build.requested.v1"

// Defaults of Options.
const (
	// DefaultMaxEventBytes caps a CloudEvent's HTTP body: a request is at
	// most v1.MaxRequestBytes (64 KiB), base64 and the envelope add to it.
	DefaultMaxEventBytes = 256 << 10
	// DefaultMaxWebhookBytes caps a webhook's body (push payloads list
	// commits and their files).
	DefaultMaxWebhookBytes = 8 << 20
	// DefaultPublishTimeout bounds the wait for a PubAck.
	DefaultPublishTimeout = 10 * time.Second
	// DefaultMaxInFlight caps the POST requests handled at once: their
	// bodies hold at most DefaultMaxInFlight × DefaultMaxWebhookBytes
	// (128 MiB) of memory.
	DefaultMaxInFlight = 16
)

// Options configure a Server.
type Options struct {
	// Tenants are the configured tenants (Settings.Tenants); in Open mode
	// there may be none.
	Tenants []*Tenant
	// Links are the tenants' own NATS connections, by tenant name.
	Links map[string]*Link
	// Shared, when set, publishes for every tenant without a link of its
	// own (`buildq dev`, whose NATS has no authentication).
	Shared *Link
	// MsgIDKey derives the Nats-Msg-Id nonces; at least MinMsgIDKeyBytes.
	MsgIDKey []byte
	// Open accepts CloudEvents without credentials, for the tenant the
	// request names (`buildq dev` on loopback only). Credentials that are
	// given are still checked.
	Open bool
	// MaxEventBytes and MaxWebhookBytes cap request bodies (413 beyond);
	// zero means DefaultMaxEventBytes and DefaultMaxWebhookBytes.
	MaxEventBytes   int64
	MaxWebhookBytes int64
	// PublishTimeout bounds the wait for a PubAck (DefaultPublishTimeout).
	PublishTimeout time.Duration
	// MaxInFlight caps the CloudEvents and webhooks handled at once
	// (DefaultMaxInFlight): one more is answered 503 at once, its body
	// unread, so no number of clients makes the gateway buffer more than
	// MaxInFlight bodies.
	MaxInFlight int
	// Registry receives the gateway's metrics and is served on /metrics;
	// nil: a registry of the server's own.
	Registry *prometheus.Registry
	Logger   *zap.Logger
	// Now is the clock (time.Now).
	Now func() time.Time
}

// Server is the gateway's HTTP handler.
type Server struct {
	opts    Options
	tenants map[string]*Tenant
	links   map[string]*Link
	shared  *Link
	log     *zap.Logger
	metrics *metrics
	mux     *http.ServeMux
	// inFlight holds a token per POST request being handled.
	inFlight chan struct{}
}

// New validates opts and returns the gateway's handler.
func New(opts Options) (*Server, error) {
	if len(opts.MsgIDKey) < MinMsgIDKeyBytes {
		return nil, fmt.Errorf("gateway: the Nats-Msg-Id key has %d bytes, want at least %d", len(opts.MsgIDKey), MinMsgIDKeyBytes)
	}
	s := &Server{opts: opts, tenants: map[string]*Tenant{}, links: map[string]*Link{}, shared: opts.Shared, log: opts.Logger}
	for _, t := range opts.Tenants {
		s.tenants[t.Name] = t
	}
	for name, l := range opts.Links {
		if s.tenants[name] == nil {
			return nil, fmt.Errorf("gateway: a NATS link for %q, which is no configured tenant", name)
		}
		s.links[name] = l
	}
	for name := range s.tenants {
		if s.links[name] == nil && s.shared == nil {
			return nil, fmt.Errorf("gateway: tenant %s has no NATS link", name)
		}
	}
	if s.opts.MaxEventBytes <= 0 {
		s.opts.MaxEventBytes = DefaultMaxEventBytes
	}
	if s.opts.MaxWebhookBytes <= 0 {
		s.opts.MaxWebhookBytes = DefaultMaxWebhookBytes
	}
	if s.opts.PublishTimeout <= 0 {
		s.opts.PublishTimeout = DefaultPublishTimeout
	}
	if s.opts.MaxInFlight <= 0 {
		s.opts.MaxInFlight = DefaultMaxInFlight
	}
	s.inFlight = make(chan struct{}, s.opts.MaxInFlight)
	if s.opts.Now == nil {
		s.opts.Now = time.Now
	}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	reg := opts.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	s.metrics = newMetrics(reg, s)

	mux := http.NewServeMux()
	mux.HandleFunc("POST /{$}", s.limited(routeEvents, s.handleEvent))
	mux.HandleFunc("POST /hooks/github/{tenant}", s.limited(routeGitHub, s.handleGitHub))
	mux.HandleFunc("POST /hooks/gitlab/{tenant}", s.limited(routeGitLab, s.handleGitLab))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", s.handleReady)
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	s.mux = mux
	return s, nil
}

// limited runs h while fewer than MaxInFlight requests are, and answers
// 503 (Retry-After) otherwise, before anything of the request is read.
func (s *Server) limited(route string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case s.inFlight <- struct{}{}:
			defer func() { <-s.inFlight }()
		default:
			w.Header().Set("Connection", "close")
			s.answer(w, r, route, "", outcomeBusy, http.StatusServiceUnavailable,
				problem{Error: fmt.Sprintf("the gateway is handling %d requests already; retry", s.opts.MaxInFlight)})
			return
		}
		h(w, r)
	}
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Ready returns nil when every link is connected, or an error naming the
// tenants whose NATS connection is down.
func (s *Server) Ready() error {
	var down []string
	for name, l := range s.links {
		if !l.Connected() {
			down = append(down, name)
		}
	}
	sort.Strings(down)
	if s.shared != nil && !s.shared.Connected() {
		down = append(down, "(shared)")
	}
	if len(down) > 0 {
		return fmt.Errorf("not ready: no NATS connection for tenant(s) %s", strings.Join(down, ", "))
	}
	return nil
}

func (s *Server) handleReady(w http.ResponseWriter, _ *http.Request) {
	if err := s.Ready(); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	_, _ = w.Write([]byte("ok\n"))
}

// link is the connection tenant's requests go over, or nil.
func (s *Server) link(tenant string) *Link {
	if l := s.links[tenant]; l != nil {
		return l
	}
	return s.shared
}

// tenantLabel is tenant as a metrics label: configured tenants by name,
// others (open mode) by name as well, never a string no tenant has.
func (s *Server) tenantLabel(tenant string) string {
	if tenant == "" || (s.tenants[tenant] == nil && !s.opts.Open) {
		return unknownTenant
	}
	return tenant
}

// errUnauthenticated: credentials were given and are not valid.
var errUnauthenticated = errors.New("the credentials name no tenant")

// authenticate returns the tenant a request's credentials name: a bearer
// token (compared by its SHA-256, in constant time, with every tenant's)
// or a verified client certificate's subject. It is "" without
// credentials, and errUnauthenticated with credentials that name no
// tenant (a bad token never falls back to the certificate).
func (s *Server) authenticate(r *http.Request) (string, error) {
	if h := r.Header.Get("Authorization"); h != "" {
		scheme, token, ok := strings.Cut(h, " ")
		if !ok || !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(token) == "" {
			return "", errUnauthenticated
		}
		sum := sha256.Sum256([]byte(strings.TrimSpace(token)))
		found := ""
		for _, t := range s.opts.Tenants {
			for _, want := range t.tokens {
				if subtle.ConstantTimeCompare(sum[:], want[:]) == 1 {
					found = t.Name
				}
			}
		}
		if found == "" {
			return "", errUnauthenticated
		}
		return found, nil
	}
	if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 && len(r.TLS.VerifiedChains[0]) > 0 {
		subject := r.TLS.VerifiedChains[0][0].Subject.String()
		for _, t := range s.opts.Tenants {
			for _, want := range t.subjects {
				if subject == want {
					return t.Name, nil
				}
			}
		}
		return "", errUnauthenticated
	}
	return "", nil
}

// publishRequest publishes req over its tenant's link with the
// deterministic Nats-Msg-Id, and says whether JetStream had it already.
func (s *Server) publishRequest(ctx context.Context, req *v1.Request) (bool, error) {
	l := s.link(req.Tenant)
	if l == nil {
		return false, fmt.Errorf("tenant %s: %w", req.Tenant, errNoSuchTenant)
	}
	b, err := json.Marshal(req)
	if err != nil {
		return false, fmt.Errorf("encode request: %w", err)
	}
	m := nats.NewMsg(v1.RequestSubject(req.Tenant))
	m.Header.Set(v1.MsgIDHeader, msgID(s.opts.MsgIDKey, req.Tenant, req.RequestID))
	m.Header.Set("Content-Type", "application/json")
	m.Data = b
	ctx, cancel := context.WithTimeout(ctx, s.opts.PublishTimeout)
	defer cancel()
	start := time.Now()
	var ack *jetstream.PubAck
	ack, err = l.publish(ctx, m)
	s.metrics.published(s.tenantLabel(req.Tenant), time.Since(start), err)
	if err != nil {
		return false, err
	}
	return ack.Duplicate, nil
}

var errNoSuchTenant = errors.New("no such tenant")

// problem is the JSON body of every refusal.
type problem struct {
	Error string `json:"error"`
	// Fields lists a request's invalid fields (422).
	Fields []fieldProblem `json:"fields,omitempty"`
	// AcceptedType is the CloudEvents type the gateway takes (400 for
	// another type).
	AcceptedType string `json:"acceptedType,omitempty"`
}

type fieldProblem struct {
	Field  string `json:"field"`
	Detail string `json:"detail"`
}

// reply writes a JSON answer.
func reply(w http.ResponseWriter, code int, body any) {
	b, err := json.Marshal(body)
	if err != nil {
		code, b = http.StatusInternalServerError, []byte(`{"error":"encoding the answer failed"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if code == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "5")
	}
	w.WriteHeader(code)
	_, _ = w.Write(append(b, '\n'))
}

// answer ends a request: it writes the reply, counts the outcome and logs
// it. Only names, ids and error texts the gateway wrote are logged: never
// a header, a body or a secret.
func (s *Server) answer(w http.ResponseWriter, r *http.Request, route, tenant, outcome string, code int, body any, fields ...zap.Field) {
	reply(w, code, body)
	s.metrics.requests.WithLabelValues(route, s.tenantLabel(tenant), outcome).Inc()
	fields = append(fields, zap.String("route", route), zap.String("tenant", s.tenantLabel(tenant)),
		zap.String("outcome", outcome), zap.Int("status", code), zap.String("remote", r.RemoteAddr))
	if p, ok := body.(problem); ok {
		fields = append(fields, zap.String("reason", p.Error))
	}
	switch {
	case code >= 500:
		s.log.Warn("request failed", fields...)
	case code >= 400:
		s.log.Info("request refused", fields...)
	default:
		s.log.Info("request answered", fields...)
	}
}

// publishFailure answers a failed publish.
func (s *Server) publishFailure(w http.ResponseWriter, r *http.Request, route, tenant string, err error, fields ...zap.Field) {
	fields = append(fields, zap.Error(err))
	if errors.Is(err, ErrDenied) {
		s.answer(w, r, route, tenant, outcomeDenied, http.StatusBadGateway,
			problem{Error: "NATS refused to store the request for tenant " + tenant + ": its NATS identity may not publish its request subject (an operator's configuration error)"}, fields...)
		return
	}
	msg := "NATS is unreachable or did not acknowledge the request; retry (a retry stores nothing twice)"
	if errors.Is(err, ErrNoStream) {
		msg = "no stream stores the tenant's requests yet (is a worker running?); retry later"
	}
	s.answer(w, r, route, tenant, outcomeUnavailable, http.StatusServiceUnavailable, problem{Error: msg}, fields...)
}
