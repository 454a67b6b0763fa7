package localexec

import (
	"archive/tar"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestReproducible(t *testing.T) {
	t.Parallel()
	dockerfile := "FROM scratch\nCOPY . /app/\nADD archive.tar /unpacked/\nWORKDIR /app/work\nCMD [\"/app/run\"]\n"
	files := map[string]file{
		"run":         {content: "#!/bin/sh\necho run\n", mode: 0o755},
		"lib/a.go":    {content: "package a\n"},
		"lib/b.go":    {content: "package b\n"},
		"lib/link":    {symlink: "a.go"},
		"docs/README": {content: "docs"},
		"archive.tar": {content: string(makeTar(t, false, []tar.Header{
			{Name: "x/", Typeflag: tar.TypeDir, Mode: 0o755},
			{Name: "x/y.txt", Typeflag: tar.TypeReg, Mode: 0o644},
		}, map[string]string{"x/y.txt": "y"}))},
	}
	ctx1 := writeContext(t, dockerfile, files)
	ctx2 := writeContext(t, dockerfile, files)
	// The second context has other mtimes, as a fresh checkout would.
	later := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := filepath.Walk(ctx2, func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.Mode()&os.ModeSymlink != 0 {
			return err
		}
		return os.Chtimes(p, later, later)
	}); err != nil {
		t.Fatal(err)
	}

	first := digestOf(t, build(t, Options{ContextDir: ctx1}))
	tests := []struct {
		name string
		dir  string
	}{
		{"same context built again", ctx1},
		{"copy of the context with other mtimes", ctx2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := digestOf(t, build(t, Options{ContextDir: tc.dir})); got != first {
				t.Errorf("digest %s, want %s", got, first)
			}
		})
	}
	t.Run("changed content changes the digest", func(t *testing.T) {
		t.Parallel()
		ctx3 := writeContext(t, dockerfile, withFile(files, "docs/README", file{content: "other"}))
		if got := digestOf(t, build(t, Options{ContextDir: ctx3})); got == first {
			t.Error("digest did not change with the content")
		}
	})
}

func TestBuildArgs(t *testing.T) {
	t.Parallel()
	dockerfile := `ARG BASE=scratch
ARG FLAVOR=plain
FROM ${BASE} AS base
ARG VERSION=0.0.1
ARG COMMIT
ARG FLAVOR
ARG DERIVED=v${VERSION}
ENV APP_VERSION=$VERSION COMMIT=${COMMIT:-none} FLAVOR=${FLAVOR} DERIVED=$DERIVED
LABEL version="${VERSION}" flavor=$FLAVOR
WORKDIR /opt/$VERSION
COPY ${VERSION}.txt ./
`
	files := map[string]file{"0.0.1.txt": {content: "old"}, "2.0.txt": {content: "new"}}
	tests := []struct {
		name      string
		args      map[string]string
		wantEnv   []string
		wantLabel map[string]string
		wantFile  string
	}{
		{
			name:      "defaults apply without build args",
			wantEnv:   []string{defaultPathEnv, "APP_VERSION=0.0.1", "COMMIT=none", "FLAVOR=plain", "DERIVED=v0.0.1"},
			wantLabel: map[string]string{"version": "0.0.1", "flavor": "plain"},
			wantFile:  "opt/0.0.1/0.0.1.txt",
		},
		{
			name:      "build args override defaults and unused ones are ignored",
			args:      map[string]string{"VERSION": "2.0", "COMMIT": "abc123", "FLAVOR": "fancy", "NOT_DECLARED": "x"},
			wantEnv:   []string{defaultPathEnv, "APP_VERSION=2.0", "COMMIT=abc123", "FLAVOR=fancy", "DERIVED=v2.0"},
			wantLabel: map[string]string{"version": "2.0", "flavor": "fancy"},
			wantFile:  "opt/2.0/2.0.txt",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			img := build(t, Options{ContextDir: writeContext(t, dockerfile, files), BuildArgs: tc.args})
			cf := configOf(t, img)
			if !equalStrings(cf.Config.Env, tc.wantEnv) {
				t.Errorf("env %q, want %q", cf.Config.Env, tc.wantEnv)
			}
			if !reflect.DeepEqual(cf.Config.Labels, tc.wantLabel) {
				t.Errorf("labels %v, want %v", cf.Config.Labels, tc.wantLabel)
			}
			if _, ok := flatten(t, img)[tc.wantFile]; !ok {
				t.Errorf("%s not in image", tc.wantFile)
			}
			for _, e := range cf.Config.Env {
				if strings.HasPrefix(e, "NOT_DECLARED") {
					t.Errorf("undeclared build arg leaked into env: %s", e)
				}
			}
			for _, h := range cf.History {
				if strings.HasPrefix(h.CreatedBy, "ARG") {
					t.Errorf("ARG recorded in history: %q", h.CreatedBy)
				}
			}
		})
	}

	t.Run("meta ARG selects the base stage", func(t *testing.T) {
		t.Parallel()
		df := "ARG FROM_STAGE=one\nFROM scratch AS one\nLABEL from=one\nFROM scratch AS two\nLABEL from=two\nFROM ${FROM_STAGE}\n"
		for arg, want := range map[string]string{"": "one", "two": "two"} {
			opts := Options{ContextDir: writeContext(t, df, nil)}
			if arg != "" {
				opts.BuildArgs = map[string]string{"FROM_STAGE": arg}
			}
			if got := configOf(t, build(t, opts)).Config.Labels["from"]; got != want {
				t.Errorf("FROM_STAGE=%q: label from=%q, want %q", arg, got, want)
			}
		}
	})
}

