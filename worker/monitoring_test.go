package worker

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// captureRegisterer records the metric names registered with it.
type captureRegisterer struct{ names map[string]bool }

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (c *captureRegisterer) Register(col prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 16)
	go func() { col.Describe(ch); close(ch) }()
	for d := range ch {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			c.names[m[1]] = true
		}
	}
	return nil
}

func (c *captureRegisterer) MustRegister(cols ...prometheus.Collector) {
	for _, col := range cols {
		_ = c.Register(col)
	}
}

func (c *captureRegisterer) Unregister(prometheus.Collector) bool { return true }

// The alerts and the dashboard of deploy/components/monitoring name only
// metrics the worker exports: a renamed metric would leave an alert that
// never fires and an empty panel.
func TestMonitoringNamesExportedMetrics(t *testing.T) {
	t.Parallel()
	reg := &captureRegisterer{names: map[string]bool{}}
	NewMetrics(reg)
	if len(reg.names) < 10 {
		t.Fatalf("captured %d metric names", len(reg.names))
	}
	used := regexp.MustCompile(`buildq_[a-z_]+`)
	for _, f := range []string{"../deploy/components/monitoring/prometheusrule.yaml", "../deploy/components/monitoring/dashboard.json"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, name := range used.FindAllString(string(b), -1) {
			base := name
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b := strings.TrimSuffix(name, suffix); b != name && reg.names[b] {
					base = b
				}
			}
			n++
			if !reg.names[base] {
				t.Errorf("%s names %s, which the worker does not export", f, name)
			}
		}
		if n == 0 {
			t.Errorf("%s names no buildq metric", f)
		}
	}
}
