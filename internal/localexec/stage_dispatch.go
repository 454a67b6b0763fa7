package localexec

import (
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

// dispatch executes one instruction against the stage.
func (b *builder) dispatch(s *stageState, cmd instructions.Command) error {
	line := lineOf(cmd.Location())
	env := stageEnv{s}

	if _, ok := cmd.(*instructions.RunCommand); ok {
		return &BuildError{Line: line, Err: ErrRunNotSupported}
	}
	// Expand variables the way BuildKit does: ARG is special (its default
	// is expanded only when used), everything else expands in place.
	if _, isArg := cmd.(*instructions.ArgCommand); !isArg {
		if ex, ok := cmd.(instructions.SupportsSingleWordExpansion); ok {
			if err := ex.Expand(func(w string) (string, error) {
				r, _, err := b.lex.ProcessWord(w, env)
				return r, err
			}); err != nil {
				return userErrorf(line, "%s: %v", strings.ToUpper(cmd.Name()), err)
			}
		}
	}
	if ex, ok := cmd.(instructions.SupportsSingleWordExpansionRaw); ok {
		if err := ex.ExpandRaw(func(w string) (string, error) {
			lex := shell.NewLex('\\')
			lex.SkipProcessQuotes = true
			r, _, err := lex.ProcessWord(w, env)
			return r, err
		}); err != nil {
			return userErrorf(line, "%s: %v", strings.ToUpper(cmd.Name()), err)
		}
	}

	switch cmd.(type) {
	case *instructions.CopyCommand, *instructions.AddCommand:
		// Reported with what they copied, once done.
	default:
		if str, ok := cmd.(fmt.Stringer); ok {
			b.stepf(s, "%s", stepText(s, str.String()))
		}
	}

	c := &s.cfg.Config
	switch cmd := cmd.(type) {
	case *instructions.ArgCommand:
		for _, kv := range cmd.Args {
			if v, ok := b.opts.BuildArgs[kv.Key]; ok {
				s.args[kv.Key] = v
			} else if kv.Value != nil {
				v, _, err := b.lex.ProcessWord(*kv.Value, env)
				if err != nil {
					return userErrorf(line, "ARG %s: %v", kv.Key, err)
				}
				s.args[kv.Key] = v
			} else if v, ok := b.global.Get(kv.Key); ok {
				s.args[kv.Key] = v
			}
		}
		// No history: docker records ARG values there, which leaks build
		// args (often tokens) into the published image.
		return nil

	case *instructions.EnvCommand:
		var parts []string
		for _, kv := range cmd.Env {
			c.Env = setEnv(c.Env, kv.Key, kv.Value)
			parts = append(parts, kv.Key+"="+kv.Value)
		}
		return s.addHistory("ENV " + strings.Join(parts, " "))

	case *instructions.LabelCommand:
		if c.Labels == nil {
			c.Labels = map[string]string{}
		}
		var parts []string
		for _, kv := range cmd.Labels {
			c.Labels[kv.Key] = kv.Value
			parts = append(parts, kv.Key+"="+kv.Value)
		}
		return s.addHistory("LABEL " + strings.Join(parts, " "))

	case *instructions.MaintainerCommand:
		s.cfg.Author = cmd.Maintainer
		return s.addHistory("MAINTAINER " + cmd.Maintainer)

	case *instructions.WorkdirCommand:
		return b.dispatchWorkdir(s, cmd.Path, line)

	case *instructions.UserCommand:
		c.User = cmd.User
		return s.addHistory("USER " + cmd.User)

	case *instructions.ExposeCommand:
		var ports []string
		for _, p := range cmd.Ports {
			words, err := b.lex.ProcessWords(p, env)
			if err != nil {
				return userErrorf(line, "EXPOSE: %v", err)
			}
			for _, w := range words {
				ps, err := parsePorts(w)
				if err != nil {
					return userErrorf(line, "EXPOSE: %v", err)
				}
				ports = append(ports, ps...)
			}
		}
		if c.ExposedPorts == nil {
			c.ExposedPorts = map[string]struct{}{}
		}
		for _, p := range ports {
			c.ExposedPorts[p] = struct{}{}
		}
		return s.addHistory("EXPOSE " + strings.Join(ports, " "))

	case *instructions.VolumeCommand:
		if c.Volumes == nil {
			c.Volumes = map[string]struct{}{}
		}
		for _, v := range cmd.Volumes {
			if v == "" {
				return userErrorf(line, "VOLUME specified can not be an empty string")
			}
			c.Volumes[v] = struct{}{}
		}
		return s.addHistory("VOLUME " + jsonArgs(cmd.Volumes))

	case *instructions.StopSignalCommand:
		if err := validateSignal(cmd.Signal); err != nil {
			return userErrorf(line, "STOPSIGNAL: %v", err)
		}
		c.StopSignal = cmd.Signal
		return s.addHistory("STOPSIGNAL " + cmd.Signal)

	case *instructions.ShellCommand:
		c.Shell = slices.Clone(cmd.Shell)
		return s.addHistory("SHELL " + jsonArgs(cmd.Shell))

	case *instructions.CmdCommand:
		args := slices.Clone(cmd.CmdLine)
		if cmd.PrependShell {
			args = withShell(c.Shell, args)
		}
		c.Cmd = args
		s.cmdSet = true
		return s.addHistory("CMD " + jsonArgs(args))

	case *instructions.EntrypointCommand:
		args := slices.Clone(cmd.CmdLine)
		if cmd.PrependShell && args != nil {
			args = withShell(c.Shell, args)
		}
		c.Entrypoint = args
		if !s.cmdSet {
			// An inherited CMD was written for the old entrypoint.
			c.Cmd = nil
		}
		return s.addHistory("ENTRYPOINT " + jsonArgs(args))

	case *instructions.HealthCheckCommand:
		h := cmd.Health
		c.Healthcheck = &v1.HealthConfig{
			Test:        slices.Clone(h.Test),
			Interval:    h.Interval,
			Timeout:     h.Timeout,
			StartPeriod: h.StartPeriod,
			Retries:     h.Retries,
		}
		return s.addHistory("HEALTHCHECK " + jsonArgs(h.Test))

	case *instructions.OnbuildCommand:
		// Recording a trigger needs no container; whoever builds FROM this
		// image runs it.
		c.OnBuild = append(c.OnBuild, cmd.Expression)
		return nil

	case *instructions.CopyCommand:
		return b.dispatchCopy(s, copyParams{
			name:     "COPY",
			line:     line,
			sd:       cmd.SourcesAndDest,
			from:     cmd.From,
			chown:    cmd.Chown,
			chmod:    cmd.Chmod,
			exclude:  cmd.ExcludePatterns,
			parents:  cmd.Parents,
			original: cmd.String(),
		})

	case *instructions.AddCommand:
		unpack := true
		if cmd.Unpack != nil {
			unpack = *cmd.Unpack
		}
		return b.dispatchCopy(s, copyParams{
			name:     "ADD",
			line:     line,
			sd:       cmd.SourcesAndDest,
			chown:    cmd.Chown,
			chmod:    cmd.Chmod,
			exclude:  cmd.ExcludePatterns,
			isAdd:    true,
			unpack:   unpack,
			checksum: cmd.Checksum,
			original: cmd.String(),
		})
	}
	return userErrorf(line, "%s is not supported by the local executor", strings.ToUpper(cmd.Name()))
}

// setEnv replaces or appends K=V, keeping the order docker would.
func setEnv(env []string, k, v string) []string {
	for i, kv := range env {
		ek, _, _ := strings.Cut(kv, "=")
		if shell.EqualEnvKeys(ek, k) {
			env[i] = k + "=" + v
			return env
		}
	}
	return append(env, k+"="+v)
}

// withShell turns a shell-form command into exec form with the stage's
// SHELL (default /bin/sh -c), as docker does.
func withShell(sh, args []string) []string {
	if len(sh) == 0 {
		sh = []string{"/bin/sh", "-c"}
	}
	return append(slices.Clone(sh), strings.Join(args, " "))
}

// jsonArgs renders a command for history text the way docker shows it.
func jsonArgs(args []string) string {
	if args == nil {
		args = []string{}
	}
	b, _ := json.Marshal(args)
	return string(b)
}

// dispatchWorkdir sets WORKDIR and, like BuildKit, makes sure the directory
// exists — but adds a layer only when it does not exist yet, so a WORKDIR
// that names an existing directory costs nothing and changes nothing.
func (b *builder) dispatchWorkdir(s *stageState, p string, line int) error {
	c := &s.cfg.Config
	wd := p
	if !path.IsAbs(wd) {
		cur := c.WorkingDir
		if cur == "" {
			cur = "/"
		}
		wd = path.Join(cur, wd)
	}
	wd = path.Clean(wd)
	c.WorkingDir = wd
	if wd == "/" {
		return s.addHistory("WORKDIR " + wd)
	}
	idx, err := b.stageFS(s)
	if err != nil {
		return err
	}
	_, n, err := resolvePath(idx, relPath(wd), true)
	if err != nil && !errors.Is(err, errNotFound) {
		return userErrorf(line, "WORKDIR %s: %v", wd, err)
	}
	if n != nil {
		if n.typ != typeDir {
			return userErrorf(line, "WORKDIR %s: exists and is not a directory", wd)
		}
		return s.addHistory("WORKDIR " + wd)
	}
	// BuildKit creates the directory as the current USER; a user that
	// cannot be resolved falls back to root, as it does there.
	uid, gid := 0, 0
	if c.User != "" {
		if u, g, err := b.resolveOwner(s, c.User, line); err == nil {
			uid, gid = u, g
		}
	}
	lb := newLayerBuilder()
	op := &copyOp{b: b, s: s, line: line, layer: lb, idx: idx, parentUID: uid, parentGID: gid}
	if _, err := op.mkdirAll(relPath(wd)); err != nil {
		return err
	}
	l, err := lb.build(b, s.layerType)
	if err != nil {
		return err
	}
	if err := s.addLayer(l, "WORKDIR "+wd); err != nil {
		return err
	}
	b.logLayer(s, l)
	return nil
}

// parsePorts turns one EXPOSE word ("80", "53/udp", "8000-8002/tcp",
// "127.0.0.1:8080:80") into config keys like "80/tcp".
func parsePorts(w string) ([]string, error) {
	proto := "tcp"
	spec := w
	if i := strings.LastIndex(spec, "/"); i >= 0 {
		proto = strings.ToLower(spec[i+1:])
		spec = spec[:i]
	}
	switch proto {
	case "tcp", "udp", "sctp":
	default:
		return nil, fmt.Errorf("invalid protocol %q in %q", proto, w)
	}
	if i := strings.LastIndex(spec, ":"); i >= 0 {
		// [ip:]hostPort:containerPort — only the container side matters.
		spec = spec[i+1:]
	}
	lo, hi, isRange := strings.Cut(spec, "-")
	start, err := parsePort(lo)
	if err != nil {
		return nil, fmt.Errorf("invalid port %q: %w", w, err)
	}
	end := start
	if isRange {
		if end, err = parsePort(hi); err != nil || end < start {
			return nil, fmt.Errorf("invalid port range %q", w)
		}
	}
	out := make([]string, 0, end-start+1)
	for p := start; p <= end; p++ {
		out = append(out, fmt.Sprintf("%d/%s", p, proto))
	}
	return out, nil
}

func parsePort(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, err
	}
	if n < 0 || n > 65535 {
		return 0, fmt.Errorf("%d is out of range", n)
	}
	return n, nil
}

