package v1

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Build logs (DESIGN §3): every build run's log is kept in the JetStream
// stream BUILDQ_LOGS, one subject per run (LogsSubject), and archived to
// S3 once the run ends (LogRef). Tenants never read the stream: the
// tenant API's logs service (APILogsSubject) serves the log of a build
// only to a tenant one of whose requests it answered or waits on, or (by
// build key) whose request claimed it.
const (
	LogsStream    = "BUILDQ_LOGS"
	LogsPrefix    = "buildq.logs"
	APILogsPrefix = "buildq.api.logs"

	// LogStreamBuildq marks the lines buildq itself writes into a build's
	// log (claimed, created, attempt, truncated, finished); every other
	// stream name is the container (or executor) that printed the line.
	LogStreamBuildq = "buildq"
	// LogStreamLocal is the in-process executor of buildq dev.
	LogStreamLocal = "local"
)

// LogsSubject is the subject of one build run's log: buildq.logs.<key>.<run>.
func LogsSubject(key, run string) string { return LogsPrefix + "." + key + "." + run }

// APILogsSubject is tenant's logs service (request/reply, LogsRequest →
// LogsReply).
func APILogsSubject(tenant string) string { return APILogsPrefix + "." + tenant }

// ArchiveObject is the S3 object a run's log is archived to:
// logs/<tenant>/<key>/<run>.log.gz, tenant being the run's claimer.
func ArchiveObject(tenant, key, run string) string {
	return "logs/" + tenant + "/" + key + "/" + run + ".log.gz"
}

// LogRef is where a finished run's log is: carried by its build record and
// by the results it answers (data.logs).
type LogRef struct {
	Key string `json:"key"`
	Run string `json:"run"`
	// Bucket and Object locate the gzip archive (ArchiveObject); Digest is
	// the sha256 of the object's bytes as stored.
	Bucket string `json:"bucket,omitempty"`
	Object string `json:"object,omitempty"`
	Digest string `json:"digest,omitempty"`
	// Bytes and Lines measure the log itself (uncompressed).
	Bytes int64 `json:"bytes,omitempty"`
	Lines int64 `json:"lines,omitempty"`
	// Truncated: the log reached the per-build cap; a marker line says so.
	Truncated bool `json:"truncated,omitempty"`
	// Error says why the archive could not be written; the log is then
	// served from the stream until it ages out there.
	Error string `json:"error,omitempty"`
}

// Archived reports whether the log has an archive to read.
func (r *LogRef) Archived() bool { return r != nil && r.Object != "" && r.Error == "" }

// LogsRequest asks the logs service for a page of a build's log. A bare
// request id or build key as the payload is the first page.
type LogsRequest struct {
	// Target is a request id of the tenant, or a build key.
	Target string `json:"target"`
	// Cursor continues after the previous reply's (empty: from the start).
	Cursor string `json:"cursor,omitempty"`
	// WaitMs: with nothing new yet, wait up to this long for lines
	// (capped at MaxLogsWait) before replying.
	WaitMs int64 `json:"waitMs,omitempty"`
	// Since: only lines printed at or after it.
	Since time.Time `json:"since,omitzero"`
	// MaxBytes bounds the reply's lines (default and cap MaxLogsPage).
	MaxBytes int `json:"maxBytes,omitempty"`
}

// Limits of one logs request.
const (
	MaxLogsWait = 10 * time.Second
	MaxLogsPage = 512 << 10
)

// LogsReply is one page of a build's log.
type LogsReply struct {
	Key string `json:"key,omitempty"`
	Run string `json:"run,omitempty"`
	// Note heads the log of a request answered by a build it did not
	// start (it joined one, or was answered from the cache).
	Note string `json:"note,omitempty"`
	// Data holds whole log lines in the LogLine format, in order.
	Data []byte `json:"data,omitempty"`
	// Cursor continues the log in the next request.
	Cursor string `json:"cursor,omitempty"`
	// Done: the run ended and every line has been sent; State and Reason
	// are its outcome (succeeded, failed, canceled).
	Done   bool   `json:"done"`
	State  string `json:"state,omitempty"`
	Reason string `json:"reason,omitempty"`
	// Archive is the run's archive once written.
	Archive *LogRef `json:"archive,omitempty"`
	Error   string  `json:"error,omitempty"`
}

// LogLine is one line of a build's log. Stored and served as
// "<time RFC3339Nano> <stream> <attempt> <text>\n": Text holds the bytes
// the executor printed, unchanged (without their newline).
type LogLine struct {
	Time    time.Time `json:"time"`
	Stream  string    `json:"stream"`
	Attempt int       `json:"attempt"`
	Text    []byte    `json:"-"`
}

// Own reports whether buildq wrote the line (not the executor).
func (l LogLine) Own() bool { return l.Stream == LogStreamBuildq }

// AppendLogLine appends l in the stored format.
func AppendLogLine(dst []byte, l LogLine) []byte {
	dst = l.Time.UTC().AppendFormat(dst, time.RFC3339Nano)
	dst = append(dst, ' ')
	dst = append(dst, l.Stream...)
	dst = append(dst, ' ')
	dst = strconv.AppendInt(dst, int64(l.Attempt), 10)
	dst = append(dst, ' ')
	dst = append(dst, l.Text...)
	return append(dst, '\n')
}

// ParseLogLine reads one stored line (with or without its newline). Text
// aliases line.
func ParseLogLine(line []byte) (LogLine, error) {
	line = bytes.TrimSuffix(line, []byte("\n"))
	f := bytes.SplitN(line, []byte(" "), 4)
	if len(f) < 3 {
		return LogLine{}, fmt.Errorf("log line %q: want time, stream, attempt and text", truncateBytes(line, 80))
	}
	ts, err := time.Parse(time.RFC3339Nano, string(f[0]))
	if err != nil {
		return LogLine{}, fmt.Errorf("log line %q: %w", truncateBytes(line, 80), err)
	}
	n, err := strconv.Atoi(string(f[2]))
	if err != nil {
		return LogLine{}, fmt.Errorf("log line %q: attempt: %w", truncateBytes(line, 80), err)
	}
	l := LogLine{Time: ts, Stream: string(f[1]), Attempt: n}
	if len(f) == 4 {
		l.Text = f[3]
	}
	return l, nil
}

// EachLogLine calls fn for every line of data (stored format) until fn
// returns false or a line does not parse.
func EachLogLine(data []byte, fn func(LogLine) bool) error {
	for len(data) > 0 {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		l, err := ParseLogLine(line)
		if err != nil {
			return err
		}
		if !fn(l) {
			return nil
		}
	}
	return nil
}

func truncateBytes(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return strings.ToValidUTF8(string(b[:n]), "?") + "…"
}
