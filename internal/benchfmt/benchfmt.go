// Package benchfmt is the record the end-to-end benchmarks (make
// bench-e2e, make bench-scale) write, one JSON file per figure, and that
// hack/benchreport turns into docs/benchmarks.md and its plot.
//
// Every figure that can be is a ratio against a baseline measured in the
// same run: absolute times on shared machines are noisy, ratios much less.
package benchfmt

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"
)

// EnvDir names the directory the benchmarks write their results into.
// Unset, they write nowhere and only log.
const EnvDir = "BUILDQ_BENCH_OUT"

// Result is one benchmark's figures: P1 … P9 of docs/benchmarks.md.
type Result struct {
	ID    string `json:"id"`    // "P1"
	Title string `json:"title"` // what is measured
	// Baseline says what the figures are compared with ("" when none).
	Baseline string `json:"baseline,omitempty"`
	Rows     []Row  `json:"rows"`
	// Goal is the target in words; Met says whether this run met it (nil:
	// no goal).
	Goal string `json:"goal,omitempty"`
	Met  *bool  `json:"met,omitempty"`
	// Notes explain a missed goal, a limit, or what stopped scaling.
	Notes []string `json:"notes,omitempty"`
	// Series are latency-against-load curves for the plot.
	Series []Series `json:"series,omitempty"`
	// Machine and Date are filled in by Write.
	Machine Machine   `json:"machine"`
	Date    time.Time `json:"date"`
	// Seconds is how long the benchmark took.
	Seconds float64 `json:"seconds"`
}

// Row is one figure. Baseline and Ratio are set when the figure has a
// baseline measured in the same run; Ratio is Value/Baseline.
type Row struct {
	Metric   string   `json:"metric"`
	Value    float64  `json:"value"`
	Unit     string   `json:"unit"`
	Baseline *float64 `json:"baseline,omitempty"`
	Ratio    *float64 `json:"ratio,omitempty"`
}

// Series is one curve: X is the offered load, Y the latency.
type Series struct {
	Name   string  `json:"name"`
	XLabel string  `json:"xLabel"`
	YLabel string  `json:"yLabel"`
	Points []Point `json:"points"`
}

// Point is one measurement of a Series.
type Point struct {
	X float64 `json:"x"`
	Y float64 `json:"y"`
}

// Machine is where a result was measured.
type Machine struct {
	CPUs      int    `json:"cpus"`
	MemoryMiB int    `json:"memoryMiB"`
	CPUModel  string `json:"cpuModel,omitempty"`
	GoVersion string `json:"goVersion"`
	OS        string `json:"os"`
}

// Compared is a Row with a baseline: its ratio is value/baseline.
func Compared(metric, unit string, value, baseline float64) Row {
	r := Row{Metric: metric, Unit: unit, Value: value, Baseline: &baseline}
	if baseline != 0 {
		ratio := value / baseline
		r.Ratio = &ratio
	}
	return r
}

// Plain is a Row without a baseline.
func Plain(metric, unit string, value float64) Row {
	return Row{Metric: metric, Unit: unit, Value: value}
}

// Bool is a pointer to b, for Result.Met.
func Bool(b bool) *bool { return &b }

// Write stamps r with the machine and the date and writes it to
// $BUILDQ_BENCH_OUT/<id>.json. It returns the path, or "" when the
// variable is unset.
func Write(r Result) (string, error) {
	dir := os.Getenv(EnvDir)
	if dir == "" {
		return "", nil
	}
	r.Machine = ThisMachine()
	if r.Date.IsZero() {
		r.Date = time.Now().UTC().Truncate(time.Second)
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, strings.ToLower(r.ID)+".json")
	return path, os.WriteFile(path, append(b, '\n'), 0o644)
}

// Read reads every result in dir, sorted by ID (P1 … P9).
func Read(dir string) ([]Result, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []Result
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		var r Result
		if err := json.Unmarshal(b, &r); err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool {
		if len(out[i].ID) != len(out[j].ID) {
			return len(out[i].ID) < len(out[j].ID)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

// ThisMachine describes the machine the process runs on.
func ThisMachine() Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int
		for _, line := range strings.Split(string(b), "\n") {
			if _, err := fmt.Sscanf(line, "MemTotal: %d kB", &kb); err == nil {
				m.MemoryMiB = kb / 1024
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	return m
}

// RSSMiB is the peak resident set (VmHWM) of process pid in MiB, read
// from /proc; 0 when it cannot be read.
func RSSMiB(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		var kb float64
		if _, err := fmt.Sscanf(line, "VmHWM: %f kB", &kb); err == nil {
			return kb / 1024
		}
	}
	return 0
}

// Percentile is the p-th percentile (0 < p ≤ 100) of xs by the
// nearest-rank method; xs is sorted in place. 0 for no samples.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	sort.Float64s(xs)
	rank := int(float64(len(xs))*p/100+0.999999) - 1
	if rank < 0 {
		rank = 0
	}
	if rank >= len(xs) {
		rank = len(xs) - 1
	}
	return xs[rank]
}