// linuxSignals are the names STOPSIGNAL accepts, as in moby/sys/signal.
var linuxSignals = map[string]bool{
	"ABRT": true, "ALRM": true, "BUS": true, "CHLD": true, "CLD": true, "CONT": true, "FPE": true,
	"HUP": true, "ILL": true, "INT": true, "IO": true, "IOT": true, "KILL": true, "PIPE": true,
	"POLL": true, "PROF": true, "PWR": true, "QUIT": true, "SEGV": true, "STKFLT": true, "STOP": true,
	"SYS": true, "TERM": true, "TRAP": true, "TSTP": true, "TTIN": true, "TTOU": true, "URG": true,
	"USR1": true, "USR2": true, "VTALRM": true, "WINCH": true, "XCPU": true, "XFSZ": true,
	"RTMIN": true, "RTMAX": true, "UNUSED": true,
}

// validateSignal rejects STOPSIGNAL values a runtime could not use, as
// BuildKit does at build time rather than leaving it to `docker stop`.
func validateSignal(sig string) error {
	if n, err := strconv.Atoi(sig); err == nil {
		if n <= 0 || n > 64 {
			return fmt.Errorf("invalid signal %q", sig)
		}
		return nil
	}
	name := strings.TrimPrefix(strings.ToUpper(sig), "SIG")
	if base, off, ok := strings.Cut(name, "+"); ok && (base == "RTMIN") {
		if n, err := strconv.Atoi(off); err == nil && n >= 0 && n <= 30 {
			return nil
		}
	}
	if base, off, ok := strings.Cut(name, "-"); ok && (base == "RTMAX") {
		if n, err := strconv.Atoi(off); err == nil && n >= 0 && n <= 30 {
			return nil
		}
	}
	if !linuxSignals[name] {
		return fmt.Errorf("invalid signal %q", sig)
	}
	return nil
}
