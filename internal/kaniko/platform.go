package kaniko

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	v1 "github.com/buildq/buildq/api/v1"
)

// Where a platform's build runs (issue 29, "Where it runs"). kaniko builds
// for --custom-platform without emulation: its RUN steps execute on the
// node, so a build runs on a node whose kernel runs the platform's
// programs. By default that is a node of the platform itself
// (kubernetes.io/os and kubernetes.io/arch); an operator may name other
// nodes for a platform they run natively (linux/386 on amd64, linux/arm/v7
// on most arm64) with --platform-node-selector.

// PlatformSelectors maps a platform (os/arch[/variant]) to the node
// selector that replaces the default one for its builds.
type PlatformSelectors map[string]map[string]string

// ParsePlatformSelectors reads --platform-node-selector entries, each
// PLATFORM=KEY=VALUE[,KEY=VALUE…]. An entry that does not start with a
// platform continues the one before it, so a list split at its commas (a
// BUILDQ_* variable, a config file's list) reads the same as the flags.
// Platforms are checked as requests' are (v1.PlatformProblem), keys and
// values as Kubernetes label keys and values; a platform named twice is
// an error.
func ParsePlatformSelectors(entries []string) (PlatformSelectors, error) {
	out := PlatformSelectors{}
	last := ""
	for _, e := range entries {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		head, rest, hasEq := strings.Cut(e, "=")
		switch {
		case hasEq && v1.PlatformProblem(head) == "":
			if _, dup := out[head]; dup {
				return nil, fmt.Errorf("%q: platform %s is given twice", e, head)
			}
			out[head] = map[string]string{}
			last = head
		case last != "" && hasEq && !strings.Contains(rest, "="):
			// A continuation: KEY=VALUE of the platform before.
			head, rest = last, e
		case hasEq && strings.Contains(rest, "="):
			return nil, fmt.Errorf("%q: %s", e, v1.PlatformProblem(head))
		default:
			return nil, fmt.Errorf("%q is not PLATFORM=KEY=VALUE[,KEY=VALUE] (e.g. linux/386=kubernetes.io/arch=amd64)", e)
		}
		for kv := range strings.SplitSeq(rest, ",") {
			kv = strings.TrimSpace(kv)
			k, val, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return nil, fmt.Errorf("%q: %q is not KEY=VALUE (e.g. linux/386=kubernetes.io/arch=amd64)", e, kv)
			}
			if errs := validation.IsQualifiedName(k); len(errs) > 0 {
				return nil, fmt.Errorf("%q: %q is not a label key: %s", e, k, strings.Join(errs, "; "))
			}
			if errs := validation.IsValidLabelValue(val); len(errs) > 0 {
				return nil, fmt.Errorf("%q: %q is not a label value: %s", e, val, strings.Join(errs, "; "))
			}
			if _, dup := out[head][k]; dup {
				return nil, fmt.Errorf("%q: key %s is given twice for platform %s", e, k, head)
			}
			out[head][k] = val
		}
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

// FormatSelector formats a selector as KEY=VALUE,… in key order.
func FormatSelector(sel map[string]string) string {
	var b strings.Builder
	for i, k := range slices.Sorted(maps.Keys(sel)) {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k + "=" + sel[k])
	}
	return b.String()
}

// Platform is the one platform a request builds for: its one platform, or
// v1.DefaultPlatform when it names none (its build key names that
// platform: a build that ran on whatever node came would put another
// architecture's image under it); "" for several (an image index, which
// no one Job builds).
func Platform(r *v1.Request) string {
	switch len(r.Platforms) {
	case 0:
		return v1.DefaultPlatform
	case 1:
		return r.Platforms[0]
	}
	return ""
}

// PlatformSelector is the node selector of platform's builds, without the
// job template's: --platform-node-selector's entry for it, or
// kubernetes.io/os and kubernetes.io/arch of the platform itself (nil for
// platform "").
func PlatformSelector(platform string, cfg Config) map[string]string {
	if platform == "" {
		return nil
	}
	if sel, ok := cfg.PlatformNodeSelectors[platform]; ok {
		return maps.Clone(sel)
	}
	parts := strings.Split(platform, "/")
	if len(parts) < 2 {
		return nil
	}
	return map[string]string{corev1.LabelOSStable: parts[0], corev1.LabelArchStable: parts[1]}
}

// NodeSelector is the build Pod's node selector for r: the job template's,
// with the platform's (PlatformSelector) over it.
func NodeSelector(r *v1.Request, cfg Config) map[string]string {
	sel := maps.Clone(cfg.NodeSelector)
	if ps := PlatformSelector(Platform(r), cfg); len(ps) > 0 {
		if sel == nil {
			sel = map[string]string{}
		}
		maps.Copy(sel, ps)
	}
	return sel
}

// BuildPlatform is the platform of the nodes platform's builds run on
// (BuildKit's BUILDPLATFORM): os and arch from the selector's
// kubernetes.io/os and kubernetes.io/arch, each the target's own where the
// selector does not name it. Node labels carry no variant, so neither
// does the result.
func BuildPlatform(platform string, cfg Config) string {
	parts := strings.Split(platform, "/")
	if len(parts) < 2 {
		return ""
	}
	os, arch := parts[0], parts[1]
	sel := PlatformSelector(platform, cfg)
	if v := sel[corev1.LabelOSStable]; v != "" {
		os = v
	}
	if v := sel[corev1.LabelArchStable]; v != "" {
		arch = v
	}
	return os + "/" + arch
}

// PlatformBuildArgs are the build arguments BuildKit predefines for a
// build of platform on a node of BuildPlatform, as NAME=VALUE in a fixed
// order, less those the request sets itself (the request's value wins, as
// a --build-arg does in BuildKit).
//
// kaniko predefines none of them: chainguard-dev/kaniko v1.25.0 uses
// --custom-platform only to pick the base images' platform and to write
// os and architecture into the image config (pkg/executor/build.go, which
// also drops the variant); its build arguments are the --build-arg flags
// alone on top of docker's builtin proxy variables
// (pkg/dockerfile/buildargs.go, docker's builder/dockerfile/buildargs.go),
// and there is no "TARGETPLATFORM" anywhere in its code outside a
// vendored linter message. So passing them here duplicates nothing. As in
// BuildKit, a stage sees one only after declaring it (ARG TARGETARCH);
// unlike BuildKit, a FROM line can use one only when the Dockerfile
// declares it before the first FROM, and kaniko ignores FROM --platform.
//
// All are derived from the platform, which the build key holds, and from
// the worker's --platform-node-selector (BUILDPLATFORM), which is
// configuration, like the executor's flags: the key does not change.
func PlatformBuildArgs(r *v1.Request, cfg Config) []string {
	platform := Platform(r)
	if platform == "" {
		return nil
	}
	parts := strings.Split(platform, "/")
	variant := ""
	if len(parts) == 3 {
		variant = parts[2]
	}
	build := BuildPlatform(platform, cfg)
	buildOS, buildArch, _ := strings.Cut(build, "/")
	args := [][2]string{
		{"TARGETPLATFORM", platform},
		{"TARGETOS", parts[0]},
		{"TARGETARCH", parts[1]},
		{"TARGETVARIANT", variant},
		{"BUILDPLATFORM", build},
		{"BUILDOS", buildOS},
		{"BUILDARCH", buildArch},
	}
	var out []string
	for _, a := range args {
		if _, set := r.BuildArgs[a[0]]; set {
			continue
		}
		out = append(out, a[0]+"="+a[1])
	}
	return out
}
