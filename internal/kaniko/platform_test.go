package kaniko

import (
	"maps"
	"slices"
	"strings"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

// Issue 29 ("where it runs"): --platform-node-selector entries are read
// strictly, and an error names the entry at fault.
func TestParsePlatformSelectors(t *testing.T) {
	t.Parallel()
	good := []struct {
		name    string
		entries []string
		want    PlatformSelectors
	}{
		{"none", nil, nil},
		{"one key", []string{"linux/386=kubernetes.io/arch=amd64"},
			PlatformSelectors{"linux/386": {"kubernetes.io/arch": "amd64"}}},
		{"several keys", []string{"linux/arm/v7=kubernetes.io/arch=arm64, pool=builds"},
			PlatformSelectors{"linux/arm/v7": {"kubernetes.io/arch": "arm64", "pool": "builds"}}},
		{"several platforms", []string{"linux/386=kubernetes.io/arch=amd64", "linux/arm/v7=kubernetes.io/arch=arm64"},
			PlatformSelectors{"linux/386": {"kubernetes.io/arch": "amd64"}, "linux/arm/v7": {"kubernetes.io/arch": "arm64"}}},
		// BUILDQ_PLATFORM_NODE_SELECTOR is split at its commas.
		{"split at commas", []string{"linux/386=kubernetes.io/arch=amd64", "pool=builds", "linux/arm64=pool=arm"},
			PlatformSelectors{"linux/386": {"kubernetes.io/arch": "amd64", "pool": "builds"}, "linux/arm64": {"pool": "arm"}}},
	}
	for _, c := range good {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParsePlatformSelectors(c.entries)
			if err != nil {
				t.Fatal(err)
			}
			if !maps.EqualFunc(got, c.want, maps.Equal) || (got == nil) != (c.want == nil) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
		})
	}
	bad := []struct {
		name, entry string
		want        []string
	}{
		{"unknown architecture", "linux/sparc=kubernetes.io/arch=amd64", []string{"linux/sparc", "not a known platform"}},
		{"no platform", "kubernetes.io/arch=amd64", []string{"kubernetes.io/arch=amd64", "PLATFORM=KEY=VALUE"}},
		{"no selector", "linux/386", []string{`"linux/386"`, "PLATFORM=KEY=VALUE"}},
		{"empty selector", "linux/386=", []string{`"linux/386="`, "not KEY=VALUE"}},
		{"key without value sign", "linux/386=amd64", []string{`"amd64" is not KEY=VALUE`}},
		{"bad key", "linux/386=bad key=amd64", []string{`"bad key" is not a label key`}},
		{"bad value", "linux/386=kubernetes.io/arch=amd 64", []string{`"amd 64" is not a label value`}},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := ParsePlatformSelectors([]string{c.entry})
			if err == nil {
				t.Fatalf("%q accepted", c.entry)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
	t.Run("platform twice", func(t *testing.T) {
		t.Parallel()
		_, err := ParsePlatformSelectors([]string{"linux/386=a=b", "linux/386=c=d"})
		if err == nil || !strings.Contains(err.Error(), "linux/386 is given twice") {
			t.Fatalf("err %v", err)
		}
	})
}

func buildArgs(args []string) map[string]string {
	out := map[string]string{}
	for _, a := range args {
		if kv, ok := strings.CutPrefix(a, BuildArgFlag); ok {
			k, v, _ := strings.Cut(kv, "=")
			out[k] = v
		}
	}
	return out
}

// Issue 29: a one-platform build gets BuildKit's platform arguments and
// runs where --platform-node-selector says, or on nodes of the platform.
func TestPlatformBuildArgsAndSelector(t *testing.T) {
	t.Parallel()
	key := strings.Repeat("ab", 32)
	dest := []string{"registry.example.com/acme/web:abababababab"}
	override := baseConfig
	override.PlatformNodeSelectors = PlatformSelectors{"linux/386": {"kubernetes.io/arch": "amd64"}}
	override.NodeSelector = map[string]string{"pool": "builds"}

	cases := []struct {
		name      string
		platforms []string
		own       map[string]string
		cfg       Config
		args      map[string]string
		absent    []string
		selector  map[string]string
		custom    string
	}{
		{
			name: "default selector", platforms: []string{"linux/arm/v7"}, cfg: baseConfig,
			args: map[string]string{"TARGETPLATFORM": "linux/arm/v7", "TARGETOS": "linux", "TARGETARCH": "arm", "TARGETVARIANT": "v7",
				"BUILDPLATFORM": "linux/arm", "BUILDOS": "linux", "BUILDARCH": "arm"},
			selector: map[string]string{"kubernetes.io/os": "linux", "kubernetes.io/arch": "arm"},
			custom:   "linux/arm/v7",
		},
		{
			name: "selector replaced", platforms: []string{"linux/386"}, cfg: override,
			args: map[string]string{"TARGETPLATFORM": "linux/386", "TARGETOS": "linux", "TARGETARCH": "386", "TARGETVARIANT": "",
				"BUILDPLATFORM": "linux/amd64", "BUILDOS": "linux", "BUILDARCH": "amd64"},
			// The template's selector stays; the platform's replaces the
			// default os/arch pair (no kubernetes.io/os: not named).
			selector: map[string]string{"pool": "builds", "kubernetes.io/arch": "amd64"},
			custom:   "linux/386",
		},
		{
			name: "another platform keeps its default", platforms: []string{"linux/arm64"}, cfg: override,
			args:     map[string]string{"TARGETPLATFORM": "linux/arm64", "BUILDPLATFORM": "linux/arm64"},
			selector: map[string]string{"pool": "builds", "kubernetes.io/os": "linux", "kubernetes.io/arch": "arm64"},
			custom:   "linux/arm64",
		},
		{
			name: "the request's own value wins", platforms: []string{"linux/386"}, cfg: override,
			own:      map[string]string{"TARGETARCH": "x86", "BUILDPLATFORM": "mine"},
			args:     map[string]string{"TARGETARCH": "x86", "BUILDPLATFORM": "mine", "TARGETPLATFORM": "linux/386"},
			selector: map[string]string{"pool": "builds", "kubernetes.io/arch": "amd64"},
			custom:   "linux/386",
		},
		{
			// The key names linux/amd64: so does the build.
			name: "no platform: the default, as in the key", cfg: baseConfig,
			args:     map[string]string{"TARGETPLATFORM": "linux/amd64", "TARGETARCH": "amd64", "BUILDPLATFORM": "linux/amd64"},
			selector: map[string]string{"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
			custom:   "linux/amd64",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := s3Request()
			r.Platforms = c.platforms
			r.BuildArgs = c.own
			job, err := Job(Spec{Request: r, Key: key, Destinations: dest}, c.cfg.Defaults())
			if err != nil {
				t.Fatal(err)
			}
			pod := job.Spec.Template.Spec
			args := pod.Containers[0].Args
			got := buildArgs(args)
			for k, v := range c.args {
				if w, ok := got[k]; !ok || w != v {
					t.Errorf("build arg %s=%q (set %v), want %q; args %v", k, w, ok, v, args)
				}
			}
			for _, k := range c.absent {
				if _, ok := got[k]; ok {
					t.Errorf("build arg %s is set: %v", k, args)
				}
			}
			// Each name once: the request's own value is not passed twice.
			seen := map[string]int{}
			for _, a := range args {
				if kv, ok := strings.CutPrefix(a, BuildArgFlag); ok {
					k, _, _ := strings.Cut(kv, "=")
					if seen[k]++; seen[k] > 1 {
						t.Errorf("build arg %s passed twice: %v", k, args)
					}
				}
			}
			if !maps.Equal(pod.NodeSelector, c.selector) {
				t.Errorf("node selector %v, want %v", pod.NodeSelector, c.selector)
			}
			hasCustom := slices.Contains(args, "--custom-platform="+c.custom)
			if c.custom != "" && !hasCustom {
				t.Errorf("no --custom-platform=%s in %v", c.custom, args)
			}
			if c.custom == "" && slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--custom-platform") }) {
				t.Errorf("--custom-platform without a platform: %v", args)
			}
		})
	}
	t.Run("the build key does not change", func(t *testing.T) {
		t.Parallel()
		r := s3Request()
		r.Platforms = []string{"linux/386"}
		before := v1.BuildKey(r, "kaniko@x")
		if _, err := Job(Spec{Request: r, Key: before, Destinations: dest}, override.Defaults()); err != nil {
			t.Fatal(err)
		}
		if after := v1.BuildKey(r, "kaniko@x"); after != before || r.BuildArgs != nil {
			t.Fatalf("building the Job changed the request: key %s -> %s, build args %v", before, after, r.BuildArgs)
		}
	})
}
