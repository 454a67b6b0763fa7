package devstack

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/handlers"
	// Registers the "filesystem" storage driver with the driver factory.
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
	"github.com/sirupsen/logrus"
	"go.uber.org/zap"
)

// registryServer is the distribution registry app behind our own
// http.Server.
//
// registry.NewRegistry is not used: its ListenAndServe opens its own
// listener (so a busy port or port 0 could not be handled the way the other
// services are), it registers health checks in a process-global registry
// ("can only be called once per process", which breaks restarts and
// parallel tests), starts OpenTelemetry and rewires the global logrus
// formatter. handlers.NewApp plus a plain http.Server shuts down cleanly with
// Shutdown + App.Shutdown.
type registryServer struct {
	app     *handlers.App
	log     *zap.Logger
	unroute func()

	http *httpServer
}

// newRegistry builds the registry app on filesystem storage under dir.
func newRegistry(dir string, log *zap.Logger) (_ *registryServer, err error) {
	l := log.Named("registry")
	// Route logrus before NewApp: it logs while it sets up.
	unroute := routeLogrus(l)
	defer func() {
		if err != nil {
			unroute()
		}
	}()

	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return nil, fmt.Errorf("registry: http secret: %w", err)
	}

	// The configuration is built in code rather than with
	// configuration.Parse, which would also apply REGISTRY_* environment
	// variables: a developer's environment must not silently change the
	// storage or address of the dev registry. The defaults Parse would fill
	// in are set by hand.
	cfg := &configuration.Configuration{}
	cfg.Storage = configuration.Storage{
		"filesystem": configuration.Parameters{"rootdirectory": dir},
		// Deleting manifests is allowed so tests and users can clean up.
		"delete": configuration.Parameters{"enabled": true},
		// The purger only removes week-old partial uploads; it is not
		// worth a background goroutine in a dev stack.
		"maintenance": configuration.Parameters{
			"uploadpurging": map[any]any{"enabled": false},
		},
		// The filesystem driver cannot redirect anyway; saying so skips
		// the attempt on every blob fetch.
		"redirect": configuration.Parameters{"disable": true},
	}
	// The secret signs blob upload state. A fresh one per start is fine:
	// an upload interrupted by a restart is simply retried by the client.
	cfg.HTTP.Secret = hex.EncodeToString(secret)
	cfg.HTTP.Headers = http.Header{"X-Content-Type-Options": []string{"nosniff"}}
	cfg.Catalog.MaxEntries = 1000
	cfg.Tags.MaxTags = 1000
	cfg.Log.AccessLog.Disabled = true

	app, err := newApp(cfg)
	if err != nil {
		return nil, err
	}
	return &registryServer{app: app, log: l, unroute: unroute}, nil
}

// newApp wraps handlers.NewApp, which reports configuration and storage
// errors by panicking.
func newApp(cfg *configuration.Configuration) (app *handlers.App, err error) {
	defer func() {
		if r := recover(); r != nil {
			app, err = nil, fmt.Errorf("registry: %v", r)
		}
	}()
	return handlers.NewApp(context.Background(), cfg), nil
}

// serve starts the HTTP server on ln in the background.
func (r *registryServer) serve(ln net.Listener) {
	r.http = serveHTTP("registry", ln, r.app, r.log)
}

// shutdown stops the HTTP server, then the app (which cancels its context),
// then gives logrus back.
func (r *registryServer) shutdown() error {
	err := r.http.shutdown()
	err = errors.Join(err, r.app.Shutdown())
	r.unroute()
	return err
}

// The registry logs through the logrus standard logger (it keeps no logger
// of its own that could be replaced from outside its internal packages), so
// the only way to keep its output off stderr is to reconfigure that global
// logger. While at least one Stack runs, logrus output is discarded and its
// entries are forwarded at debug level to the newest running Stack's zap
// logger; when the last Stack closes, the previous output, formatter, level
// and hooks are put back.
var logrusRoute logrusRouter

type logrusRouter struct {
	mu     sync.Mutex
	active []*zap.Logger // loggers of running stacks, newest last
	target atomic.Pointer[zap.Logger]

	savedOut       io.Writer
	savedFormatter logrus.Formatter
	savedLevel     logrus.Level
	savedHooks     logrus.LevelHooks
}

// routeLogrus starts forwarding logrus to l and returns the function that
// stops it (idempotent).
func routeLogrus(l *zap.Logger) (unroute func()) {
	r := &logrusRoute
	r.mu.Lock()
	defer r.mu.Unlock()
	std := logrus.StandardLogger()
	if len(r.active) == 0 {
		r.savedOut = std.Out
		r.savedFormatter = std.Formatter
		r.savedLevel = std.GetLevel()
		// ReplaceHooks is the only locked way to read the hooks; keep the
		// existing ones and add ours.
		r.savedHooks = std.ReplaceHooks(make(logrus.LevelHooks))
		hooks := make(logrus.LevelHooks, len(r.savedHooks))
		for lvl, hs := range r.savedHooks {
			hooks[lvl] = slices.Clone(hs)
		}
		hooks.Add(zapHook{})
		std.ReplaceHooks(hooks)
		std.SetOutput(io.Discard)
		std.SetFormatter(discardFormatter{})
	}
	r.active = append(r.active, l)
	r.retarget()

	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			if i := slices.Index(r.active, l); i >= 0 {
				r.active = slices.Delete(r.active, i, i+1)
			}
			if len(r.active) > 0 {
				r.retarget()
				return
			}
			r.target.Store(nil)
			std.ReplaceHooks(r.savedHooks)
			std.SetFormatter(r.savedFormatter)
			std.SetOutput(r.savedOut)
			std.SetLevel(r.savedLevel)
			r.savedHooks, r.savedFormatter, r.savedOut = nil, nil, nil
		})
	}
}

// retarget points the hook at the newest logger and sets the logrus level so
// that entries are only built when that logger would keep them. Called with
// mu held and at least one active logger.
func (r *logrusRouter) retarget() {
	l := r.active[len(r.active)-1]
	r.target.Store(l)
	level := logrus.PanicLevel // nothing but panics, which logrus raises anyway
	if l.Core().Enabled(zap.DebugLevel) {
		level = logrus.DebugLevel
	}
	logrus.StandardLogger().SetLevel(level)
}

// zapHook forwards logrus entries to the current target at debug level.
type zapHook struct{}

func (zapHook) Levels() []logrus.Level { return logrus.AllLevels }

func (zapHook) Fire(e *logrus.Entry) error {
	l := logrusRoute.target.Load()
	if l == nil {
		return nil
	}
	if ce := l.Check(zap.DebugLevel, e.Message); ce != nil {
		fields := make([]zap.Field, 0, len(e.Data)+1)
		fields = append(fields, zap.String("logrus_level", e.Level.String()))
		for k, v := range e.Data {
			fields = append(fields, zap.Any(k, v))
		}
		ce.Write(fields...)
	}
	return nil
}

// discardFormatter skips formatting: the output is io.Discard anyway.
type discardFormatter struct{}

func (discardFormatter) Format(*logrus.Entry) ([]byte, error) { return nil, nil }
