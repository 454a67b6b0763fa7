package gitsource

import (
	"errors"
	"fmt"
	"net/url"
	"path"
	"regexp"
	"strings"

	"github.com/go-git/go-git/v5/config"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/filemode"
	"github.com/moby/patternmatcher"

	v1 "github.com/buildq/buildq/api/v1"
)

// maxSubmoduleLevel bounds how deep submodules nest.
const maxSubmoduleLevel = 8

// submodule fetches the submodule at rel (repoRel in rt) at commit and
// writes its tree there. Its URL comes from rt's .gitmodules (relative
// URLs against rt's URL), and it goes through the same host policy,
// limits and the tenant's credentials (HTTPS ones only on the source's
// own host) as the source itself; one Fetch opens at most MaxSubmodules.
func (w *writer) submodule(rel, repoRel string, commit plumbing.Hash, info patternmatcher.MatchInfo, rt *repoTree, level int) error {
	r := w.r
	if level >= maxSubmoduleLevel {
		return invalid(fmt.Sprintf("submodule %q: submodules nest more than %d deep", truncate(rel, 200), maxSubmoduleLevel))
	}
	mods, err := r.modules(rt)
	if err != nil {
		return err
	}
	raw, ok := mods[repoRel]
	if !ok {
		return invalid(fmt.Sprintf("submodule %q of %s has no URL in .gitmodules", truncate(repoRel, 200), rt.url))
	}
	u, user, err := resolveSubmoduleURL(rt.url, rt.sshUser, raw)
	if err != nil {
		return inSubmodule(rel, err)
	}
	// Every instance counts: relative URLs make each one's URL its own.
	if r.opened++; r.opened > r.lim.MaxSubmodules {
		return tooLarge(fmt.Sprintf("the source has more than MaxSubmodules=%d submodules (at %q)",
			r.lim.MaxSubmodules, truncate(rel, 200)), nil)
	}
	r.emit(Progress{Step: StepFetching, Message: fmt.Sprintf("fetching submodule %s (%s) at %s", rel, u, commit)})
	rp, err := r.openRepo(w.ctx, u, user)
	if err != nil {
		return inSubmodule(rel, err)
	}
	c, err := r.fetchByHash(w.ctx, rp, commit, "HEAD")
	_ = rp.rem.close()
	if err != nil {
		return inSubmodule(rel, err)
	}
	sc, err := r.commit(c)
	if err != nil {
		return err
	}
	sub := &repoTree{url: u, sshUser: user, root: sc.TreeHash}
	return w.walk(sc.TreeHash, rel, "", info, sub, level+1)
}

// inSubmodule says which submodule an error is about.
func inSubmodule(rel string, err error) error {
	var e *Error
	if errors.As(err, &e) {
		out := *e
		out.Message = fmt.Sprintf("submodule %q: %s", truncate(rel, 200), e.Message)
		return &out
	}
	return fmt.Errorf("submodule %q: %w", truncate(rel, 200), err)
}

// modules reads rt's .gitmodules: submodule path -> URL.
func (r *run) modules(rt *repoTree) (map[string]string, error) {
	if rt.modules != nil {
		return rt.modules, nil
	}
	rt.modules = map[string]string{}
	e, found, err := r.findEntry(rt.root, ".gitmodules")
	if err != nil || !found {
		return rt.modules, err
	}
	if e.mode != filemode.Regular && e.mode != filemode.Deprecated && e.mode != filemode.Executable {
		return nil, invalid(fmt.Sprintf("the .gitmodules of %s is a %s", rt.url, kindOf(e.mode)))
	}
	data, err := r.readSmallBlob(e.hash, ".gitmodules")
	if err != nil {
		return nil, err
	}
	m := config.NewModules()
	if err := m.Unmarshal(data); err != nil {
		return nil, invalidf(err, "the .gitmodules of %s cannot be read", rt.url)
	}
	for _, sm := range m.Submodules {
		if sm.Validate() == nil {
			rt.modules[path.Clean(sm.Path)] = sm.URL
		}
	}
	return rt.modules, nil
}

// scpLike is git's "[user@]host:path" form of an SSH URL.
var scpLike = regexp.MustCompile(`^([A-Za-z0-9._~-]+@)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):([^/].*|/.+)$`)

// resolveSubmoduleURL turns a .gitmodules URL into one to fetch: "./x"
// and "../x" relative to the superproject's URL (as git resolves them),
// "user@host:path" as ssh://, and otherwise only https://, http:// and
// ssh:// URLs (never file://, git:// or a transport helper).
func resolveSubmoduleURL(base *url.URL, baseUser, raw string) (*url.URL, string, error) {
	raw = strings.TrimSpace(raw)
	if strings.HasPrefix(raw, "./") || strings.HasPrefix(raw, "../") {
		u := *base
		u.Path = path.Join(strings.TrimSuffix(base.Path, "/"), raw)
		u.RawPath = ""
		return &u, baseUser, nil
	}
	if !strings.Contains(raw, "://") {
		m := scpLike.FindStringSubmatch(raw)
		// "transport::address" is a remote helper, never an scp address.
		if m == nil || strings.Contains(raw, "::") || strings.Contains(raw, `\`) {
			return nil, "", invalid("its URL in .gitmodules is not an https://, http:// or ssh:// URL")
		}
		p := m[3]
		if !strings.HasPrefix(p, "/") {
			p = "/" + p
		}
		raw = "ssh://" + m[1] + m[2] + p
	}
	u, user, err := parseRepoURL(raw)
	if err != nil {
		return nil, "", refuse(v1.ReasonInvalidRequest, "its URL in .gitmodules: "+err.Error(), err)
	}
	return u, user, nil
}
