package gitsource

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp/capability"

	v1 "github.com/buildq/buildq/api/v1"
)

// allowAnySHA1InWant is the capability of servers that serve any object
// by hash (uploadpack.allowAnySHA1InWant); go-git has no constant for it.
const allowAnySHA1InWant capability.Capability = "allow-any-sha1-in-want"

// maxTagChain bounds the tags peeled to reach a commit.
const maxTagChain = 10

// resolveAndFetch resolves the source's ref in rem's advertisement and
// fetches the commit to pack. It returns the full ref name ("" without a
// ref) and the commit.
func (r *run) resolveAndFetch(ctx context.Context, rp *repo) (string, plumbing.Hash, error) {
	var want plumbing.Hash
	if r.src.Commit != "" {
		want = plumbing.NewHash(r.src.Commit)
	}
	if r.src.Ref == "" {
		r.emit(Progress{Step: StepFetching, Message: "fetching commit " + want.String()})
		c, err := r.fetchByHash(ctx, rp, want, "")
		return "", c, err
	}
	name, tip, peeled, ok := resolveRef(rp.adv, r.src.Ref)
	if !ok {
		what := "branch or tag"
		if strings.HasPrefix(r.src.Ref, "refs/") || r.src.Ref == "HEAD" {
			what = "ref"
		}
		return "", plumbing.ZeroHash, refuse(v1.ReasonGitRefNotFound,
			fmt.Sprintf("%s has no %s %q", rp.display, what, r.src.Ref), nil)
	}
	r.emit(Progress{Step: StepFetching, Message: fmt.Sprintf("fetching %s (%s)", name, tip)})
	if want.IsZero() || want == tip || want == peeled {
		// The tip itself (or, for a tag, the commit it peels to): one
		// commit deep. A tag is wanted as itself, which every server
		// serves, and peeled here.
		if err := r.fetchPack(ctx, rp, uploadRequest{wants: []plumbing.Hash{tip}, depth: 1}); err != nil {
			return "", plumbing.ZeroHash, err
		}
		c, err := r.peel(rp.display, tip)
		if err != nil {
			return "", plumbing.ZeroHash, err
		}
		if want.IsZero() || c == want {
			r.complete[c] = true
			return name, c, nil
		}
	}
	c, err := r.fetchBelowTip(ctx, rp, name, tip, want)
	return name, c, err
}

// resolveRef finds ref in an advertisement: "HEAD", a full ref, or a
// branch or tag name (a branch first, as `git clone --branch` does). It
// returns the full name, the advertised hash (a tag object for an
// annotated tag) and, when advertised, the commit it peels to.
func resolveRef(adv *packp.AdvRefs, ref string) (name string, tip, peeled plumbing.Hash, ok bool) {
	if ref == "HEAD" {
		if adv.Head == nil {
			return "", plumbing.ZeroHash, plumbing.ZeroHash, false
		}
		name = "HEAD"
		for _, s := range adv.Capabilities.Get(capability.SymRef) {
			if target, found := strings.CutPrefix(s, "HEAD:"); found && strings.HasPrefix(target, "refs/") {
				name = target
			}
		}
		return name, *adv.Head, adv.Peeled[name], true
	}
	candidates := []string{ref}
	if !strings.HasPrefix(ref, "refs/") {
		candidates = []string{"refs/heads/" + ref, "refs/tags/" + ref}
	}
	for _, c := range candidates {
		if h, found := adv.References[c]; found {
			return c, h, adv.Peeled[c], true
		}
	}
	return "", plumbing.ZeroHash, plumbing.ZeroHash, false
}

// fetchByHash fetches commit c by its hash alone, one commit deep (a
// source without a ref, a submodule). fallback, when not "", is a ref to
// deepen instead if the server will not serve c by hash.
func (r *run) fetchByHash(ctx context.Context, rp *repo, c plumbing.Hash, fallback string) (plumbing.Hash, error) {
	if r.complete[c] {
		return c, nil
	}
	err := r.fetchPack(ctx, rp, uploadRequest{wants: []plumbing.Hash{c}, depth: 1})
	if words, refused := refusedWant(err); refused {
		if fallback != "" {
			if name, tip, _, ok := resolveRef(rp.adv, fallback); ok {
				return r.fetchDeepened(ctx, rp, name, tip, c)
			}
		}
		return plumbing.ZeroHash, refuse(v1.ReasonGitCommitNotFound,
			fmt.Sprintf("%s does not serve commit %s: %s", rp.display, c, words), err)
	}
	if err != nil {
		return plumbing.ZeroHash, err
	}
	if err := r.mustBeCommit(rp.display, c); err != nil {
		return plumbing.ZeroHash, err
	}
	r.complete[c] = true
	return c, nil
}

// fetchBelowTip fetches want, a commit that is not ref name's tip, and
// checks it is reachable from the tip within MaxDepth commits. Where the
// server serves commits by hash and can leave blobs out, want is fetched
// alone and then only the commits and trees of the ref's recent history,
// to check; otherwise the ref is deepened to MaxDepth, which brings want
// along if it is there at all.
func (r *run) fetchBelowTip(ctx context.Context, rp *repo, name string, tip, want plumbing.Hash) (plumbing.Hash, error) {
	caps := rp.adv.Capabilities
	byHash := caps.Supports(capability.AllowReachableSHA1InWant) || caps.Supports(allowAnySHA1InWant)
	if byHash && caps.Supports(capability.Filter) {
		err := r.fetchPack(ctx, rp, uploadRequest{wants: []plumbing.Hash{want}, depth: 1})
		if _, refused := refusedWant(err); !refused {
			if err != nil {
				return plumbing.ZeroHash, err
			}
			if err := r.fetchPack(ctx, rp, uploadRequest{
				wants: []plumbing.Hash{tip}, depth: r.lim.MaxDepth, filter: packp.FilterBlobNone(),
			}); err != nil {
				return plumbing.ZeroHash, err
			}
			if err := r.verifyReachable(rp.display, name, tip, want); err != nil {
				return plumbing.ZeroHash, err
			}
			if err := r.mustBeCommit(rp.display, want); err != nil {
				return plumbing.ZeroHash, err
			}
			r.complete[want] = true
			return want, nil
		}
		// Refused by hash: typically a commit no ref reaches any more
		// (a force-push). Deepening tells for sure.
	}
	return r.fetchDeepened(ctx, rp, name, tip, want)
}

