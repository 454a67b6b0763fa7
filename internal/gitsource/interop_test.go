package gitsource

import (
	"io"
	"net/http/cgi"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

// gitHTTPBackend serves root (bare repositories, by directory name) with
// git's own git-http-backend behind net/http/cgi, configured with
// config ("key=value"). The test is skipped, saying why, when git is not
// installed: the pure-Go server covers the same ground; this checks the
// protocol code against the real thing.
func gitHTTPBackend(t *testing.T, root string, config ...string) string {
	t.Helper()
	gitBin, err := exec.LookPath("git")
	if err != nil {
		t.Skip("git is not installed: skipping the interop test against git http-backend")
	}
	out, err := exec.Command(gitBin, "--exec-path").Output()
	if err != nil {
		t.Skipf("git --exec-path: %v: skipping the interop test against git http-backend", err)
	}
	backend := filepath.Join(strings.TrimSpace(string(out)), "git-http-backend")
	if _, err := os.Stat(backend); err != nil {
		t.Skipf("%s is missing: skipping the interop test against git http-backend", backend)
	}
	env := []string{"GIT_PROJECT_ROOT=" + root, "GIT_HTTP_EXPORT_ALL=1", "HOME=" + t.TempDir(), "GIT_CONFIG_NOSYSTEM=1"}
	env = append(env, "GIT_CONFIG_COUNT="+itoa(len(config)))
	for i, kv := range config {
		k, v, _ := strings.Cut(kv, "=")
		env = append(env, "GIT_CONFIG_KEY_"+itoa(i)+"="+k, "GIT_CONFIG_VALUE_"+itoa(i)+"="+v)
	}
	srv := httptest.NewServer(&cgi.Handler{Path: backend, Env: env, Stderr: io.Discard})
	t.Cleanup(srv.Close)
	return srv.URL
}

func itoa(i int) string { return string(rune('0' + i)) }

func TestInterop_GitHTTPBackend(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		config []string
	}{
		{"git defaults", nil},
		{"commits by hash and filters", []string{"uploadpack.allowReachableSHA1InWant=true", "uploadpack.allowFilter=true"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			repo := newRepo(t)
			commits, files := history(repo, 4)
			repo.annotatedTag("v1", commits[1])
			forced := newRepo(t)
			old, _ := history(forced, 2)
			forced.commitFiles("main", map[string]f{"new": reg("root")})

			root := t.TempDir()
			for name, r := range map[string]*testRepo{"r.git": repo, "forced.git": forced} {
				if err := os.Symlink(r.dir, filepath.Join(root, name)); err != nil {
					t.Fatal(err)
				}
			}
			base := gitHTTPBackend(t, root, tc.config...)
			url := base + "/r.git"
			fr := newFetcher(t)

			for _, want := range []struct {
				src Source
				i   int
			}{
				{Source{URL: url, Ref: "main"}, 3},
				{Source{URL: url, Ref: "v1"}, 1},
				{Source{URL: url, Ref: "main", Commit: commits[1].String()}, 1},
				{Source{URL: url, Ref: "refs/heads/main", Commit: commits[3].String()}, 3},
			} {
				c := fetchOK(t, fr, want.src)
				if c.Commit != commits[want.i].String() || c.Digest != uploadDigest(t, files[want.i], "") {
					t.Errorf("%+v: got commit %s digest %s, want commit %s", want.src, c.Commit, c.Digest, commits[want.i])
				}
			}
			e := fetchErr(t, fr, Source{URL: base + "/forced.git", Ref: "main", Commit: old[1].String()}, v1.ReasonGitCommitNotFound)
			mustContain(t, e.Message, "not reachable")
			_ = fetchErr(t, fr, Source{URL: url, Ref: "nope"}, v1.ReasonGitRefNotFound)
			// Over HTTP git serves any commit a ref reaches, by hash...
			c := fetchOK(t, fr, Source{URL: url, Commit: commits[0].String()})
			if c.Digest != uploadDigest(t, files[0], "") {
				t.Errorf("commit by hash: digest %s", c.Digest)
			}
			// ...and no other, in its own words.
			e = fetchErr(t, fr, Source{URL: base + "/forced.git", Commit: old[1].String()}, v1.ReasonGitCommitNotFound)
			mustContain(t, e.Message, "not our ref")
		})
	}
}

func TestInterop_GitUploadPackOverSSH(t *testing.T) {
	t.Parallel()
	gitBin, err := exec.LookPath("git")
	if err != nil {
		t.Skip("git is not installed: skipping the interop test against git upload-pack")
	}
	repo := newRepo(t)
	commits, files := history(repo, 4)
	repo.annotatedTag("v1", commits[1])
	git := newGitServer(t, serverOpts{})
	git.realGit = gitBin
	git.repos["/r.git"] = repo
	clientKey, clientPEM := newKey(t)
	srv := git.serveSSH(clientKey.PublicKey())
	url := srv.url("/r.git")
	fr := newFetcher(t)
	fr.Credentials = creds(&Credentials{SSHKey: clientPEM, KnownHosts: srv.knownHosts()})

	for _, want := range []struct {
		src Source
		i   int
	}{
		{Source{URL: url, Ref: "main"}, 3},
		{Source{URL: url, Ref: "v1"}, 1},
		{Source{URL: url, Ref: "main", Commit: commits[0].String()}, 0},
	} {
		c := fetchOK(t, fr, want.src)
		if c.Commit != commits[want.i].String() || c.Digest != uploadDigest(t, files[want.i], "") {
			t.Errorf("%+v: got commit %s digest %s, want commit %s", want.src, c.Commit, c.Digest, commits[want.i])
		}
	}
	// Over SSH git serves tips only, unless configured otherwise.
	e := fetchErr(t, fr, Source{URL: url, Commit: commits[0].String()}, v1.ReasonGitCommitNotFound)
	mustContain(t, e.Message, "not our ref")
	e = fetchErr(t, fr, Source{URL: srv.url("/absent.git"), Ref: "main"}, v1.ReasonGitAuthFailed)
	mustContain(t, e.Message, "does not appear to be a git repository")
}
