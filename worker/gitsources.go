package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/gitsource"
	"github.com/buildq/buildq/internal/units"
)

// ArchiveStore stores packed contexts in tenants' context areas.
type ArchiveStore interface {
	// PutArchive stores tenant's archive of digest (size bytes of r)
	// unless its object exists, and names the object.
	PutArchive(ctx context.Context, tenant, digest string, r io.Reader, size int64) (v1.S3Source, error)
}

// GitPacker is the GitSources of `buildq worker` and `buildq dev`: a git
// fetcher (internal/gitsource: host policy, limits, the tenant's own
// credentials) and the S3 store the archives go to. At most a few fetches
// run at once: each may hold an object of up to the fetcher's
// MaxObjectBytes in memory and its checkout on disk.
type GitPacker struct {
	fetcher *gitsource.Fetcher
	store   ArchiveStore
	slots   chan struct{}
}

// NewGitPacker returns a GitPacker running at most concurrent fetches at
// once (at least 1).
func NewGitPacker(f *gitsource.Fetcher, store ArchiveStore, concurrent int) *GitPacker {
	return &GitPacker{fetcher: f, store: store, slots: make(chan struct{}, max(concurrent, 1))}
}

// Pack implements GitSources.
func (p *GitPacker) Pack(ctx context.Context, tenant string, src v1.GitSource, dockerfile string, progress func(string)) (*v1.ResolvedSource, error) {
	select {
	case p.slots <- struct{}{}:
	default:
		progress(fmt.Sprintf("waiting for one of this worker's %d git fetches to end", cap(p.slots)))
		select {
		case p.slots <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	defer func() { <-p.slots }()
	c, err := p.fetcher.Fetch(ctx, tenant, gitsource.Source{
		URL: src.URL, Ref: src.Ref, Commit: src.Commit, SubPath: src.SubPath, Submodules: src.Submodules, Dockerfile: dockerfile,
	}, func(pr gitsource.Progress) { progress(describeProgress(pr)) })
	if ge := (*gitsource.Error)(nil); errors.As(err, &ge) && !ge.Transient {
		return nil, &SourceError{Reason: ge.Reason, Message: ge.Message}
	}
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Remove() }()
	body, err := c.Open()
	if err != nil {
		return nil, err
	}
	defer func() { _ = body.Close() }()
	progress(fmt.Sprintf("storing the context %s (%s)", shortDigest(c.Digest), units.Bytes(c.Size)))
	obj, err := p.store.PutArchive(ctx, tenant, c.Digest, body, c.Size)
	if err != nil {
		return nil, fmt.Errorf("store the packed context: %w", err)
	}
	ref := c.Ref
	if ref == "" {
		ref = src.Ref
	}
	return &v1.ResolvedSource{
		SourceInfo: v1.SourceInfo{GitURL: shownURL(src.URL, c.URL), Ref: ref, Commit: c.Commit, SubPath: src.SubPath, ContextDigest: c.Digest},
		S3:         obj,
	}, nil
}

// shownURL is the repository URL a result names: the request's, without
// a password or an https user (which may be a token), but with an ssh
// user name, which is no secret and without which the URL names another
// login; fetched is the fetcher's form without any userinfo.
func shownURL(asked, fetched string) string {
	u, err := url.Parse(asked)
	if err != nil || u.User == nil || u.Scheme != "ssh" {
		return fetched
	}
	f, err := url.Parse(fetched)
	if err != nil {
		return fetched
	}
	f.User = url.User(u.User.Username())
	return f.String()
}

// describeProgress is a progress event's message for a step of a fetch.
func describeProgress(p gitsource.Progress) string {
	switch {
	case p.Message != "":
		return p.Message
	case p.Step == gitsource.StepFetching:
		return fmt.Sprintf("fetching: %s, %d objects", units.Bytes(p.Bytes), p.Objects)
	case p.Step == gitsource.StepPacking:
		return fmt.Sprintf("packing: %d entries, %s", p.Objects, units.Bytes(p.Bytes))
	}
	return p.Step
}

func shortDigest(d string) string {
	if len(d) > len("sha256:")+12 {
		return d[:len("sha256:")+12]
	}
	return d
}
