package localexec

import (
	"bytes"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

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
