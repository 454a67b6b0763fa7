package main

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
)

// Issue 28, finding 6: `watch -o json` and `submit --wait -o json` print
// the same object for a result — its data (DESIGN §6 binds submit's) —
// watch one per line.
func TestWatchJSONIsSubmitsShape(t *testing.T) {
	t.Parallel()
	r := v1.NewResult("/test", v1.ResultData{RequestID: "r1", Tenant: "acme", Name: "web", Key: strings.Repeat("a", 64),
		Status: v1.StatusSucceeded, Origin: v1.OriginBuild, Digest: "sha256:" + strings.Repeat("b", 64)}, time.Now())
	var watched, submitted bytes.Buffer
	if err := printWatched(&watched, r, true); err != nil {
		t.Fatal(err)
	}
	if err := printResult(&submitted, &r, true); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(watched.String(), "\n"); n != 1 {
		t.Fatalf("watch -o json printed %d lines for one result: %q", n, watched.String())
	}
	var w, s map[string]any
	if err := json.Unmarshal(watched.Bytes(), &w); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(submitted.Bytes(), &s); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(w, s) {
		t.Fatalf("watch -o json %v\nsubmit -o json %v", w, s)
	}
	if w["requestId"] != "r1" || w["status"] != "succeeded" {
		t.Fatalf("not the result's data: %v", w)
	}
}

func TestReportGap(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	reportGap(&b, publisher.Gap{AfterSeq: 41, Replayed: 2})
	if got := b.String(); !strings.Contains(got, "2 result(s)") || !strings.Contains(got, "sequence 41") {
		t.Fatalf("filled gap: %q", got)
	}
	b.Reset()
	reportGap(&b, publisher.Gap{AfterSeq: 41, Err: publisher.ErrResultsLost})
	if got := b.String(); !strings.Contains(got, "may be missing") {
		t.Fatalf("lost gap: %q", got)
	}
}
