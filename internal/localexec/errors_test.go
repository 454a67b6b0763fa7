package localexec

import (
	"errors"
	"strings"
	"testing"
)

func TestRunNotSupported(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		dockerfile string
		line       int
	}{
		{"RUN in the only stage", "FROM scratch\nCOPY a /a\n\nRUN echo hi\n", 4},
		{"RUN in exec form", "FROM scratch\nRUN [\"/bin/true\"]\n", 2},
		{"RUN continued over lines", "FROM scratch\nENV A=1\nRUN echo a \\\n  && echo b\n", 3},
		{"ONBUILD RUN trigger of the base stage", "FROM scratch AS base\nONBUILD RUN make\nFROM base\nCOPY a /a\n", 3},
		{"RUN is found before any base image is pulled", "FROM 127.0.0.1:1/never/pulled:v1\nCOPY a /a\nRUN make\n", 3},
		{"the first RUN of a needed stage is reported", "FROM scratch AS gen\nRUN gen\nFROM scratch\nRUN late\nCOPY --from=gen /x /x\n", 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := tryBuild(t, Options{ContextDir: writeContext(t, tc.dockerfile, map[string]file{"a": {content: "a"}})})
			if !errors.Is(err, ErrRunNotSupported) {
				t.Fatalf("err = %v, want ErrRunNotSupported", err)
			}
			var be *BuildError
			if !errors.As(err, &be) {
				t.Fatalf("err %T is not a *BuildError", err)
			}
			if be.Line != tc.line {
				t.Errorf("line %d, want %d", be.Line, tc.line)
			}
			msg := err.Error()
			for _, want := range []string{"line " + itoa(tc.line), "RUN needs a container runtime", "kaniko executor"} {
				if !strings.Contains(msg, want) {
					t.Errorf("message %q does not mention %q", msg, want)
				}
			}
		})
	}
}

func TestUserErrors(t *testing.T) {
	t.Parallel()
	files := map[string]file{"a.txt": {content: "a"}, "b.txt": {content: "b"}, "d/f": {content: "f"}}
	tests := []struct {
		name       string
		dockerfile string
		opts       func(*Options)
		line       int
		want       string
	}{
		{"missing COPY source", "FROM scratch\nCOPY missing.txt /x\n", nil, 2, "missing.txt: not found in the build context"},
		{"unknown --from stage", "FROM scratch AS build\nFROM scratch\nCOPY --from=biuld /x /x\n", nil, 3, `no build stage named "biuld"`},
		{"--from a later stage", "FROM scratch AS first\nCOPY --from=later /x /x\nFROM scratch AS later\n", func(o *Options) { o.Target = "first" }, 2, "must be defined before"},
		{"--from a stage index out of range", "FROM scratch\nCOPY --from=3 /x /x\n", nil, 2, "no earlier stage"},
		{"missing file in --from stage", "FROM scratch AS b\nFROM scratch\nCOPY --from=b /nope /x\n", nil, 3, `not found in stage "b"`},
		{"unknown instruction", "FROM scratch\nFROBNICATE now\n", nil, 2, "unknown instruction"},
		{"FROM with wrong arity", "FROM scratch AS\n", nil, 1, "FROM requires either one or three arguments"},
		{"instruction before FROM", "ENV A=1\nFROM scratch\n", nil, 1, "no build stage"},
		{"no FROM at all", "ARG A=1\n", nil, 0, "no FROM instruction"},
		{"empty Dockerfile", "# just a comment\n", nil, 1, "file with no instructions"},
		{"ADD of a URL", "FROM scratch\nADD https://example.com/x.tgz /x\n", nil, 2, "ADD of a URL is not supported by the local executor; use COPY"},
		{"ADD of a git repo", "FROM scratch\nADD git@github.com:o/r.git /src\n", nil, 2, "git repository is not supported"},
		{"chown by name without /etc/passwd", "FROM scratch\nCOPY --chown=app a.txt /a\n", nil, 2, "no readable /etc/passwd"},
		{"chown by unknown name", "FROM scratch\nCOPY a.txt /etc/passwd\nCOPY --chown=nobody a.txt /a\n", nil, 3, `user "nobody" not found`},
		{"invalid chmod", "FROM scratch\nCOPY --chmod=u+x a.txt /a\n", nil, 2, "invalid --chmod"},
		{"several files to a non-directory", "FROM scratch\nCOPY a.txt b.txt /dest\n", nil, 2, "must be a directory and end with a /"},
		{"directory over a file", "FROM scratch\nCOPY a.txt /dest\nCOPY d /dest\n", nil, 3, "not a directory"},
		{"unknown target", "FROM scratch AS one\n", func(o *Options) { o.Target = "two" }, 0, `target stage "two" not found`},
		{"invalid platform", "FROM scratch\n", func(o *Options) { o.Platform = "linux" }, 0, "invalid platform"},
		{"missing Dockerfile", "", nil, 0, "Dockerfile not found"},
		{"Dockerfile outside the context", "", func(o *Options) { o.Dockerfile = "../Dockerfile" }, 0, "must be inside the build context"},
		{"missing ARG value required", "FROM scratch\nARG NAME\nENV X=${NAME:?required}\n", nil, 3, "required"},
		{"bad EXPOSE", "FROM scratch\nEXPOSE http\n", nil, 2, "invalid port"},
		{"bad STOPSIGNAL", "FROM scratch\nSTOPSIGNAL SIGNOPE\n", nil, 2, "invalid signal"},
		{"variable in --from", "FROM scratch AS b\nFROM scratch\nARG S=b\nCOPY --from=$S /x /x\n", nil, 4, "not supported for --from"},
		{"COPY --parents", "FROM scratch\nCOPY --parents a.txt /x/\n", nil, 2, "--parents is not supported"},
		{"invalid image reference", "FROM Not/A:Valid:Ref\n", nil, 1, "invalid image reference"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := Options{ContextDir: writeContext(t, tc.dockerfile, files)}
			if tc.opts != nil {
				tc.opts(&opts)
			}
			_, err := tryBuild(t, opts)
			var be *BuildError
			if !errors.As(err, &be) {
				t.Fatalf("err = %v (%T), want a *BuildError", err, err)
			}
			if be.Line != tc.line {
				t.Errorf("line %d, want %d (%v)", be.Line, tc.line, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not contain %q", err, tc.want)
			}
			if errors.Is(err, ErrRunNotSupported) {
				t.Error("not a RUN problem")
			}
		})
	}
}

func TestCancelledContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := contextWithCancel()
	cancel()
	_, err := Build(ctx, Options{ContextDir: writeContext(t, "FROM scratch\nCOPY a /a\n", map[string]file{"a": {content: "a"}})})
	if err == nil {
		t.Fatal("build with a cancelled context succeeded")
	}
	var be *BuildError
	if errors.As(err, &be) {
		t.Errorf("cancellation reported as a user error: %v", err)
	}
}
