package localexec

import (
	"fmt"
	"strconv"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
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
	// inTrigger is set while the base image's ONBUILD triggers run, so the
	// step log can tell them from the Dockerfile's own instructions.
	inTrigger bool
	// pendingFrom is the stage's FROM line for the step log until it is
	// logged, with the stage's first step.
	pendingFrom string
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
	var parent *stageState // for the step log
	var baseImg v1.Image   // for the step log
	if j, ok := b.earlierStage(baseName, i); ok {
		var err error
		parent, err = b.buildStage(j)
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
		baseImg = img
	}
	s.index, s.name, s.platform = i, st.Name, plat
	b.logFrom(st, s, parent, baseImg)

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

	for k, cmd := range cmds {
		if err := b.checkCtx(); err != nil {
			return nil, err
		}
		s.inTrigger = k < len(triggers)
		if err := b.dispatch(s, cmd); err != nil {
			return nil, err
		}
	}
	s.inTrigger = false
	b.flushFrom(s)
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
	for j := range before {
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
