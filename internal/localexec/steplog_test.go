package localexec

import (
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// recordLog collects the lines of Options.Log.
type recordLog struct{ lines []string }

func (r *recordLog) log(line string) { r.lines = append(r.lines, line) }

const (
	reDigest = `sha256:[0-9a-f]{64}`
	reLayer  = `layer ` + reDigest + ` \(\d+ B\)`
)

// matchLines asserts the lines one by one against anchored regexps.
func matchLines(t *testing.T, got, want []string) {
	t.Helper()
	for i := 0; i < len(got) || i < len(want); i++ {
		switch {
		case i >= len(got):
			t.Errorf("line %d missing, want /%s/", i, want[i])
		case i >= len(want):
			t.Errorf("line %d = %q, not expected", i, got[i])
		case !regexp.MustCompile(`^` + want[i] + `$`).MatchString(got[i]):
			t.Errorf("line %d = %q, want /%s/", i, got[i], want[i])
		}
	}
	if t.Failed() {
		t.Logf("all lines:\n%s", strings.Join(got, "\n"))
	}
}

// layerLines are the digests named by the "layer …" lines, in order.
func layerLines(lines []string) []string {
	var out []string
	for _, l := range lines {
		if d, ok := strings.CutPrefix(l, "layer "); ok {
			d, _, _ = strings.Cut(d, " ")
			out = append(out, d)
		}
	}
	return out
}

// checkDigests asserts that the "layer" lines name the last newLayers
// layers of img and the last line its manifest digest.
func checkDigests(t *testing.T, img v1.Image, lines []string, newLayers int) {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, l := range ls[len(ls)-newLayers:] {
		d, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, d.String())
	}
	if got := layerLines(lines); !equalStrings(got, want) {
		t.Errorf("layer lines name %q, want the image's new layers %q", got, want)
	}
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "built image "+digestOf(t, img).String()+" for ") {
		t.Errorf("last line %q does not name the image digest %s", last, digestOf(t, img))
	}
}

func TestStepLogScratch(t *testing.T) {
	t.Parallel()
	dockerfile := `FROM scratch
ENV APP_HOME=/srv/app
WORKDIR $APP_HOME
COPY app/ ./
COPY --chmod=0755 run.sh \
     /usr/local/bin/run
COPY <<EOF /etc/motd
hello
EOF
USER 1000
CMD ["/usr/local/bin/run"]
`
	ctxDir := writeContext(t, dockerfile, map[string]file{
		"app/a.txt":   {content: "aaaaa"},
		"app/b/c.txt": {content: strings.Repeat("c", 1500)},
		"run.sh":      {content: "#!/bin/sh\n"},
	})
	rec := &recordLog{}
	img := build(t, Options{ContextDir: ctxDir, Log: rec.log})

	matchLines(t, rec.lines, []string{
		`FROM scratch`,
		`ENV APP_HOME=/srv/app`,
		`WORKDIR \$APP_HOME`,
		reLayer,
		`COPY app/ \./: 2 files, 1\.5 KiB`,
		reLayer,
		`COPY --chmod=0755 run\.sh /usr/local/bin/run: 1 file, 10 B`,
		reLayer,
		`COPY <<EOF /etc/motd: 1 file, 6 B`,
		reLayer,
		`USER 1000`,
		`CMD \["/usr/local/bin/run"\]`,
		`built image ` + reDigest + ` for linux/amd64`,
	})
	checkDigests(t, img, rec.lines, 4)

	t.Run("the log does not change the image", func(t *testing.T) {
		if got, want := digestOf(t, build(t, Options{ContextDir: ctxDir})), digestOf(t, img); got != want {
			t.Errorf("digest without Log %s, with Log %s", got, want)
		}
	})
}

