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

	"github.com/google/go-containerregistry/pkg/v1/types"
)

func TestScratchImage(t *testing.T) {
	t.Parallel()
	dockerfile := `FROM scratch
COPY hello.txt /hello.txt
COPY dir /opt/dir/
COPY bin/tool /usr/local/bin/
ENV APP_ENV=prod GREETING="hello world"
LABEL org.example.team=platform version=1.0
WORKDIR /app
USER 1000:1000
EXPOSE 8080 53/udp 9000-9001
ENTRYPOINT ["/usr/local/bin/tool"]
CMD ["--serve"]
`
	ctxDir := writeContext(t, dockerfile, map[string]file{
		"hello.txt":     {content: "hello\n"},
		"dir/a.txt":     {content: "a"},
		"dir/sub/b.txt": {content: "b", mode: 0o600},
		"bin/tool":      {content: "#!/bin/sh\n", mode: 0o755},
		"unused.txt":    {content: "not copied"},
	})
	img := build(t, Options{ContextDir: ctxDir})
	cf := configOf(t, img)

	t.Run("config fields are as written", func(t *testing.T) {
		t.Parallel()
		checks := []struct {
			name      string
			got, want any
		}{
			{"env keeps scratch PATH then ENV in order", cf.Config.Env, []string{defaultPathEnv, "APP_ENV=prod", "GREETING=hello world"}},
			{"labels", cf.Config.Labels, map[string]string{"org.example.team": "platform", "version": "1.0"}},
			{"workdir", cf.Config.WorkingDir, "/app"},
			{"user", cf.Config.User, "1000:1000"},
			{"exposed ports default to tcp and expand ranges", cf.Config.ExposedPorts, map[string]struct{}{"8080/tcp": {}, "53/udp": {}, "9000/tcp": {}, "9001/tcp": {}}},
			{"entrypoint", cf.Config.Entrypoint, []string{"/usr/local/bin/tool"}},
			{"cmd", cf.Config.Cmd, []string{"--serve"}},
			{"os from default platform", cf.OS, "linux"},
			{"architecture from default platform", cf.Architecture, "amd64"},
			{"created is the epoch", cf.Created.Time.UTC(), time.Unix(0, 0).UTC()},
			{"no hostname", cf.Config.Hostname, ""},
			{"one diff id per layer", len(cf.RootFS.DiffIDs), 4},
		}
		for _, c := range checks {
			if !reflect.DeepEqual(c.got, c.want) {
				t.Errorf("%s: got %#v, want %#v", c.name, c.got, c.want)
			}
		}
	})

	t.Run("layers hold exactly the copied files", func(t *testing.T) {
		t.Parallel()
		layers := imageLayers(t, img)
		want := [][]entry{
			{{name: "hello.txt", typ: tar.TypeReg, mode: 0o644, content: "hello\n"}},
			{
				{name: "opt/", typ: tar.TypeDir, mode: 0o755},
				{name: "opt/dir/", typ: tar.TypeDir, mode: 0o755},
				{name: "opt/dir/a.txt", typ: tar.TypeReg, mode: 0o644, content: "a"},
				{name: "opt/dir/sub/", typ: tar.TypeDir, mode: 0o755},
				{name: "opt/dir/sub/b.txt", typ: tar.TypeReg, mode: 0o600, content: "b"},
			},
			{
				{name: "usr/", typ: tar.TypeDir, mode: 0o755},
				{name: "usr/local/", typ: tar.TypeDir, mode: 0o755},
				{name: "usr/local/bin/", typ: tar.TypeDir, mode: 0o755},
				{name: "usr/local/bin/tool", typ: tar.TypeReg, mode: 0o755, content: "#!/bin/sh\n"},
			},
			{{name: "app/", typ: tar.TypeDir, mode: 0o755}},
		}
		if len(layers) != len(want) {
			t.Fatalf("got %d layers, want %d: %v", len(layers), len(want), layers)
		}
		for i := range want {
			got := layers[i]
			for j := range got {
				if !got[j].mtime.Equal(time.Unix(0, 0)) {
					t.Errorf("layer %d %s: mtime %v, want the epoch", i, got[j].name, got[j].mtime)
				}
				got[j].mtime = time.Time{}
			}
			if !reflect.DeepEqual(got, want[i]) {
				t.Errorf("layer %d:\n got %+v\nwant %+v", i, got, want[i])
			}
		}
	})

	t.Run("media types are OCI throughout", func(t *testing.T) {
		t.Parallel()
		m, err := img.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		if m.MediaType != types.OCIManifestSchema1 || m.Config.MediaType != types.OCIConfigJSON {
			t.Errorf("manifest %s config %s, want OCI", m.MediaType, m.Config.MediaType)
		}
		for _, l := range m.Layers {
			if l.MediaType != types.OCILayer {
				t.Errorf("layer media type %s, want %s", l.MediaType, types.OCILayer)
			}
		}
	})

	t.Run("history has one fixed entry per instruction", func(t *testing.T) {
		t.Parallel()
		var createdBy []string
		layers := 0
		for _, h := range cf.History {
			if !h.Created.Time.Equal(time.Unix(0, 0)) {
				t.Errorf("history %q created %v, want the epoch", h.CreatedBy, h.Created)
			}
			if h.Comment != Identity {
				t.Errorf("history %q comment %q, want %q", h.CreatedBy, h.Comment, Identity)
			}
			if !h.EmptyLayer {
				layers++
			}
			createdBy = append(createdBy, h.CreatedBy)
		}
		want := []string{
			"COPY hello.txt /hello.txt",
			"COPY dir /opt/dir/",
			"COPY bin/tool /usr/local/bin/",
			"ENV APP_ENV=prod GREETING=hello world",
			"LABEL org.example.team=platform version=1.0",
			"WORKDIR /app",
			"USER 1000:1000",
			"EXPOSE 53/udp 8080/tcp 9000/tcp 9001/tcp", // BuildKit sorts the words
			`ENTRYPOINT ["/usr/local/bin/tool"]`,
			`CMD ["--serve"]`,
		}
		if !equalStrings(createdBy, want) {
			t.Errorf("history:\n got %q\nwant %q", createdBy, want)
		}
		if layers != 4 {
			t.Errorf("%d history entries with layers, want 4", layers)
		}
	})
}

