package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
)

// LogsConfig turns on build logs: each run's log is captured as the build
// goes into the stream BUILDQ_LOGS (one subject per run), archived to
// Archive once the run ends, and served to tenants by the tenant API's
// logs service.
type LogsConfig struct {
	Enabled bool
	// Cap bounds one run's log (default 10 MiB); past it a marker line
	// says the rest is not kept.
	Cap int64
	// MaxAge and MaxBytes bound the stream (default 24 h and 256 MiB,
	// buildlog.DefaultMaxAge and DefaultMaxBytes); the archive stays.
	MaxAge   time.Duration
	MaxBytes int64
	// Archive keeps finished logs (nil: only the stream keeps them, until
	// they age out there).
	Archive LogArchive
	// Retention: archived logs older than this are deleted (0: kept),
	// when Archive can list them (an ExpireLogs method).
	Retention time.Duration
}

// logExpirer is an archive that deletes logs older than a cutoff.
type logExpirer interface {
	ExpireLogs(ctx context.Context, cutoff time.Time) (int, error)
}

// logRetentionEvery is how often a worker deletes expired log archives.
const logRetentionEvery = time.Hour

// expireLogs deletes the archived logs past their retention.
func (l *buildLogs) expireLogs(ctx context.Context) {
	e, ok := l.cfg.Logs.Archive.(logExpirer)
	if !ok || l.cfg.Logs.Retention <= 0 {
		return
	}
	n, err := e.ExpireLogs(ctx, l.cfg.Now().Add(-l.cfg.Logs.Retention))
	if err != nil {
		l.log.Warn("deleting expired build logs failed", zap.Error(err))
	}
	if n > 0 {
		l.log.Info("deleted expired build logs", zap.Int("count", n), zap.Duration("retention", l.cfg.Logs.Retention))
	}
}

// Defaults of LogsConfig.
const (
	DefaultBuildLogCap       = buildlog.DefaultCap
	DefaultLogStreamMaxAge   = buildlog.DefaultMaxAge
	DefaultLogStreamMaxBytes = buildlog.DefaultMaxBytes
)

// LogArchive keeps finished logs: s3store.Store implements it.
type LogArchive interface {
	// PutLog stores data as object and returns its bucket.
	PutLog(ctx context.Context, object string, data []byte) (bucket string, err error)
	// Open reads an object.
	Open(ctx context.Context, bucket, key string) (io.ReadCloser, error)
}

// LogWriter is a run's log as a backend writes it (nil: not captured).
type LogWriter = *buildlog.Writer

// buildLogs opens and ends runs' logs.
type buildLogs struct {
	cfg    *Config
	reader *buildlog.Reader
	log    *zap.Logger
	// openLog opens the writer of a run's log; fresh: the run was
	// claimed just now, nothing is stored under it (buildlog.OpenNew).
	openLog func(ctx context.Context, key, run string, fresh bool, opts buildlog.Options) (*buildlog.Writer, error)
}

// open returns the writer of claim's run, or nil when logs are off or
// the stream cannot be read (the build goes on without its log; a
// warning says so). fresh: the run was claimed just now under a new run
// id, so its log is empty and is not read.
func (l *buildLogs) open(ctx context.Context, claim *v1.BuildRecord, req *v1.Request, fresh bool) *buildlog.Writer {
	if l == nil || !l.cfg.Logs.Enabled {
		return nil
	}
	mask := secretValues(req, claim)
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	lw, err := l.openLog(octx, claim.Key, claim.Run, fresh, buildlog.Options{Cap: l.cfg.Logs.Cap, Mask: mask, Now: l.cfg.Now,
		Object: v1.ArchiveObject(claim.Tenant, claim.Key, claim.Run), Stored: l.cfg.Metrics.logStored})
	if err != nil {
		l.log.Warn("the build's log is not captured: its stream cannot be read", zap.String("key", claim.Key), zap.String("run", claim.Run), zap.Error(err))
		return nil
	}
	return lw
}

// secretValues are the values of the build arguments that req or the
// run's claimer marked secret (one key, so the same values).
func secretValues(req *v1.Request, claim *v1.BuildRecord) []string {
	var out []string
	for _, names := range [][]string{req.SecretBuildArgs, claim.SecretBuildArgs} {
		for _, k := range names {
			if v := req.BuildArgs[k]; v != "" {
				out = append(out, v)
			}
		}
	}
	return out
}

// maskSecrets masks the secret build argument values in s (a result's
// message or log tail).
func maskSecrets(s string, secrets []string) string {
	if len(secrets) == 0 || s == "" {
		return s
	}
	return string(buildlog.Mask([]byte(s), secrets))
}

// endRun ends and archives the log of a run ended from outside its owner
// (a cancel): final is its final record.
func (l *buildLogs) endRun(ctx context.Context, final *v1.BuildRecord) {
	lw := l.open(ctx, final, &v1.Request{Tenant: final.Tenant, Name: final.Name, RequestID: final.RequestID}, false)
	l.finish(ctx, lw, final)
}

// logArchiveAttempts bounds the tries to archive a log.
const logArchiveAttempts = 3

// finish ends the log of the run rec ended (its final record) and
// archives it. The reference says where the archive is, or why there is
// none: an archive that cannot be written is never silent.
func (l *buildLogs) finish(ctx context.Context, lw *buildlog.Writer, rec *v1.BuildRecord) *v1.LogRef {
	if lw == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	state, reason := rec.State, rec.Reason
	if reason == v1.ReasonCanceled {
		state, reason = string(v1.StatusCanceled), ""
	}
	err := lw.End(ctx, state, reason)
	if errors.Is(err, buildlog.ErrConflict) && lw.Ended() {
		err = nil // another writer stored the end (a cancel's)
	}
	if err != nil {
		l.log.Warn("the end of the build's log was not stored", zap.String("key", rec.Key), zap.String("run", rec.Run), zap.Error(err))
		l.cfg.Metrics.logArchived("failed")
		return &v1.LogRef{Key: rec.Key, Run: rec.Run, Error: "the end of the log was not stored: " + err.Error()}
	}
	object := v1.ArchiveObject(rec.Tenant, rec.Key, rec.Run)
	if l.cfg.Logs.Archive == nil {
		return &v1.LogRef{Key: rec.Key, Run: rec.Run}
	}

	for attempt := 1; attempt <= logArchiveAttempts; attempt++ {
		var ref *v1.LogRef
		if ref, err = buildlog.Store(ctx, l.reader, l.cfg.Logs.Archive, rec.Key, rec.Run, object); err == nil {
			l.cfg.Metrics.logArchived("archived")
			return ref
		}
		if attempt < logArchiveAttempts {
			select {
			case <-time.After(time.Duration(attempt) * time.Second):
			case <-ctx.Done():
			}
		}
	}
	l.log.Warn("the build's log was not archived; the stream keeps it until it ages out",
		zap.String("key", rec.Key), zap.String("run", rec.Run), zap.String("object", object), zap.Error(err))
	l.cfg.Metrics.logArchived("failed")
	return &v1.LogRef{Key: rec.Key, Run: rec.Run, Object: object, Error: fmt.Sprint("not archived: ", err)}
}
