//go:build integration

package integration

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// readmeCommand is one `$ command` of a console block and the output the
// README shows under it.
type readmeCommand struct {
	line    int // in README.md, for messages
	command string
	output  []string
}

// quickStartCommands reads the console blocks of README.md's "Quick start"
// section.
func quickStartCommands(t *testing.T, readme string) []readmeCommand {
	t.Helper()
	start := strings.Index(readme, "\n## Quick start\n")
	if start < 0 {
		t.Fatal(`README.md has no "## Quick start" section`)
	}
	section := readme[start+1:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	first := strings.Count(readme[:start+1], "\n") + 1
	var (
		cmds    []readmeCommand
		console bool
	)
	for i, l := range strings.Split(section, "\n") {
		switch {
		case strings.HasPrefix(l, "```console"):
			console = true
		case strings.HasPrefix(l, "```"):
			console = false
		case console && strings.HasPrefix(l, "$ "):
			cmds = append(cmds, readmeCommand{line: first + i, command: strings.TrimPrefix(l, "$ ")})
		case console && len(cmds) > 0:
			cmds[len(cmds)-1].output = append(cmds[len(cmds)-1].output, l)
		}
	}
	return cmds
}

// What changes from run to run: times, durations, request ids (nuids),
// dev's temporary directory.
var readmeMasks = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`\b\d\d:\d\d:\d\d\b`), "HH:MM:SS"},
	{regexp.MustCompile(`\b\d+(\.\d+)?(ms|s|m)\b`), "<duration>"},
	{regexp.MustCompile(`\b[A-Za-z0-9]{22}\b`), "<request id>"},
	{regexp.MustCompile(`/tmp/buildq-dev-\d+`), "/tmp/buildq-dev-<n>"},
}

func maskReadme(s string) string {
	for _, m := range readmeMasks {
		s = m.re.ReplaceAllString(s, m.with)
	}
	return s
}

// readmeLine is one line of shown output as a pattern: the README
// abbreviates a digest or key with "…" (any rest of the word), and
// "..." stands for any lines.
type readmeLine struct {
	skip bool
	re   *regexp.Regexp
	text string
}

func readmePatterns(lines []string) []readmeLine {
	var out []readmeLine
	for _, l := range lines {
		if strings.TrimSpace(l) == "..." {
			out = append(out, readmeLine{skip: true, text: l})
			continue
		}
		q := regexp.QuoteMeta(maskReadme(l))
		q = strings.ReplaceAll(q, "…", `[^\s"]*`)
		out = append(out, readmeLine{re: regexp.MustCompile("^" + q + "$"), text: l})
	}
	// Trailing empty lines of a block are not output.
	for len(out) > 0 && !out[len(out)-1].skip && out[len(out)-1].text == "" {
		out = out[:len(out)-1]
	}
	return out
}

// matchLines reports whether got, line by line, is what want shows.
func matchLines(want []readmeLine, got []string) bool {
	if len(want) == 0 {
		return len(got) == 0
	}
	if want[0].skip {
		for k := 0; k <= len(got); k++ {
			if matchLines(want[1:], got[k:]) {
				return true
			}
		}
		return false
	}
	return len(got) > 0 && want[0].re.MatchString(maskReadme(got[0])) && matchLines(want[1:], got[1:])
}

