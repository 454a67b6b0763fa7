package localexec

import (
	"bytes"
	"slices"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

// BaseImages returns the images a Dockerfile builds from, as references
// after its build arguments are expanded: every stage's FROM that is not
// an earlier stage or scratch, and every COPY --from that names an image,
// in the order they appear, each once. It is what an executor pulls for
// the build (the provenance's base images); a Dockerfile that does not
// parse gives its parse error.
func BaseImages(dockerfile []byte, buildArgs map[string]string, target, platform string) ([]string, error) {
	b, last, err := argsOnly(dockerfile, buildArgs, target, platform)
	if err != nil || last < 0 {
		return nil, err
	}
	stages := b.stages
	var refs []string
	add := func(ref string) {
		if ref != "" && !strings.EqualFold(ref, "scratch") && !slices.Contains(refs, ref) {
			refs = append(refs, ref)
		}
	}
	for i, st := range stages[:last+1] {
		base, _, err := b.lex.ProcessWord(st.BaseName, b.global)
		if err != nil {
			continue
		}
		if _, ok := b.earlierStage(base, i); !ok {
			add(base)
		}
		for _, cmd := range st.Commands {
			c, ok := cmd.(*instructions.CopyCommand)
			if !ok || c.From == "" {
				continue
			}
			from, _, err := b.lex.ProcessWord(c.From, b.global)
			if err != nil {
				continue
			}
			if _, ok := b.earlierStage(from, i); !ok {
				add(from)
			}
		}
	}
	return refs, nil
}

// FinalBase returns the image the target stage (the last one when target
// is "") starts from, following FROM through earlier stages: "" when it
// starts from scratch.
func FinalBase(dockerfile []byte, buildArgs map[string]string, target, platform string) (string, error) {
	b, i, err := argsOnly(dockerfile, buildArgs, target, platform)
	if err != nil {
		return "", err
	}
	for i >= 0 {
		base, _, err := b.lex.ProcessWord(b.stages[i].BaseName, b.global)
		if err != nil {
			return "", err
		}
		j, ok := b.earlierStage(base, i)
		if !ok {
			if strings.EqualFold(base, "scratch") {
				return "", nil
			}
			return base, nil
		}
		i = j
	}
	return "", nil
}

// argsOnly parses a Dockerfile into a builder that only expands words:
// its stages and global build arguments, and the index of the target
// stage (-1 when there is none).
func argsOnly(dockerfile []byte, buildArgs map[string]string, target, platform string) (*builder, int, error) {
	res, err := parser.Parse(bytes.NewReader(dockerfile))
	if err != nil {
		return nil, -1, dockerfileError(err)
	}
	stages, metaArgs, err := instructions.Parse(res.AST, linter.New(&linter.Config{}))
	if err != nil {
		return nil, -1, dockerfileError(err)
	}
	plat, err := parsePlatform(platform)
	if err != nil {
		return nil, -1, &BuildError{Err: err}
	}
	b := &builder{opts: Options{BuildArgs: buildArgs, Target: target}, platform: plat, lex: shell.NewLex(res.EscapeToken), stages: stages}
	last := len(stages) - 1
	if target != "" {
		if i, ok := b.stageIndex(target); ok {
			last = i
		}
	}
	if last < 0 {
		return b, last, nil
	}
	if err := b.initGlobalArgs(metaArgs, last); err != nil {
		return nil, -1, err
	}
	return b, last, nil
}