func TestConfigInstructions(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		dockerfile string
		opts       func(*Options)
		check      func(t *testing.T, cfgFile map[string]any, c *configView)
	}{
		{
			name:       "shell form CMD runs under /bin/sh -c",
			dockerfile: "FROM scratch\nCMD echo \"hi there\" && exit 0\n",
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "Cmd", c.cf.Config.Cmd, []string{"/bin/sh", "-c", `echo "hi there" && exit 0`})
			},
		},
		{
			name:       "shell form ENTRYPOINT uses SHELL",
			dockerfile: "FROM scratch\nSHELL [\"/bin/bash\", \"-eu\", \"-c\"]\nENTRYPOINT exec server --port 80\n",
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "Entrypoint", c.cf.Config.Entrypoint, []string{"/bin/bash", "-eu", "-c", "exec server --port 80"})
				c.eq(t, "Shell", c.cf.Config.Shell, []string{"/bin/bash", "-eu", "-c"})
			},
		},
		{
			name:       "ENTRYPOINT drops an inherited CMD",
			dockerfile: "FROM scratch AS base\nCMD [\"old\"]\nFROM base\nENTRYPOINT [\"new\"]\n",
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "Cmd", c.cf.Config.Cmd, []string(nil))
				c.eq(t, "Entrypoint", c.cf.Config.Entrypoint, []string{"new"})
			},
		},
		{
			name:       "ENTRYPOINT keeps a CMD of the same stage",
			dockerfile: "FROM scratch\nCMD [\"arg\"]\nENTRYPOINT [\"new\"]\n",
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "Cmd", c.cf.Config.Cmd, []string{"arg"})
			},
		},
		{
			name: "STOPSIGNAL VOLUME HEALTHCHECK MAINTAINER and ONBUILD go into the config",
			dockerfile: `FROM scratch
STOPSIGNAL SIGQUIT
VOLUME ["/data", "/cache"]
VOLUME /logs
HEALTHCHECK --interval=30s --timeout=5s --retries=3 CMD ["/healthz"]
MAINTAINER someone@example.com
ONBUILD COPY . /src
`,
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "StopSignal", c.cf.Config.StopSignal, "SIGQUIT")
				c.eq(t, "Volumes", c.cf.Config.Volumes, map[string]struct{}{"/data": {}, "/cache": {}, "/logs": {}})
				hc := c.cf.Config.Healthcheck
				if hc == nil {
					t.Fatal("no healthcheck")
				}
				c.eq(t, "Healthcheck.Test", hc.Test, []string{"CMD", "/healthz"})
				c.eq(t, "Healthcheck.Interval", hc.Interval, 30*time.Second)
				c.eq(t, "Healthcheck.Timeout", hc.Timeout, 5*time.Second)
				c.eq(t, "Healthcheck.Retries", hc.Retries, 3)
				c.eq(t, "Author", c.cf.Author, "someone@example.com")
				c.eq(t, "OnBuild", c.cf.Config.OnBuild, []string{"COPY . /src"})
			},
		},
		{
			name:       "relative WORKDIR resolves against the previous one",
			dockerfile: "FROM scratch\nWORKDIR /srv\nWORKDIR app\nWORKDIR ../data\n",
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "WorkingDir", c.cf.Config.WorkingDir, "/srv/data")
			},
		},
		{
			name:       "Platform option sets os architecture and variant",
			dockerfile: "FROM scratch\nARG TARGETPLATFORM\nARG TARGETARCH\nLABEL p=$TARGETPLATFORM a=$TARGETARCH\n",
			opts:       func(o *Options) { o.Platform = "linux/arm/v7" },
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "OS", c.cf.OS, "linux")
				c.eq(t, "Architecture", c.cf.Architecture, "arm")
				c.eq(t, "Variant", c.cf.Variant, "v7")
				c.eq(t, "Labels", c.cf.Config.Labels, map[string]string{"p": "linux/arm/v7", "a": "arm"})
			},
		},
		{
			name:       "Labels option overrides LABEL",
			dockerfile: "FROM scratch\nLABEL team=a keep=yes\n",
			opts:       func(o *Options) { o.Labels = map[string]string{"team": "buildq", "extra": "1"} },
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "Labels", c.cf.Config.Labels, map[string]string{"team": "buildq", "keep": "yes", "extra": "1"})
			},
		},
		{
			name:       "created is serialised as 1970-01-01T00:00:00Z",
			dockerfile: "FROM scratch\nENV A=1\n",
			check: func(t *testing.T, raw map[string]any, c *configView) {
				c.eq(t, "created", raw["created"], "1970-01-01T00:00:00Z")
			},
		},
		{
			name:       "lint directives in comments are accepted",
			dockerfile: "# check=skip=JSONArgsRecommended\nFROM scratch AS Base\n# check=error=true\nCMD run\n",
			check: func(t *testing.T, _ map[string]any, c *configView) {
				c.eq(t, "Cmd", c.cf.Config.Cmd, []string{"/bin/sh", "-c", "run"})
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			opts := Options{ContextDir: writeContext(t, tc.dockerfile, nil)}
			if tc.opts != nil {
				tc.opts(&opts)
			}
			img := build(t, opts)
			raw := map[string]any{}
			rawCfg, err := img.RawConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			if err := jsonUnmarshal(rawCfg, &raw); err != nil {
				t.Fatal(err)
			}
			tc.check(t, raw, &configView{cf: configOf(t, img)})
		})
	}
}

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

