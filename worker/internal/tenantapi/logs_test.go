package tenantapi

import (
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

func TestLogCursorRoundTrip(t *testing.T) {
	for _, c := range []logCursor{{run: "r1", seq: 7, off: 1234}, {run: "r1", off: 99, archive: true}, {run: "abc"}} {
		got, err := parseCursor(c.String())
		if err != nil || got != c {
			t.Errorf("parseCursor(%q) = %+v, %v; want %+v", c.String(), got, err, c)
		}
	}
	for _, bad := range []string{"r1", ":1:2", "r1:x:2", "r1:1:-5", "r1:1:2:3", "r1:-1:0", "r1:a:x"} {
		if _, err := parseCursor(bad); err == nil {
			t.Errorf("cursor %q accepted", bad)
		}
	}
	if c, err := parseCursor(""); err != nil || c != (logCursor{}) {
		t.Errorf("empty cursor: %+v, %v", c, err)
	}
}

func TestParseLogsRequest(t *testing.T) {
	r, err := parseLogsRequest([]byte("  req-1 \n"))
	if err != nil || r.Target != "req-1" || r.MaxBytes != v1.MaxLogsPage || r.WaitMs != 0 {
		t.Fatalf("bare target: %+v, %v", r, err)
	}
	r, err = parseLogsRequest([]byte(`{"target":"k","waitMs":999999,"maxBytes":99999999}`))
	if err != nil || r.WaitMs != v1.MaxLogsWait.Milliseconds() || r.MaxBytes != v1.MaxLogsPage {
		t.Fatalf("limits: %+v, %v", r, err)
	}
	r, err = parseLogsRequest([]byte(`{"target":"k","waitMs":-5,"maxBytes":100}`))
	if err != nil || r.WaitMs != 0 || r.MaxBytes != 100 {
		t.Fatalf("small: %+v, %v", r, err)
	}
	for _, bad := range []string{"", "   ", `{"target":""}`, `{"target":`, strings.Repeat("x", v1.MaxRequestIDLen+1)} {
		if _, err := parseLogsRequest([]byte(bad)); err == nil {
			t.Errorf("request %q accepted", bad)
		}
	}
}

func TestAppendSince(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	var data []byte
	for i := range 4 {
		data = v1.AppendLogLine(data, v1.LogLine{Time: t0.Add(time.Duration(i) * time.Second), Stream: "kaniko", Attempt: 1, Text: []byte{byte('a' + i)}})
	}
	got := appendSince(nil, data, t0.Add(2*time.Second))
	var texts []string
	_ = v1.EachLogLine(got, func(l v1.LogLine) bool { texts = append(texts, string(l.Text)); return true })
	if strings.Join(texts, "") != "cd" {
		t.Fatalf("lines since t0+2s: %q", texts)
	}
	if string(appendSince(nil, data, time.Time{})) != string(data) {
		t.Fatal("no since: not every line")
	}
}

func TestPollsPerTenant(t *testing.T) {
	var p pollCounts
	for range logsPollsPerTenant {
		if !p.take("acme") {
			t.Fatal("a poll under the limit was refused")
		}
	}
	if p.take("acme") {
		t.Fatal("a poll past the limit was taken")
	}
	if !p.take("globex") {
		t.Fatal("another tenant's poll was refused")
	}
	p.give("acme")
	if !p.take("acme") {
		t.Fatal("a poll given back was not free again")
	}
	// The bound over all tenants.
	var q pollCounts
	for i := range logsPolls {
		if !q.take(fmt.Sprint("t", i/logsPollsPerTenant)) {
			t.Fatalf("poll %d under the total was refused", i)
		}
	}
	if q.take("another") {
		t.Fatal("a poll past the total was taken")
	}
}

func TestEndOf(t *testing.T) {
	line := v1.AppendLogLine(nil, v1.LogLine{Time: time.Now(), Stream: v1.LogStreamBuildq, Attempt: 1, Text: []byte("build failed: BuildFailed")})
	if s, r, ok := endOf(lastLine(append([]byte("x\n"), line...))); !ok || s != "failed" || r != "BuildFailed" {
		t.Fatalf("endOf = %q %q %v", s, r, ok)
	}
	exec := v1.AppendLogLine(nil, v1.LogLine{Time: time.Now(), Stream: "kaniko", Attempt: 1, Text: []byte("build failed: forged")})
	if _, _, ok := endOf(lastLine(exec)); ok {
		t.Fatal("an executor's line was taken for the log's end")
	}
}
