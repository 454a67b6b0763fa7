package main

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/buildq/buildq/internal/benchfmt"
)

var (
	testDate    = time.Date(2026, 5, 4, 10, 30, 0, 0, time.UTC)
	testMachine = benchfmt.Machine{CPUs: 2, MemoryMiB: 7960, CPUModel: "Test CPU @ 2.0GHz", GoVersion: "go1.26.8", OS: "linux/amd64"}
)

// fixture is P1 (goal met, with series), P4 (goal missed), P8 (no
// baseline, no goal judged) and P10; P2, P3, P5, P6, P7 and P9 are missing.
func fixture() []benchfmt.Result {
	return []benchfmt.Result{
		{
			ID:       "P1",
			Title:    "publish → Job visible in the API",
			Baseline: "a bare program: JetStream publish → fetch → Job create",
			Rows: []benchfmt.Row{
				benchfmt.Compared("p50", "ms", 12.345, 11),
				benchfmt.Compared("p99", "ms", 40, 32),
				benchfmt.Plain("requests", "", 2000),
			},
			Goal:  "within 1.3× the baseline",
			Met:   benchfmt.Bool(true),
			Notes: []string{"first note", "second | note"},
			Series: []benchfmt.Series{
				{Name: "buildq p50", XLabel: "offered load (requests/s)", YLabel: "latency (ms)",
					Points: []benchfmt.Point{{X: 20, Y: 14}, {X: 10, Y: 12}, {X: 40, Y: 20}}},
				{Name: "baseline p50", XLabel: "offered load (requests/s)", YLabel: "latency (ms)",
					Points: []benchfmt.Point{{X: 10, Y: 11}, {X: 20, Y: 12}, {X: 40, Y: 15}}},
			},
			Machine: testMachine, Date: testDate, Seconds: 61.4,
		},
		{
			ID:       "P4",
			Title:    "Kubernetes API requests per build",
			Baseline: "the minimum: one create, one delete",
			Rows: []benchfmt.Row{
				benchfmt.Compared("mutating calls", "per build", 3, 2),
				benchfmt.Plain("GETs", "per build", 0.25),
			},
			Goal:    "≤ 2 mutating calls and 0 GETs per build",
			Met:     benchfmt.Bool(false),
			Machine: testMachine, Date: testDate,
		},
		{
			ID:    "P8",
			Title: "10,000 queued requests over 1,000 keys",
			Rows: []benchfmt.Row{
				benchfmt.Plain("Jobs", "", 1000),
				benchfmt.Plain("worker RSS", "MiB", 96.04),
			},
			Series: []benchfmt.Series{
				{Name: "end-to-end", XLabel: "queued requests", YLabel: "latency (s)",
					Points: []benchfmt.Point{{X: 1000, Y: 0.5}, {X: 10000, Y: 2.5}}},
				{Name: "empty", XLabel: "queued requests", YLabel: "latency (s)"},
			},
			Machine: testMachine, Date: testDate,
		},
		{
			ID:      "P10",
			Title:   "an extra figure",
			Machine: testMachine, Date: testDate,
		},
	}
}