func TestCopySemantics(t *testing.T) {
	t.Parallel()
	files := map[string]file{
		"a.txt":          {content: "a"},
		"b.txt":          {content: "b"},
		"c.md":           {content: "c"},
		"dir/x":          {content: "x"},
		"dir/nested/y":   {content: "y"},
		"dir/link":       {symlink: "x"},
		"link-to-a":      {symlink: "a.txt"},
		"tree/keep.go":   {content: "go"},
		"tree/drop.log":  {content: "log"},
		"tree/sub/z.log": {content: "log"},
		"secret.env":     {content: "TOKEN=1"},
		"node_modules/m": {content: "m"},
		".dockerignore":  {content: "secret.env\nnode_modules\n"},
	}
	tests := []struct {
		name  string
		body  string
		want  map[string]string // path -> content ("" for directories, "->target" for symlinks)
		avoid []string
	}{
		{
			name: "file to a new name",
			body: "COPY a.txt /renamed",
			want: map[string]string{"renamed": "a"},
		},
		{
			name: "several files into a directory",
			body: "COPY a.txt b.txt /d/",
			want: map[string]string{"d": "", "d/a.txt": "a", "d/b.txt": "b"},
		},
		{
			name: "file into an existing directory without trailing slash",
			body: "COPY a.txt /d/\nCOPY b.txt /d",
			want: map[string]string{"d/a.txt": "a", "d/b.txt": "b"},
		},
		{
			name: "directory contents, not the directory, go to dest",
			body: "COPY dir /target",
			want: map[string]string{"target/x": "x", "target/nested/y": "y", "target/link": "->x"},
		},
		{
			name:  "wildcards",
			body:  "COPY *.txt /w/",
			want:  map[string]string{"w/a.txt": "a", "w/b.txt": "b"},
			avoid: []string{"w/c.md"},
		},
		{
			name: "a wildcard matching nothing is fine",
			body: "COPY *.none /nothing/",
			want: map[string]string{"nothing": ""},
		},
		{
			name: "a symlink source is followed",
			body: "COPY link-to-a /followed",
			want: map[string]string{"followed": "a"},
		},
		{
			name: "destination relative to WORKDIR",
			body: "WORKDIR /srv\nCOPY a.txt .\nCOPY b.txt rel/\nCOPY c.md renamed.md",
			want: map[string]string{"srv/a.txt": "a", "srv/rel/b.txt": "b", "srv/renamed.md": "c"},
		},
		{
			name:  "dockerignore hides files",
			body:  "COPY . /ctx/",
			want:  map[string]string{"ctx/a.txt": "a", "ctx/dir/nested/y": "y"},
			avoid: []string{"ctx/secret.env", "ctx/node_modules", "ctx/node_modules/m"},
		},
		{
			name:  "exclude flag",
			body:  "COPY --exclude=*.log --exclude=sub tree /t/",
			want:  map[string]string{"t/keep.go": "go"},
			avoid: []string{"t/drop.log", "t/sub", "t/sub/z.log"},
		},
		{
			name: "heredoc",
			body: "ARG WHO=world\nCOPY <<EOF /etc/motd\nhello $WHO\nEOF",
			want: map[string]string{"etc/motd": "hello world\n"},
		},
		{
			name: "later source overwrites earlier in the same COPY",
			body: "COPY a.txt /same\nCOPY b.txt /same",
			want: map[string]string{"same": "b"},
		},
		{
			name:  "copy through a symlinked directory lands in its target",
			body:  "COPY root /\nCOPY dir /real/\nCOPY a.txt /lnk/new.txt\nCOPY b.txt /lnk/",
			want:  map[string]string{"lnk": "->real", "real/new.txt": "a", "real/b.txt": "b", "real/x": "x"},
			avoid: []string{"lnk/new.txt", "lnk/b.txt"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctxDir := writeContext(t, "FROM scratch\n"+tc.body+"\n", withFile(files, "root/lnk", file{symlink: "real"}))
			fs := flatten(t, build(t, Options{ContextDir: ctxDir}))
			for p, want := range tc.want {
				e, ok := fs[p]
				if !ok {
					t.Errorf("%s missing; have %v", p, keys(fs))
					continue
				}
				got := e.content
				if e.typ == tar.TypeSymlink {
					got = "->" + e.linkname
				}
				if got != want {
					t.Errorf("%s = %q, want %q", p, got, want)
				}
			}
			for _, p := range tc.avoid {
				if _, ok := fs[p]; ok {
					t.Errorf("%s should not be in the image", p)
				}
			}
		})
	}
}

