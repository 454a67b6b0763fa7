package main

import (
	"context"
	"net/url"
	"path"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
)

// gitFlags describe a git source for submit.
type gitFlags struct {
	url        string
	ref        string
	commit     string
	subPath    string
	submodules bool
}

func (f *gitFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.url, "git", "", "build a git repository instead of DIR: its https://, http:// or ssh:// URL (the worker fetches it)")
	fs.StringVar(&f.ref, "ref", "", "with --git: branch, tag or full ref to build (resolved to a commit by the worker)")
	fs.StringVar(&f.commit, "commit", "", "with --git: the full commit hash to build (with --ref, it must be reachable from it)")
	fs.StringVar(&f.subPath, "subpath", "", "with --git: the directory of the repository to use as the context")
	fs.BoolVar(&f.submodules, "submodules", false, "with --git: fetch the commit's submodules into the context")
}

// unused refuses the git-only flags without --git.
func (f *gitFlags) unused() error {
	for flag, set := range map[string]bool{"--ref": f.ref != "", "--commit": f.commit != "", "--subpath": f.subPath != "", "--submodules": f.submodules} {
		if set {
			return usageErr("%s goes with --git", flag)
		}
	}
	return nil
}

// source is the request's git source.
func (f *gitFlags) source() *v1.GitSource {
	return &v1.GitSource{URL: f.url, Ref: f.ref, Commit: f.commit, SubPath: strings.Trim(path.Clean("/"+f.subPath), "/"), Submodules: f.submodules}
}

// repoName is a build name from a repository URL: its last path element
// without ".git" (https://github.com/acme/web.git → web).
func repoName(rawURL string) string {
	p := rawURL
	if u, err := url.Parse(rawURL); err == nil {
		p = u.Path
	}
	return defaultName(strings.TrimSuffix(path.Base(strings.TrimSuffix(p, "/")), ".git"))
}

// runSubmitGit publishes a request for a git source: nothing is packed
// or uploaded here, the worker does both.
func runSubmitGit(ctx context.Context, cmd *cobra.Command, rf *requestFlags, gf *gitFlags, nf *natsFlags, wait bool, waitTimeout time.Duration, asJSON bool) error {
	req, err := rf.requestFields(repoName(gf.url))
	if err != nil {
		return err
	}
	req.Source = v1.Source{Git: gf.source()}
	req.RequestID = publisher.NewRequestID() // replaced when published; validation needs one
	if err := validate(req); err != nil {
		return err
	}
	nc, pub, err := nf.publisher("buildq-submit")
	if err != nil {
		return err
	}
	defer nc.Close()
	return publishAndWait(ctx, cmd, nc, pub, req, wait, waitTimeout, asJSON)
}
