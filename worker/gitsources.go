package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/gitsource"
)

// ArchiveStore stores packed contexts in tenants' context areas.
type ArchiveStore interface {
	// PutArchive stores tenant's archive of digest (size bytes of r)
	// unless its object exists, and names the object.
	PutArchive(ctx context.Context, tenant, digest string, r io.Reader, size int64) (v1.S3Source, error)
}

// GitPacker is the GitSources of `buildq worker` and `buildq dev`: a
// go-git fetcher (internal/gitsource: host policy, limits, the tenant's
// own credentials) and the S3 store the archives go to.
type GitPacker struct {
	Fetcher *gitsource.Fetcher
	Store   ArchiveStore
}

// Pack implements GitSources.
func (p GitPacker) Pack(ctx context.Context, tenant string, src v1.GitSource, dockerfile string, progress func(string)) (*v1.ResolvedSource, error) {
	c, err := p.Fetcher.Fetch(ctx, tenant, gitsource.Source{
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
	progress(fmt.Sprintf("storing the context %s (%s)", shortDigest(c.Digest), byteSize(c.Size)))
	obj, err := p.Store.PutArchive(ctx, tenant, c.Digest, body, c.Size)
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
		return fmt.Sprintf("fetching: %s, %d objects", byteSize(p.Bytes), p.Objects)
	case p.Step == gitsource.StepPacking:
		return fmt.Sprintf("packing: %d entries, %s", p.Objects, byteSize(p.Bytes))
	}
	return p.Step
}

func shortDigest(d string) string {
	if len(d) > len("sha256:")+12 {
		return d[:len("sha256:")+12]
	}
	return d
}

func byteSize(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
