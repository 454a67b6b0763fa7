package localexec

import (
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

// defaultPathEnv is the PATH BuildKit gives images built FROM scratch; we
// match it so switching executors does not change the config.
const defaultPathEnv = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// stageState is one build stage while and after it is built.
type stageState struct {
	index int
	name  string
	// img has the base image plus every layer and history entry added so
	// far; its config is only made final in finish.
	img v1.Image
	// cfg is the working config: Config, Author and platform fields are
	// authoritative here, history and rootfs come from img.
	cfg *v1.ConfigFile
	// layerType is the media type of the layers we add: the base image's
	// flavour (Docker or OCI), so one manifest never mixes the two.
	layerType types.MediaType
	// args are the ARGs declared in this stage (and inherited from a parent
	// stage) that have a value; they expand like ENV but are not persisted.
	args map[string]string
	// cmdSet records a CMD in this stage, because ENTRYPOINT resets an
	// inherited CMD but not one set in the same stage (docker semantics).
	cmdSet bool
	// index of the stage filesystem (headers only), built on first need.
	fs *imageFS
	// final is the finished image, set once all instructions ran.
	final v1.Image
	// content is a snapshot with file contents, for COPY --from this stage.
	content *imageFS
	// platform is the stage's platform (FROM --platform or the build's);
	// COPY --from=<image> pulls for it.
	platform v1.Platform
	// pullRef names the registry image the stage ultimately derives from,
	// so failures reading its layers are reported as pull failures.
	pullRef string
}

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

// findRun reports the first RUN in the stages the target needs, before
// anything is pulled: a Dockerfile this executor cannot build is then
// recognised at once, whether or not its base images are reachable, so
// callers can route it to kaniko. (RUN triggers inherited through ONBUILD
// can only be seen once the base is pulled; dispatch catches those.)
func (b *builder) findRun(target int) error {
	seen := map[int]bool{}
	first := 0
	var visit func(i int)
	visit = func(i int) {
		if seen[i] {
			return
		}
		seen[i] = true
		st := b.stages[i]
		if base, _, err := b.lex.ProcessWord(st.BaseName, b.global); err == nil {
			if j, ok := b.earlierStage(base, i); ok {
				visit(j)
			}
		}
		for _, cmd := range st.Commands {
			switch c := cmd.(type) {
			case *instructions.RunCommand:
				if l := lineOf(c.Location()); first == 0 || l < first {
					first = l
				}
			case *instructions.CopyCommand:
				if c.From != "" {
					if j, ok := b.earlierStage(c.From, i); ok {
						visit(j)
					}
				}
			}
		}
	}
	visit(target)
	if first == 0 {
		return nil
	}
	return &BuildError{Line: first, Err: ErrRunNotSupported}
}

// lineOf is the first line of a BuildKit location (0 when unknown).
func lineOf(loc []parser.Range) int {
	if len(loc) == 0 {
		return 0
	}
	return loc[0].Start.Line
}

// buildStage builds stage i (once) and the stages it depends on, which
// must come before it, so recursion always terminates.
func (b *builder) buildStage(i int) (*stageState, error) {
	if s := b.built[i]; s != nil {
		return s, nil
	}
	st := b.stages[i]
	line := lineOf(st.Location)

	baseName, _, err := b.lex.ProcessWord(st.BaseName, b.global)
	if err != nil {
		return nil, userErrorf(line, "FROM %s: %v", st.BaseName, err)
	}
	if baseName == "" {
		return nil, userErrorf(line, "FROM %s: base name is empty after expanding build args", st.BaseName)
	}
	plat := b.platform
	if st.Platform != "" {
		ps, _, err := b.lex.ProcessWord(st.Platform, b.global)
		if err != nil {
			return nil, userErrorf(line, "FROM --platform=%s: %v", st.Platform, err)
		}
		if plat, err = parsePlatform(ps); err != nil {
			return nil, userErrorf(line, "FROM --platform: %v", err)
		}
	}

	var s *stageState
	if j, ok := b.earlierStage(baseName, i); ok {
		parent, err := b.buildStage(j)
		if err != nil {
			return nil, err
		}
		s, err = deriveStage(parent)
		if err != nil {
			return nil, err
		}
		if st.Platform == "" {
			plat = parent.platform
		}
	} else if baseName == "scratch" {
		s = scratchStage(plat)
	} else {
		img, err := b.pull(baseName, plat, line)
		if err != nil {
			return nil, err
		}
		if s, err = imageStage(img); err != nil {
			return nil, fmt.Errorf("pull base image %s: %w", baseName, err)
		}
		if err := checkPlatform(s.cfg, plat); err != nil {
			return nil, userErrorf(line, "FROM %s: %v", baseName, err)
		}
		s.pullRef = baseName
	}
	s.index, s.name, s.platform = i, st.Name, plat

	// ONBUILD triggers of the base run first, at the FROM line, and are not
	// inherited further (docker semantics).
	triggers := s.cfg.Config.OnBuild
	s.cfg.Config.OnBuild = nil
	cmds := make([]instructions.Command, 0, len(triggers)+len(st.Commands))
	for _, t := range triggers {
		cmd, err := parseTrigger(t, line)
		if err != nil {
			return nil, err
		}
		cmds = append(cmds, cmd)
	}
	cmds = append(cmds, st.Commands...)

	for _, cmd := range cmds {
		if err := b.checkCtx(); err != nil {
			return nil, err
		}
		if err := b.dispatch(s, cmd); err != nil {
			return nil, err
		}
	}
	if err := s.finish(); err != nil {
		return nil, err
	}
	b.built[i] = s
	return s, nil
}

// earlierStage resolves a FROM or --from reference to a stage defined
// before stage `before`: by name, or by decimal index.
func (b *builder) earlierStage(ref string, before int) (int, bool) {
	if n, err := strconv.Atoi(ref); err == nil {
		return n, n >= 0 && n < before
	}
	for j := 0; j < before; j++ {
		if b.stages[j].Name != "" && strings.EqualFold(b.stages[j].Name, ref) {
			return j, true
		}
	}
	return -1, false
}

// parseTrigger parses one inherited ONBUILD expression. Its location is the
// FROM line, which is where the user can do something about it.
func parseTrigger(expr string, line int) (instructions.Command, error) {
	res, err := parser.Parse(strings.NewReader(expr))
	if err != nil {
		return nil, userErrorf(line, "ONBUILD trigger %q of the base image: %v", expr, err)
	}
	if len(res.AST.Children) != 1 {
		return nil, userErrorf(line, "ONBUILD trigger %q of the base image must be one instruction", expr)
	}
	n := res.AST.Children[0]
	n.StartLine, n.EndLine = line, line
	cmd, err := instructions.ParseCommand(n)
	if err != nil {
		return nil, userErrorf(line, "ONBUILD trigger %q of the base image: %v", expr, err)
	}
	if _, ok := cmd.(*instructions.RunCommand); ok {
		return nil, &BuildError{Line: line, Err: fmt.Errorf("the base image has an ONBUILD %s trigger: %w", expr, ErrRunNotSupported)}
	}
	return cmd, nil
}

// checkPlatform refuses a single-platform base image built for another
// platform (an index was already resolved for the right one): stacking
// amd64 files on an arm64 base gives an image that runs nowhere.
func checkPlatform(cf *v1.ConfigFile, want v1.Platform) error {
	if cf.OS == "" || cf.Architecture == "" {
		return nil // too little metadata to judge; trust the user
	}
	if cf.OS != want.OS || cf.Architecture != want.Architecture ||
		(cf.Variant != "" && want.Variant != "" && cf.Variant != want.Variant) {
		got := v1.Platform{OS: cf.OS, Architecture: cf.Architecture, Variant: cf.Variant}
		return fmt.Errorf("the image is for %s, not %s; set the build platform or use a multi-platform base", got.String(), want.String())
	}
	return nil
}

// scratchStage starts from nothing, with the platform from the options (or
// FROM --platform) and the PATH/WORKDIR defaults BuildKit gives scratch.
// OCI media types: there is no base to be consistent with, and OCI is the
// standard.
func scratchStage(p v1.Platform) *stageState {
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	cfg := &v1.ConfigFile{
		Architecture: p.Architecture,
		OS:           p.OS,
		Variant:      p.Variant,
		OSVersion:    p.OSVersion,
		RootFS:       v1.RootFS{Type: "layers"},
		Config: v1.Config{
			Env:        []string{defaultPathEnv},
			WorkingDir: "/",
		},
	}
	return &stageState{
		img:       base,
		cfg:       cfg,
		layerType: types.OCILayer,
		args:      map[string]string{},
		fs:        newImageFS(),
		pullRef:   "scratch",
	}
}

// imageStage starts from a pulled image, keeping its media-type flavour.
func imageStage(img v1.Image) (*stageState, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	mt, err := img.MediaType()
	if err != nil {
		return nil, err
	}
	lt := types.OCILayer
	if mt == types.DockerManifestSchema2 {
		lt = types.DockerLayer
	}
	return &stageState{
		img:       img,
		cfg:       cf.DeepCopy(),
		layerType: lt,
		args:      map[string]string{},
	}, nil
}

// deriveStage starts a stage FROM an earlier one: its finished image, its
// ARGs (BuildKit carries them over) and, when already computed, its
// filesystem index.
func deriveStage(parent *stageState) (*stageState, error) {
	cf, err := parent.final.ConfigFile()
	if err != nil {
		return nil, err
	}
	s := &stageState{
		img:       parent.final,
		cfg:       cf.DeepCopy(),
		layerType: parent.layerType,
		args:      map[string]string{},
		pullRef:   parent.pullRef,
	}
	for k, v := range parent.args {
		s.args[k] = v
	}
	if parent.fs != nil {
		s.fs = parent.fs.clone()
	}
	return s, nil
}

// finish freezes the stage: the working config goes into the image with a
// pinned creation time and without the host-specific fields docker used to
// record.
func (s *stageState) finish() error {
	cf, err := s.img.ConfigFile()
	if err != nil {
		return err
	}
	out := cf.DeepCopy()
	out.Config = *s.cfg.Config.DeepCopy()
	out.Config.Hostname = ""
	out.Author = s.cfg.Author
	out.Architecture, out.OS, out.Variant, out.OSVersion = s.cfg.Architecture, s.cfg.OS, s.cfg.Variant, s.cfg.OSVersion
	out.Created = v1.Time{Time: epoch}
	out.Container = ""
	out.DockerVersion = "" //nolint:staticcheck // clearing the deprecated field is the point
	img, err := mutate.ConfigFile(s.img, out)
	if err != nil {
		return err
	}
	s.final = img
	return nil
}

// history is the entry recorded for each instruction: fixed text, pinned
// time, and our identity as the comment.
func history(createdBy string, emptyLayer bool) v1.History {
	return v1.History{
		Created:    v1.Time{Time: epoch},
		CreatedBy:  createdBy,
		Comment:    Identity,
		EmptyLayer: emptyLayer,
	}
}

// addHistory records a config-only instruction.
func (s *stageState) addHistory(createdBy string) error {
	img, err := mutate.Append(s.img, mutate.Addendum{History: history(createdBy, true)})
	if err != nil {
		return err
	}
	s.img = img
	return nil
}

// addLayer appends a filesystem layer with its history entry.
func (s *stageState) addLayer(l v1.Layer, createdBy string) error {
	img, err := mutate.Append(s.img, mutate.Addendum{Layer: l, History: history(createdBy, false)})
	if err != nil {
		return err
	}
	s.img = img
	return nil
}

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
	return s.addLayer(l, "WORKDIR "+wd)
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
		return nil, fmt.Errorf("invalid port %q: %v", w, err)
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