func TestChownChmod(t *testing.T) {
	t.Parallel()
	files := map[string]file{"f": {content: "f"}, "d/g": {content: "g"}, "d/sub/h": {content: "h"}}
	tests := []struct {
		name string
		body string
		want map[string][3]int64 // name -> uid, gid, mode
	}{
		{
			name: "numeric uid and gid with chmod",
			body: "COPY --chown=1000:2000 --chmod=0750 f /opt/f",
			want: map[string][3]int64{"opt/": {1000, 2000, 0o755}, "opt/f": {1000, 2000, 0o750}},
		},
		{
			name: "lone uid doubles as gid",
			body: "COPY --chown=55 f /f",
			want: map[string][3]int64{"f": {55, 55, 0o644}},
		},
		{
			name: "directory copy chowns every entry and chmod applies to dirs too",
			body: "COPY --chown=7:8 --chmod=700 d /app/",
			want: map[string][3]int64{"app/": {7, 8, 0o755}, "app/g": {7, 8, 0o700}, "app/sub/": {7, 8, 0o700}, "app/sub/h": {7, 8, 0o700}},
		},
		{
			name: "build args expand in chown",
			body: "ARG UID=1234\nCOPY --chown=${UID}:${UID} f /f",
			want: map[string][3]int64{"f": {1234, 1234, 0o644}},
		},
		{
			name: "names resolve from the stage's passwd and group",
			body: "COPY passwd /etc/passwd\nCOPY group /etc/group\nCOPY --chown=app:staff f /f",
			want: map[string][3]int64{"f": {1001, 50, 0o644}},
		},
		{
			name: "user name alone takes the primary group",
			body: "COPY passwd group /etc/\nCOPY --chown=app f /f",
			want: map[string][3]int64{"f": {1001, 1001, 0o644}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs := withFile(files, "passwd", file{content: "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001::/home/app:/bin/sh\n"})
			fs = withFile(fs, "group", file{content: "root:x:0:\nstaff:x:50:app\n"})
			img := build(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", fs)})
			layers := imageLayers(t, img)
			last := layers[len(layers)-1]
			got := map[string][3]int64{}
			for _, e := range last {
				got[e.name] = [3]int64{int64(e.uid), int64(e.gid), e.mode}
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("last layer owners/modes %v, want %v", got, tc.want)
			}
		})
	}
}

func TestAddArchive(t *testing.T) {
	t.Parallel()
	headers := []tar.Header{
		{Name: "./", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "./pkg/", Typeflag: tar.TypeDir, Mode: 0o750, Uid: 10, Gid: 20},
		{Name: "./pkg/bin", Typeflag: tar.TypeReg, Mode: 0o755, Uid: 10, Gid: 20},
		{Name: "./pkg/hard", Typeflag: tar.TypeLink, Linkname: "./pkg/bin"},
		{Name: "./pkg/soft", Typeflag: tar.TypeSymlink, Linkname: "bin"},
		{Name: "implied/dir/file", Typeflag: tar.TypeReg, Mode: 0o600},
	}
	contents := map[string]string{"./pkg/bin": "binary", "implied/dir/file": "deep"}
	files := map[string]file{
		"release.tar.gz": {content: string(makeTar(t, true, headers, contents))},
		"plain.data":     {content: string(makeTar(t, false, headers, contents))},
		"notes.txt":      {content: "just text"},
	}
	tests := []struct {
		name  string
		body  string
		want  map[string]entry
		avoid []string
	}{
		{
			name: "gzip tar is extracted keeping modes and owners",
			body: "ADD release.tar.gz /opt/",
			want: map[string]entry{
				"opt/pkg":              {typ: tar.TypeDir, mode: 0o750, uid: 10, gid: 20},
				"opt/pkg/bin":          {typ: tar.TypeReg, mode: 0o755, uid: 10, gid: 20, content: "binary"},
				"opt/pkg/hard":         {typ: tar.TypeReg, mode: 0o755, uid: 10, gid: 20, content: "binary"},
				"opt/pkg/soft":         {typ: tar.TypeSymlink, mode: 0o777, linkname: "bin"},
				"opt/implied/dir/file": {typ: tar.TypeReg, mode: 0o600, content: "deep"},
			},
			avoid: []string{"opt/release.tar.gz"},
		},
		{
			name: "archive detection ignores the file name and dest needs no slash",
			body: "ADD --chown=3:4 plain.data /x",
			want: map[string]entry{
				"x/pkg/bin":  {typ: tar.TypeReg, mode: 0o755, uid: 3, gid: 4, content: "binary"},
				"x/implied":  {typ: tar.TypeDir, mode: 0o755, uid: 3, gid: 4},
				"x/pkg/soft": {typ: tar.TypeSymlink, mode: 0o777, uid: 3, gid: 4, linkname: "bin"},
			},
		},
		{
			name: "non-archives are copied as files",
			body: "ADD notes.txt /notes.txt",
			want: map[string]entry{"notes.txt": {typ: tar.TypeReg, mode: 0o644, content: "just text"}},
		},
		{
			name:  "COPY never extracts",
			body:  "COPY release.tar.gz /r/",
			want:  map[string]entry{"r/release.tar.gz": {typ: tar.TypeReg, mode: 0o644, content: files["release.tar.gz"].content}},
			avoid: []string{"r/pkg"},
		},
		{
			name:  "ADD --unpack=false copies the archive",
			body:  "ADD --unpack=false release.tar.gz /r/",
			want:  map[string]entry{"r/release.tar.gz": {typ: tar.TypeReg, mode: 0o644, content: files["release.tar.gz"].content}},
			avoid: []string{"r/pkg"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs := flatten(t, build(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", files)}))
			for p, want := range tc.want {
				got, ok := fs[p]
				if !ok {
					t.Errorf("%s missing; have %v", p, keys(fs))
					continue
				}
				got.name, got.mtime = "", time.Time{}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("%s = %+v, want %+v", p, got, want)
				}
			}
			for _, p := range tc.avoid {
				if _, ok := fs[p]; ok {
					t.Errorf("%s should not be in the image", p)
				}
			}
		})
	}
}

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

func TestWorkdirLayers(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		body       string
		wantLayers int
		wantLast   []string
	}{
		{"a new WORKDIR creates the directory", "WORKDIR /a/b", 1, []string{"a/", "a/b/"}},
		{"an existing directory adds no layer", "COPY x /a/b/x\nWORKDIR /a/b", 1, []string{"a/", "a/b/", "a/b/x"}},
		{"the root adds no layer", "WORKDIR /", 0, nil},
		{"a nested relative WORKDIR creates only what is missing", "WORKDIR /a\nWORKDIR b", 2, []string{"a/b/"}},
		{"WORKDIR is created as USER", "USER 42:43\nWORKDIR /home/me", 1, []string{"home/", "home/me/"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			img := build(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", map[string]file{"x": {content: "x"}})})
			layers := imageLayers(t, img)
			if len(layers) != tc.wantLayers {
				t.Fatalf("%d layers, want %d", len(layers), tc.wantLayers)
			}
			if tc.wantLayers == 0 {
				return
			}
			last := layers[len(layers)-1]
			if got := names(last); !equalStrings(got, tc.wantLast) {
				t.Errorf("last layer %q, want %q", got, tc.wantLast)
			}
			if strings.Contains(tc.body, "USER 42") {
				for _, e := range last {
					if e.uid != 42 || e.gid != 43 {
						t.Errorf("%s owned by %d:%d, want 42:43", e.name, e.uid, e.gid)
					}
				}
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

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestDockerfileLocation(t *testing.T) {
	t.Parallel()
	files := map[string]file{
		"build/app.Dockerfile":              {content: "FROM scratch\nCOPY . /ctx/\n"},
		"build/app.Dockerfile.dockerignore": {content: "*.secret\nbuild\n"},
		".dockerignore":                     {content: "keep.txt\n"},
		"keep.txt":                          {content: "k"},
		"x.secret":                          {content: "s"},
	}
	img := build(t, Options{ContextDir: writeContext(t, "", files), Dockerfile: "build/app.Dockerfile"})
	fs := flatten(t, img)
	if _, ok := fs["ctx/keep.txt"]; !ok {
		t.Error("the Dockerfile-specific ignore file should replace .dockerignore")
	}
	for _, p := range []string{"ctx/x.secret", "ctx/build"} {
		if _, ok := fs[p]; ok {
			t.Errorf("%s should be ignored", p)
		}
	}
}

func TestAddRefusals(t *testing.T) {
	t.Parallel()
	xz := string([]byte{0xfd, '7', 'z', 'X', 'Z', 0x00, 1, 2, 3})
	tests := []struct {
		name string
		body string
		want string
	}{
		{"xz archives", "ADD data.tar.xz /d/", "xz-compressed archives are not supported"},
		{"checksum", "ADD --checksum=sha256:0000000000000000000000000000000000000000000000000000000000000000 data.tar.xz /d/", "--checksum"},
		{"http URL", "ADD http://example.com/file /file", "ADD of a URL is not supported by the local executor; use COPY"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := tryBuild(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", map[string]file{"data.tar.xz": {content: xz}})})
			var be *BuildError
			if !errors.As(err, &be) || be.Line != 2 || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want a BuildError at line 2 mentioning %q", err, tc.want)
			}
		})
	}
}