func TestStepLogRegistry(t *testing.T) {
	t.Parallel()
	reg := startRegistry(t)
	dockerfile := `ARG TAG=v1
FROM ` + reg.host + `/base:${TAG} AS build
ARG TOKEN
ENV TOKEN_SHA=${TOKEN}
LABEL description="` + strings.Repeat("x", 200) + `"
WORKDIR /srv
COPY app /srv/app/

FROM build AS check
EXPOSE 8080

FROM scratch
COPY --from=build /srv/app /app
COPY --from=` + reg.host + `/tools:1 /usr/bin/tool /bin/tool
WORKDIR /app
ENTRYPOINT ["/bin/tool"]
`
	ctxDir := writeContext(t, dockerfile, map[string]file{
		"app/x":       {content: "x"},
		"app/y":       {content: "yy"},
		"onbuild.txt": {content: "trigger"},
	})
	const secret = "s3cr3t-t0ken"
	rec := &recordLog{}
	img := build(t, Options{ContextDir: ctxDir, Log: rec.log, BuildArgs: map[string]string{"TOKEN": secret}})

	host := regexp.QuoteMeta(reg.host)
	matchLines(t, rec.lines, []string{
		`ARG TAG=v1`,
		`FROM ` + host + `/base:\$\{TAG\} AS build \(` + reDigest + `, linux/amd64\)`,
		`ONBUILD trigger COPY onbuild\.txt /from-trigger\.txt: 1 file, 7 B`,
		reLayer,
		`ARG TOKEN`,
		`ENV TOKEN_SHA=\$\{TOKEN\}`,
		`LABEL description="x{100}…`,
		`WORKDIR /srv`,
		reLayer,
		`COPY app /srv/app/: 2 files, 3 B`,
		reLayer,
		`FROM scratch`,
		`COPY --from=build /srv/app /app: 2 files, 3 B from stage build`,
		reLayer,
		`COPY --from=` + host + `/tools:1 /usr/bin/tool /bin/tool: 1 file, 11 B from image ` + host + `/tools:1 \(` + reDigest + `\)`,
		reLayer,
		`WORKDIR /app`,
		`ENTRYPOINT \["/bin/tool"\]`,
		`built image ` + reDigest + ` for linux/amd64`,
	})
	checkDigests(t, img, rec.lines[len(rec.lines)-8:], 2)

	for _, l := range rec.lines {
		if strings.Contains(l, secret) {
			t.Errorf("line %q has the value of a build arg", l)
		}
		if strings.ContainsAny(l, "\n\r") {
			t.Errorf("line %q has a newline", l)
		}
		if n := utf8.RuneCountInString(l); n > 200 {
			t.Errorf("line of %d characters: %q", n, l)
		}
	}

	t.Run("the FROM line names the base's manifest digest", func(t *testing.T) {
		base, err := remote.Image(reg.ref(t, "base:v1"), remote.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"}))
		if err != nil {
			t.Fatal(err)
		}
		if d := digestOf(t, base).String(); !strings.Contains(rec.lines[1], "("+d+", ") {
			t.Errorf("FROM line %q, want the amd64 manifest %s", rec.lines[1], d)
		}
	})

	t.Run("a stage FROM an earlier stage names it", func(t *testing.T) {
		rec := &recordLog{}
		build(t, Options{ContextDir: ctxDir, Target: "check", Log: rec.log})
		i := len(rec.lines) - 3
		matchLines(t, rec.lines[i:], []string{
			`FROM build AS check \(stage build\)`,
			`EXPOSE 8080`,
			`built image ` + reDigest + ` for linux/amd64`,
		})
	})
}

func TestInstructionText(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"COPY a \t b  /c/":               "COPY a b /c/",
		"LABEL a=b\nc=d\r\n":             "LABEL a=b c=d",
		"ENV X=\u2028y":                  "ENV X= y",
		strings.Repeat("é", 130):         strings.Repeat("é", 119) + "…",
		strings.Repeat("a", 120):         strings.Repeat("a", 120),
		"USER\x00root\x1b[31m":           "USER root [31m",
		"  WORKDIR /srv  ":               "WORKDIR /srv",
		"CMD [\"a\",\n     \"b\"]":       `CMD ["a", "b"]`,
		"EXPOSE 80\u0085443":             "EXPOSE 80 443",
		"HEALTHCHECK CMD curl localhost": "HEALTHCHECK CMD curl localhost",
	} {
		if got := instructionText(in); got != want {
			t.Errorf("instructionText(%q) = %q, want %q", in, got, want)
		}
	}
}