// Issue 28, item 8: the README's quick start, run as written. Every
// command of its console blocks runs (with the `buildq` the suite built
// first on PATH, from the repository's root) against a `buildq dev` the
// test starts; the output each prints must be what the README shows under
// it — but for what changes from run to run (times, request ids, dev's
// directory, the free ports the test's dev listens on instead of the
// defaults), the words the README abbreviates with "…", and the lines it
// leaves out with "...". The commands are read from README.md, so a README
// that drifts from the CLI fails here.
func TestReadmeQuickStart(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	cmds := quickStartCommands(t, string(b))
	if len(cmds) < 3 {
		t.Fatalf("the quick start shows %d commands, want at least buildq dev and two submits: %+v", len(cmds), cmds)
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	addrs := map[string]string{"nats": freeAddr(), "s3": freeAddr(), "registry": freeAddr(), "gateway": freeAddr()}
	defaults := map[string]string{"nats": "127.0.0.1:4222", "s3": "127.0.0.1:9000", "registry": "127.0.0.1:5000", "gateway": "127.0.0.1:8088"}
	unport := func(s string) string {
		for k, a := range addrs {
			s = strings.ReplaceAll(s, a, defaults[k])
		}
		return s
	}
	env := append(os.Environ(), "PATH="+shared.bin+string(os.PathListSeparator)+os.Getenv("PATH"),
		"NATS_URL=nats://"+addrs["nats"], "BUILDQ_S3_ENDPOINT=http://"+addrs["s3"])

	ran := 0
	devStarted := false
	for _, c := range cmds {
		switch {
		case strings.HasPrefix(c.command, "make "):
			// Builds and installs (make install): the suite's binary
			// stands in for it; checked by the Makefile's own target.
			continue
		case c.command == "buildq dev":
			line := startReadmeDev(t, root, env, addrs)
			want := readmePatterns(c.output)
			if !matchLines(want, []string{unport(line)}) {
				t.Errorf("README.md:%d `%s` shows\n  %s\nbut it printed\n  %s", c.line, c.command, strings.Join(c.output, "\n  "), unport(line))
			}
			devStarted = true
			continue
		case !strings.HasPrefix(c.command, "buildq "):
			t.Errorf("README.md:%d: the quick start runs %q; after `make install` every command is `buildq …`", c.line, c.command)
			continue
		}
		if !devStarted {
			t.Fatalf("README.md:%d: %q comes before `buildq dev`", c.line, c.command)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		cmd := exec.CommandContext(ctx, "bash", "-c", "exec 2>&1; "+c.command)
		cmd.Dir, cmd.Env = root, env
		out, err := cmd.Output()
		cancel()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("README.md:%d %s: %v", c.line, c.command, err)
		}
		ran++
		got := strings.Split(strings.TrimRight(unport(string(out)), "\n"), "\n")
		want := readmePatterns(c.output)
		if !matchLines(want, got) {
			t.Errorf("README.md:%d `%s` shows\n  %s\nbut it printed (times, ids and ports masked)\n  %s",
				c.line, c.command, strings.Join(c.output, "\n  "), strings.Join(got, "\n  "))
		}
		// The README shows a failure as a "failed: …" last line (exit 1),
		// anything else succeeds.
		wantCode := 0
		if n := len(c.output); n > 0 && strings.HasPrefix(strings.TrimSpace(c.output[n-1]), "failed:") {
			wantCode = 1
		}
		if code != wantCode {
			t.Errorf("README.md:%d `%s` exited %d, want %d", c.line, c.command, code, wantCode)
		}
	}
	if ran == 0 {
		t.Fatal("no quick-start command ran")
	}
}

// startReadmeDev starts `buildq dev` on the test's addresses (and with
// extra arguments) and returns its ready line.
func startReadmeDev(t *testing.T, root string, env []string, addrs map[string]string, extra ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	dev := exec.CommandContext(ctx, filepath.Join(shared.bin, "buildq"), append([]string{"dev",
		"--nats-addr", addrs["nats"], "--s3-addr", addrs["s3"], "--registry-addr", addrs["registry"], "--gateway-addr", addrs["gateway"]}, extra...)...)
	dev.Dir, dev.Env = root, env
	var logs lockedBuffer
	stderr, err := dev.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	dev.Stdout = &logs
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	t.Cleanup(func() {
		// Ctrl-C, as a user stops it: it exits 0.
		_ = dev.Process.Signal(os.Interrupt)
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("buildq dev after SIGINT: %v (want exit 0)\n%s", err, tail(logs.String(), 2000))
			}
		case <-time.After(30 * time.Second):
			t.Error("buildq dev did not stop within 30s of SIGINT")
		}
		cancel()
	})
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			_, _ = logs.Write(append(sc.Bytes(), '\n'))
			if strings.HasPrefix(sc.Text(), "buildq dev ready") {
				select {
				case ready <- sc.Text():
				default:
				}
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		exited <- dev.Wait()
	}()
	select {
	case line := <-ready:
		return line
	case err := <-exited:
		t.Fatalf("buildq dev exited before it was ready: %v\n%s", err, tail(logs.String(), 3000))
	case <-time.After(2 * time.Minute):
		t.Fatalf("buildq dev not ready within 2 minutes\n%s", tail(logs.String(), 3000))
	}
	return ""
}

// TestReadmeMatcher pins the matcher's rules on their own.
func TestReadmeMatcher(t *testing.T) {
	want := readmePatterns([]string{"submitted default/x as request 8vfJlcLoSIJ3yX3iIHVWU0", "04:21:06  pushed sha256:6c11…", "...", "}"})
	for _, c := range []struct {
		got []string
		ok  bool
	}{
		{[]string{"submitted default/x as request abcdefghijklmnopqrstuv", "11:00:00  pushed sha256:6c1142774748aa", "}"}, true},
		{[]string{"submitted default/x as request abcdefghijklmnopqrstuv", "11:00:00  pushed sha256:6c1142774748aa", "a", "b", "}"}, true},
		{[]string{"submitted default/x as request abcdefghijklmnopqrstuv", "11:00:00  pushed sha256:7c1142774748aa", "}"}, false},
		{[]string{"submitted default/y as request abcdefghijklmnopqrstuv", "11:00:00  pushed sha256:6c11", "}"}, false},
		{[]string{"submitted default/x as request abcdefghijklmnopqrstuv", "11:00:00  pushed sha256:6c11"}, false},
	} {
		if got := matchLines(want, c.got); got != c.ok {
			t.Errorf("%q: match %v, want %v", c.got, got, c.ok)
		}
	}
	if got := maskReadme("after 0s in the queue 12:01:02"); got != "after <duration> in the queue HH:MM:SS" {
		t.Errorf("masked %q", got)
	}
}
