package contexttar

import (
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// DockerignoreName is the ignore file at the root of a context.
const DockerignoreName = ".dockerignore"

// Ignore is a context's compiled .dockerignore: what Write leaves out, and
// which excluded directories it still walks for exceptions. Write uses it
// on a directory; a packer that writes a context out first (a git tree)
// uses the same rules to write only what Write will keep. The zero value
// excludes nothing.
type Ignore struct {
	pm                   *patternmatcher.PatternMatcher // nil: exclude nothing
	onlyPrefixExceptions bool
}

// ParseIgnore compiles the content of a .dockerignore for a context whose
// Dockerfile is dockerfile ("" = "Dockerfile"). As the docker CLI does
// (TrimBuildFilesFromExcludes), it appends exceptions for .dockerignore
// and the Dockerfile when the patterns would exclude them, so the build
// can always find them.
func ParseIgnore(r io.Reader, dockerfile string) (*Ignore, error) {
	patterns, err := ignorefile.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("contexttar: read %s: %w", DockerignoreName, err)
	}
	if len(patterns) == 0 {
		return &Ignore{}, nil
	}
	if dockerfile == "" {
		dockerfile = "Dockerfile"
	}
	dockerfile = filepath.ToSlash(filepath.Clean(dockerfile))
	for _, keep := range []string{DockerignoreName, dockerfile} {
		// The docker CLI uses the deprecated patternmatcher.Matches here,
		// which checks only one parent directory; MatchesOrParentMatches
		// checks them all, so a Dockerfile under an excluded directory is
		// kept too. An invalid pattern is reported by New below.
		if excluded, _ := patternmatcher.MatchesOrParentMatches(keep, patterns); excluded {
			patterns = append(patterns, "!"+literalPattern(keep))
		}
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		return nil, fmt.Errorf("contexttar: invalid pattern in %s: %w", DockerignoreName, err)
	}
	return &Ignore{pm: pm, onlyPrefixExceptions: onlyPrefixExceptions(pm)}, nil
}

// Match reports whether the slash-separated relative path rel is
// excluded, given its parent directory's match state (the zero MatchInfo
// for the root's children); the state it returns is rel's, for its
// children.
func (ig *Ignore) Match(rel string, parent patternmatcher.MatchInfo) (bool, patternmatcher.MatchInfo, error) {
	if ig.pm == nil {
		return false, patternmatcher.MatchInfo{}, nil
	}
	skip, info, err := ig.pm.MatchesUsingParentResults(filepath.FromSlash(rel), parent)
	if err != nil {
		return false, info, fmt.Errorf("contexttar: match %q against %s: %w", rel, DockerignoreName, err)
	}
	return skip, info, nil
}

// MayReinclude reports whether an exception pattern could match something
// below the excluded directory rel, i.e. whether it must be walked at all.
func (ig *Ignore) MayReinclude(rel string) bool {
	if ig.pm == nil || !ig.pm.Exclusions() {
		return false
	}
	if !ig.onlyPrefixExceptions {
		return true
	}
	dirSlash := filepath.FromSlash(rel) + string(filepath.Separator)
	for _, p := range ig.pm.Patterns() {
		if p.Exclusion() && strings.HasPrefix(patternWithoutTrailingGlob(p)+string(filepath.Separator), dirSlash) {
			return true
		}
	}
	return false
}

// literalPattern escapes the pattern metacharacters in name so that, unlike
// in the docker CLI, a Dockerfile named e.g. "Dockerfile.[prod]" is kept by
// its exception instead of the exception matching "Dockerfile.p". Where the
// separator is a backslash, patterns have no escape character, and name is
// returned as is.
func literalPattern(name string) string {
	if filepath.Separator == '\\' || !strings.ContainsAny(name, `*?[]^\`) {
		return name
	}
	var b strings.Builder
	for _, r := range name {
		if strings.ContainsRune(`*?[]^\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// onlyPrefixExceptions reports whether every `!` exception is a plain path
// (after dropping a trailing "/*" or "/**"). Only then can the walk tell from
// a directory's name alone that no exception reaches inside it and skip it
// whole; a wildcard exception such as `!**/keep` may match at any depth, so
// with one present excluded directories are always walked. This is
// BuildKit's (fsutil's) rule, which docker build uses by default.
func onlyPrefixExceptions(pm *patternmatcher.PatternMatcher) bool {
	wildcards := `*[]?^`
	if filepath.Separator != '\\' {
		wildcards += `\`
	}
	for _, p := range pm.Patterns() {
		if p.Exclusion() && strings.ContainsAny(patternWithoutTrailingGlob(p), wildcards) {
			return false
		}
	}
	return true
}

// patternWithoutTrailingGlob strips a trailing "/**" and then "/*", as fsutil
// does, so `!dir/*` counts as a plain prefix exception for "dir".
func patternWithoutTrailingGlob(p *patternmatcher.Pattern) string {
	s := p.String()
	s = strings.TrimSuffix(s, string(filepath.Separator)+"**")
	s = strings.TrimSuffix(s, string(filepath.Separator)+"*")
	return s
}
