package main

import (
	"time"

	"github.com/spf13/pflag"

	"github.com/buildq/buildq/worker"
)

// registerBuildLogs registers the build-log flags of `buildq worker` and
// `buildq dev`.
func registerBuildLogs(fs *pflag.FlagSet, l *worker.LogsConfig) {
	fs.BoolVar(&l.Enabled, "build-logs", true, "capture every build's log into the stream BUILDQ_LOGS and archive it to S3 when the build ends (buildq logs reads them)")
	fs.Int64Var(&l.Cap, "build-log-cap", worker.DefaultBuildLogCap, "bytes of one build's log kept; past them a marker line says the rest is not kept")
	fs.DurationVar(&l.MaxAge, "build-log-stream-max-age", worker.DefaultLogStreamMaxAge, "how long BUILDQ_LOGS keeps a log (the archive keeps it afterwards)")
	fs.Int64Var(&l.MaxBytes, "build-log-stream-max-bytes", worker.DefaultLogStreamMaxBytes, "size of BUILDQ_LOGS; the oldest logs go first")
	fs.DurationVar(&l.Retention, "build-log-retention", 30*24*time.Hour, "archived logs (logs/ in the context bucket) older than this are deleted (0: kept forever; an S3 lifecycle rule on logs/ does the same)")
}

// checkBuildLogs validates the build-log flags.
func checkBuildLogs(l worker.LogsConfig) error {
	if l.Cap < 64<<10 {
		return usageErr("--build-log-cap must be at least 65536 bytes, got %d", l.Cap)
	}
	if l.MaxAge < time.Minute || l.MaxBytes < 1<<20 || l.Retention < 0 {
		return usageErr("--build-log-stream-max-age must be at least 1m, --build-log-stream-max-bytes at least 1 MiB, --build-log-retention not negative")
	}
	if l.Cap > l.MaxBytes {
		// The stream drops the oldest logs first: one build's log larger
		// than the stream could never be archived whole.
		return usageErr("--build-log-cap (%d bytes) must not exceed --build-log-stream-max-bytes (%d)", l.Cap, l.MaxBytes)
	}
	return nil
}
