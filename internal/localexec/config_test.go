package localexec

import (
	"archive/tar"
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
