package benchfmt

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	ten := []float64{10, 9, 8, 7, 6, 5, 4, 3, 2, 1}
	hundred := make([]float64, 100)
	for i := range hundred {
		hundred[i] = float64(100 - i)
	}
	for _, tc := range []struct {
		name string
		xs   []float64
		p    float64
		want float64
	}{
		{"no samples", nil, 50, 0},
		{"no samples p100", []float64{}, 100, 0},
		{"one sample p50", []float64{7}, 50, 7},
		{"one sample p99", []float64{7}, 99, 7},
		{"one sample p100", []float64{7}, 100, 7},
		{"ten p50", ten, 50, 5},  // rank ⌈5⌉ = 5
		{"ten p99", ten, 99, 10}, // rank ⌈9.9⌉ = 10
		{"ten p100", ten, 100, 10},
		{"ten p1", ten, 1, 1}, // rank ⌈0.1⌉ = 1
		{"ten p51", ten, 51, 6},
		{"hundred p50", hundred, 50, 50},
		{"hundred p99", hundred, 99, 99},
		{"hundred p100", hundred, 100, 100},
		{"two p50", []float64{2, 1}, 50, 1},
		{"two p99", []float64{2, 1}, 99, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			xs := slices.Clone(tc.xs)
			if got := Percentile(xs, tc.p); got != tc.want {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tc.xs, tc.p, got, tc.want)
			}
			if !slices.IsSorted(xs) {
				t.Errorf("samples not sorted in place: %v", xs)
			}
		})
	}
}

func TestCompared(t *testing.T) {
	r := Compared("p50", "ms", 13, 10)
	if r.Metric != "p50" || r.Unit != "ms" || r.Value != 13 {
		t.Errorf("Compared = %+v", r)
	}
	if r.Baseline == nil || *r.Baseline != 10 {
		t.Errorf("baseline = %v, want 10", r.Baseline)
	}
	if r.Ratio == nil || *r.Ratio != 1.3 {
		t.Errorf("ratio = %v, want 1.3", r.Ratio)
	}

	// A zero baseline has no ratio, but is still reported.
	z := Compared("GETs", "per build", 2, 0)
	if z.Baseline == nil || *z.Baseline != 0 {
		t.Errorf("zero baseline = %v, want 0", z.Baseline)
	}
	if z.Ratio != nil {
		t.Errorf("zero baseline has ratio %v", *z.Ratio)
	}

	if p := Plain("Jobs", "", 1000); p.Baseline != nil || p.Ratio != nil {
		t.Errorf("Plain has a baseline or a ratio: %+v", p)
	}
}

func TestWriteRead(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "results") // Write creates it
	t.Setenv(EnvDir, dir)

	in := Result{
		ID:       "P1",
		Title:    "publish → Job visible in the API",
		Baseline: "a bare program",
		Rows:     []Row{Compared("p50", "ms", 12, 10), Plain("requests", "", 500)},
		Goal:     "within 1.3× the baseline",
		Met:      Bool(true),
		Notes:    []string{"a note"},
		Series: []Series{{Name: "buildq", XLabel: "load", YLabel: "latency",
			Points: []Point{{X: 1, Y: 2}, {X: 3, Y: 4}}}},
		Seconds: 12.5,
	}
	before := time.Now().UTC().Truncate(time.Second)
	path, err := Write(in)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "p1.json"); path != want {
		t.Errorf("Write wrote %s, want %s", path, want)
	}

	got, err := Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 {
		t.Fatalf("Read returned %d results, want 1", len(got))
	}
	out := got[0]
	if out.Date.Before(before) || out.Date.After(time.Now()) || out.Date.Nanosecond() != 0 {
		t.Errorf("date %v: not now, to the second", out.Date)
	}
	if out.Machine != ThisMachine() {
		t.Errorf("machine %+v, want %+v", out.Machine, ThisMachine())
	}
	in.Date, in.Machine = out.Date, out.Machine
	if !reflect.DeepEqual(out, in) {
		t.Errorf("round trip:\n got %+v\nwant %+v", out, in)
	}

	// A date already set is kept.
	fixed := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	if _, err := Write(Result{ID: "P2", Date: fixed}); err != nil {
		t.Fatal(err)
	}
	got, err = Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || !got[1].Date.Equal(fixed) {
		t.Errorf("P2 date not kept: %+v", got)
	}
}

func TestWriteUnset(t *testing.T) {
	t.Setenv(EnvDir, "")
	path, err := Write(Result{ID: "P1"})
	if path != "" || err != nil {
		t.Errorf("Write with %s unset = %q, %v; want nothing written", EnvDir, path, err)
	}
}

func TestReadOrder(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(EnvDir, dir)
	for _, id := range []string{"P10", "P3", "P9", "P1", "P2", "P5", "P4", "P8", "P6", "P7"} {
		if _, err := Write(Result{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	got, err := Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, r := range got {
		ids = append(ids, r.ID)
	}
	if want := []string{"P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9", "P10"}; !slices.Equal(ids, want) {
		t.Errorf("Read order %v, want %v", ids, want)
	}
}

func TestReadErrors(t *testing.T) {
	empty, err := Read(t.TempDir())
	if err != nil || len(empty) != 0 {
		t.Errorf("Read of an empty directory = %v, %v", empty, err)
	}

	dir := t.TempDir()
	bad := filepath.Join(dir, "p1.json")
	if err := os.WriteFile(bad, []byte(`{"id": `), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(dir); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("Read of bad JSON: error %v does not name %s", err, bad)
	}
}
