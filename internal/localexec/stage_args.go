package localexec

import (
	"slices"
	"sort"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

// argEnv is a small ordered environment used for meta args.
type argEnv struct {
	keys []string
	vals map[string]string
}

func newArgEnv() *argEnv { return &argEnv{vals: map[string]string{}} }

func (e *argEnv) set(k, v string) {
	if _, ok := e.vals[k]; !ok {
		e.keys = append(e.keys, k)
	}
	e.vals[k] = v
}

// Get implements shell.EnvGetter.
func (e *argEnv) Get(k string) (string, bool) {
	v, ok := e.vals[k]
	return v, ok
}

// Keys implements shell.EnvGetter.
func (e *argEnv) Keys() []string { return slices.Clone(e.keys) }

// stageEnv is what $VAR expands to inside a stage: ENV (config) first, as
// docker documents that ENV overrides an ARG of the same name, then ARGs.
type stageEnv struct{ s *stageState }

func (e stageEnv) Get(k string) (string, bool) {
	env := e.s.cfg.Config.Env
	for i := len(env) - 1; i >= 0; i-- {
		ek, v, _ := strings.Cut(env[i], "=")
		if shell.EqualEnvKeys(ek, k) {
			return v, true
		}
	}
	v, ok := e.s.args[k]
	return v, ok
}

func (e stageEnv) Keys() []string {
	var keys []string
	for _, kv := range e.s.cfg.Config.Env {
		k, _, _ := strings.Cut(kv, "=")
		keys = append(keys, k)
	}
	for k := range e.s.args {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// initGlobalArgs evaluates the ARGs before the first FROM. They, and the
// platform args BuildKit predefines, are what FROM lines may reference and
// what an ARG without a default inside a stage inherits.
func (b *builder) initGlobalArgs(metaArgs []instructions.ArgCommand, target int) error {
	g := newArgEnv()
	targetName := b.stages[target].Name
	if targetName == "" {
		targetName = "default"
	}
	// The local executor runs nothing, so the "build platform" has no
	// meaning of its own; making it the target platform keeps the output
	// independent of the machine the build happens to run on.
	p := b.platform
	predefined := [][2]string{
		{"BUILDPLATFORM", p.String()}, {"BUILDOS", p.OS}, {"BUILDARCH", p.Architecture}, {"BUILDVARIANT", p.Variant},
		{"TARGETPLATFORM", p.String()}, {"TARGETOS", p.OS}, {"TARGETARCH", p.Architecture}, {"TARGETVARIANT", p.Variant},
		{"TARGETSTAGE", targetName},
	}
	for _, kv := range predefined {
		v := kv[1]
		if ov, ok := b.opts.BuildArgs[kv[0]]; ok {
			v = ov
		}
		g.set(kv[0], v)
	}
	for _, cmd := range metaArgs {
		for _, kv := range cmd.Args {
			if v, ok := b.opts.BuildArgs[kv.Key]; ok {
				g.set(kv.Key, v)
				continue
			}
			if kv.Value == nil {
				continue
			}
			v, _, err := b.lex.ProcessWord(*kv.Value, g)
			if err != nil {
				return userErrorf(lineOf(cmd.Location()), "ARG %s: %v", kv.Key, err)
			}
			g.set(kv.Key, v)
		}
	}
	b.global = g
	return nil
}