func writeResults(t *testing.T, results []benchfmt.Result) string {
	t.Helper()
	dir := t.TempDir()
	for _, r := range results {
		b, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, strings.ToLower(r.ID)+".json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

type outputs struct {
	md, svg, stderr string
	svgWritten      bool
}

func render(t *testing.T, results []benchfmt.Result) outputs {
	t.Helper()
	in := writeResults(t, results)
	out := t.TempDir()
	mdPath, svgPath := filepath.Join(out, "benchmarks.md"), filepath.Join(out, "benchmarks.svg")
	var stderr bytes.Buffer
	if err := run([]string{"-in", in, "-md", mdPath, "-svg", svgPath}, &stderr); err != nil {
		t.Fatalf("run: %v\nstderr:\n%s", err, stderr.String())
	}
	md, err := os.ReadFile(mdPath)
	if err != nil {
		t.Fatal(err)
	}
	o := outputs{md: string(md), stderr: stderr.String()}
	if svg, err := os.ReadFile(svgPath); err == nil {
		o.svg, o.svgWritten = string(svg), true
	} else if !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return o
}

func TestMarkdown(t *testing.T) {
	o := render(t, fixture())
	md := o.md

	for _, want := range []string{
		header + "\n",
		"`make bench-e2e`",
		"`make bench-scale`",
		"Machine: 2 CPUs, 7.8 GiB memory, Test CPU @ 2.0GHz, go1.26.8, linux/amd64.\n",
		// Summary: the figures with a baseline, or the first one.
		"| id | what | figure | value | baseline | ratio | goal | met |\n",
		"| P1 | publish → Job visible in the API | p50 | 12.3 ms | 11 ms | 1.12× | within 1.3× the baseline | yes |\n",
		"| P1 |  | p99 | 40 ms | 32 ms | 1.25× |  |  |\n",
		"| P4 | Kubernetes API requests per build | mutating calls | 3 per build | 2 per build | 1.50× | ≤ 2 mutating calls and 0 GETs per build | **no** |\n",
		"| P8 | 10,000 queued requests over 1,000 keys | Jobs | 1,000 | — | — | — | — |\n",
		"| P10 | an extra figure | — | — | — | — | — | — |\n",
		// Missing figures, with the target that measures them.
		"P2: not measured yet — run `make bench-e2e`\n",
		"P7: not measured yet — run `make bench-e2e`\n",
		"P9: not measured yet — run `make bench-scale`\n",
		// Sections.
		"## P1: publish → Job visible in the API\n\nMeasured 2026-05-04 10:30 UTC, in 1m1s.\n",
		"Baseline, measured in the same run: a bare program: JetStream publish → fetch → Job create.\n",
		"| figure | value | baseline | ratio |\n|---|---|---|---|\n| p50 | 12.3 ms | 11 ms | 1.12× |\n| p99 | 40 ms | 32 ms | 1.25× |\n| requests | 2,000 | — | — |\n",
		"Goal: within 1.3× the baseline — met: yes\n",
		"- first note\n- second | note\n",
		"Goal: ≤ 2 mutating calls and 0 GETs per build — met: **no**\n",
		"| GETs | 0.25 per build | — | — |\n",
		"## P8: 10,000 queued requests over 1,000 keys\n\nMeasured 2026-05-04 10:30 UTC.\n\nNo baseline: the figures are absolute.\n\n| figure | value |\n|---|---|\n| Jobs | 1,000 |\n| worker RSS | 96 MiB |\n",
		"Plotted in [benchmarks.svg](benchmarks.svg): buildq p50, baseline p50.\n",
		"## P10: an extra figure\n",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
	for _, unwanted := range []string{
		"P1: not measured", "P4: not measured", "P8: not measured",
		"| P4 |  | GETs", // no baseline: not in the summary
		"on 2 CPUs",      // one machine: said once, at the top
	} {
		if strings.Contains(md, unwanted) {
			t.Errorf("markdown has %q", unwanted)
		}
	}
	if !strings.HasSuffix(md, "\n") || strings.HasSuffix(md, "\n\n") {
		t.Error("markdown does not end in exactly one newline")
	}
	if i, j := strings.Index(md, "## P8"), strings.Index(md, "## P10"); i < 0 || j < i {
		t.Errorf("P10 is not after P8")
	}
	if !strings.Contains(o.stderr, "P8 empty") {
		t.Errorf("stderr does not name the series without points: %q", o.stderr)
	}

	// The same input gives the same bytes.
	again := render(t, fixture())
	if again.md != md {
		t.Error("markdown differs between two runs on the same input")
	}
	if again.svg != o.svg {
		t.Error("SVG differs between two runs on the same input")
	}
}

func TestMachinePerResult(t *testing.T) {
	rs := fixture()
	rs[1].Machine.CPUs = 4
	md := render(t, rs).md
	if strings.Contains(md, "Machine:") {
		t.Error("machines differ but one is printed at the top")
	}
	for _, want := range []string{
		"Measured 2026-05-04 10:30 UTC, in 1m1s, on 2 CPUs, 7.8 GiB memory, Test CPU @ 2.0GHz, go1.26.8, linux/amd64.\n",
		"Measured 2026-05-04 10:30 UTC, on 4 CPUs, 7.8 GiB memory,",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q", want)
		}
	}
}

func TestSVG(t *testing.T) {
	rs := fixture()
	// A second pair of axis labels makes a second panel.
	rs[0].Series = append(rs[0].Series, benchfmt.Series{
		Name: "queue depth", XLabel: "offered load (requests/s)", YLabel: "messages",
		Points: []benchfmt.Point{{X: 10, Y: 1}, {X: 40, Y: 7}},
	})
	o := render(t, rs)
	if !o.svgWritten {
		t.Fatal("no SVG written")
	}
	paths, dashed := 0, 0
	texts := map[string]bool{}
	dec := xml.NewDecoder(strings.NewReader(o.svg))
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG does not parse as XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if el.Name.Local == "path" {
				paths++
				for _, a := range el.Attr {
					if a.Name.Local == "style" && strings.Contains(a.Value, "stroke-dasharray:6") {
						dashed++
					}
				}
			}
		case xml.CharData:
			texts[strings.TrimSpace(string(el))] = true
		}
	}
	if paths == 0 {
		t.Error("SVG has no <path>")
	}
	if dashed == 0 {
		t.Error("the baseline series is not dashed")
	}
	for _, want := range []string{title, "P1 buildq p50", "P1 baseline p50", "P8 end-to-end", "latency (ms)", "messages", "latency (s)"} {
		if !texts[want] {
			t.Errorf("SVG has no text %q", want)
		}
	}
}