// fetchDeepened fetches MaxDepth commits of ref name's history and
// checks want is among them.
func (r *run) fetchDeepened(ctx context.Context, rp *repo, name string, tip, want plumbing.Hash) (plumbing.Hash, error) {
	r.emit(Progress{Step: StepFetching, Message: fmt.Sprintf("deepening %s by up to %d commits to find %s", name, r.lim.MaxDepth, want)})
	if err := r.fetchPack(ctx, rp, uploadRequest{wants: []plumbing.Hash{tip}, depth: r.lim.MaxDepth}); err != nil {
		return plumbing.ZeroHash, err
	}
	if err := r.verifyReachable(rp.display, name, tip, want); err != nil {
		return plumbing.ZeroHash, err
	}
	r.complete[want] = true
	return want, nil
}

// verifyReachable checks that want is within MaxDepth commits of the
// commit tip peels to.
func (r *run) verifyReachable(display, name string, tip, want plumbing.Hash) error {
	start, err := r.peel(display, tip)
	if err != nil {
		return err
	}
	found, truncated, err := r.reachable(start, want, r.lim.MaxDepth)
	switch {
	case err != nil:
		return err
	case found:
		return nil
	case truncated:
		return r.fail(tooDeep(fmt.Sprintf("commit %s is not among the %d most recent commits of %s (MaxDepth=%d)",
			want, r.lim.MaxDepth, name, r.lim.MaxDepth), nil))
	}
	return refuse(v1.ReasonGitCommitNotFound, fmt.Sprintf("commit %s is not reachable from %s in %s", want, name, display), nil)
}

// reachable walks the history from start breadth first, maxDepth
// commits deep, looking for want. truncated says history went on beyond
// what was walked (MaxDepth, or the shallow boundary of what was fetched).
func (r *run) reachable(start, want plumbing.Hash, maxDepth int) (found, truncated bool, err error) {
	type item struct {
		h     plumbing.Hash
		depth int
	}
	seen := map[plumbing.Hash]bool{start: true}
	queue := []item{{start, 1}}
	for len(queue) > 0 {
		it := queue[0]
		queue = queue[1:]
		if it.h == want {
			return true, false, nil
		}
		c, err := r.commit(it.h)
		if errors.Is(err, plumbing.ErrObjectNotFound) {
			truncated = true
			continue
		}
		if err != nil {
			return false, false, err
		}
		if it.depth >= maxDepth {
			truncated = truncated || len(c.ParentHashes) > 0
			continue
		}
		for _, p := range c.ParentHashes {
			if !seen[p] {
				seen[p] = true
				queue = append(queue, item{p, it.depth + 1})
			}
		}
	}
	return false, truncated, nil
}

// peel follows h through tags to a commit.
func (r *run) peel(display string, h plumbing.Hash) (plumbing.Hash, error) {
	for range maxTagChain {
		obj, err := r.st.EncodedObject(plumbing.AnyObject, h)
		if errors.Is(err, plumbing.ErrObjectNotFound) {
			return plumbing.ZeroHash, refuse(v1.ReasonGitCommitNotFound, fmt.Sprintf("%s did not send object %s", display, h), err)
		}
		if err != nil {
			return plumbing.ZeroHash, fmt.Errorf("read object %s: %w", h, err)
		}
		switch obj.Type() {
		case plumbing.CommitObject:
			return h, nil
		case plumbing.TagObject:
			tag, err := object.DecodeTag(r.st, obj)
			if err != nil {
				return plumbing.ZeroHash, invalidf(err, "tag %s in %s is malformed", h, display)
			}
			h = tag.Target
		default:
			return plumbing.ZeroHash, refuse(v1.ReasonGitCommitNotFound,
				fmt.Sprintf("%s in %s is a %s, not a commit", h, display, obj.Type()), nil)
		}
	}
	return plumbing.ZeroHash, invalid(fmt.Sprintf("more than %d tags chained from %s in %s", maxTagChain, h, display))
}

// mustBeCommit checks that h was fetched and is a commit.
func (r *run) mustBeCommit(display string, h plumbing.Hash) error {
	obj, err := r.st.EncodedObject(plumbing.AnyObject, h)
	if errors.Is(err, plumbing.ErrObjectNotFound) {
		return refuse(v1.ReasonGitCommitNotFound, fmt.Sprintf("%s did not send commit %s", display, h), err)
	}
	if err != nil {
		return fmt.Errorf("read object %s: %w", h, err)
	}
	if obj.Type() != plumbing.CommitObject {
		return refuse(v1.ReasonGitCommitNotFound, fmt.Sprintf("%s in %s is a %s, not a commit", h, display, obj.Type()), nil)
	}
	return nil
}

// commit reads commit h from the store.
func (r *run) commit(h plumbing.Hash) (*object.Commit, error) {
	obj, err := r.st.EncodedObject(plumbing.CommitObject, h)
	if err != nil {
		return nil, fmt.Errorf("read commit %s: %w", h, err)
	}
	c, err := object.DecodeCommit(r.st, obj)
	if err != nil {
		return nil, invalidf(err, "commit %s is malformed", h)
	}
	return c, nil
}