func TestMultiStage(t *testing.T) {
	t.Parallel()
	dockerfile := `FROM scratch AS builder
COPY src/ /src/
COPY app.bin /out/app
ENV BUILDER=1

FROM scratch AS tests
RUN go test ./...

FROM builder AS extended
COPY extra.txt /out/

FROM scratch
COPY --from=builder /out/app /usr/bin/app
COPY --from=0 /src /copied
COPY --from=extended /out/extra.txt /extra.txt
`
	files := map[string]file{
		"src/main.go":    {content: "package main"},
		"src/pkg/lib.go": {content: "package pkg"},
		"app.bin":        {content: "ELF", mode: 0o755},
		"extra.txt":      {content: "extra"},
	}
	ctxDir := writeContext(t, dockerfile, files)

	t.Run("final stage gets only what it copies and skips unused RUN stages", func(t *testing.T) {
		t.Parallel()
		img := build(t, Options{ContextDir: ctxDir})
		fs := flatten(t, img)
		want := map[string]string{
			"usr/bin/app":       "ELF",
			"copied/main.go":    "package main",
			"copied/pkg/lib.go": "package pkg",
			"extra.txt":         "extra",
			"usr/bin":           "",
			"copied/pkg":        "",
		}
		for p, content := range want {
			e, ok := fs[p]
			if !ok {
				t.Errorf("%s missing", p)
				continue
			}
			if e.content != content {
				t.Errorf("%s = %q, want %q", p, e.content, content)
			}
		}
		if e := fs["usr/bin/app"]; e.mode != 0o755 {
			t.Errorf("usr/bin/app mode %o, want 755", e.mode)
		}
		for _, p := range []string{"src", "out", "src/main.go"} {
			if _, ok := fs[p]; ok {
				t.Errorf("%s leaked from the builder stage", p)
			}
		}
		if env := configOf(t, img).Config.Env; len(env) != 1 {
			t.Errorf("builder ENV leaked into final stage: %q", env)
		}
	})

	t.Run("target selects an earlier stage", func(t *testing.T) {
		t.Parallel()
		img := build(t, Options{ContextDir: ctxDir, Target: "builder"})
		fs := flatten(t, img)
		for _, p := range []string{"src/main.go", "src/pkg/lib.go", "out/app"} {
			if _, ok := fs[p]; !ok {
				t.Errorf("%s missing from target builder", p)
			}
		}
		if _, ok := fs["usr/bin/app"]; ok {
			t.Error("target builder contains files of the last stage")
		}
		if env := configOf(t, img).Config.Env; !equalStrings(env, []string{defaultPathEnv, "BUILDER=1"}) {
			t.Errorf("env %q", env)
		}
	})

	t.Run("FROM an earlier stage inherits its layers and config", func(t *testing.T) {
		t.Parallel()
		img := build(t, Options{ContextDir: ctxDir, Target: "EXTENDED"})
		if n := len(imageLayers(t, img)); n != 3 {
			t.Errorf("%d layers, want builder's 2 plus 1", n)
		}
		if env := configOf(t, img).Config.Env; !equalStrings(env, []string{defaultPathEnv, "BUILDER=1"}) {
			t.Errorf("env %q", env)
		}
	})

	t.Run("the RUN stage fails when targeted", func(t *testing.T) {
		t.Parallel()
		_, err := tryBuild(t, Options{ContextDir: ctxDir, Target: "tests"})
		if !errors.Is(err, ErrRunNotSupported) {
			t.Fatalf("err = %v, want ErrRunNotSupported", err)
		}
	})
}