func TestNoSeries(t *testing.T) {
	rs := fixture()
	for i := range rs {
		rs[i].Series = nil
	}
	o := render(t, rs)
	if o.svgWritten {
		t.Error("SVG written with nothing to plot")
	}
	if !strings.Contains(o.stderr, "no result has a series to plot") {
		t.Errorf("stderr does not say why there is no SVG: %q", o.stderr)
	}
	if strings.Contains(o.md, "benchmarks.svg") {
		t.Error("markdown links a plot that was not written")
	}
}

func TestErrors(t *testing.T) {
	out := t.TempDir()
	bad := t.TempDir()
	if err := os.WriteFile(filepath.Join(bad, "p1.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, args := range map[string][]string{
		"missing dir": {"-in", filepath.Join(out, "nope")},
		"bad json":    {"-in", bad},
		"extra arg":   {"-in", out, "extra"},
		"bad flag":    {"-nope"},
	} {
		t.Run(name, func(t *testing.T) {
			args := append(args, "-md", filepath.Join(out, "b.md"), "-svg", filepath.Join(out, "b.svg"))
			if err := run(args, io.Discard); err == nil {
				t.Error("no error")
			}
		})
	}
	if _, err := os.Stat(filepath.Join(out, "b.md")); !errors.Is(err, os.ErrNotExist) {
		t.Error("a failed run wrote the page")
	}
}

func TestNumber(t *testing.T) {
	for v, want := range map[float64]string{
		0: "0", 1: "1", 1000: "1,000", 1234567: "1,234,567", -2500: "-2,500",
		12.345: "12.3", 1.5: "1.5", 0.5: "0.5", 0.012345: "0.0123", 99.96: "100",
		1234.7: "1,235", 150.6: "151", 0.00012: "0.00012",
	} {
		if got := number(v); got != want {
			t.Errorf("number(%v) = %q, want %q", v, got, want)
		}
	}
}
