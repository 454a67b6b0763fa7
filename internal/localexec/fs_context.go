package localexec

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// contextFS is the build context on disk, minus what .dockerignore excludes.
type contextFS struct {
	root   string
	ignore *patternmatcher.PatternMatcher
}

func newContextFS(root string, ignore *patternmatcher.PatternMatcher) *contextFS {
	return &contextFS{root: root, ignore: ignore}
}

// loadDockerignore reads <Dockerfile>.dockerignore if present, else
// .dockerignore, like BuildKit. The files are user input, so bad patterns
// are BuildErrors.
func loadDockerignore(contextDir, dockerfile string) (*patternmatcher.PatternMatcher, error) {
	for _, name := range []string{dockerfile + ".dockerignore", ".dockerignore"} {
		f, err := os.Open(filepath.Join(contextDir, filepath.FromSlash(name)))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("localexec: read %s: %w", name, err)
		}
		patterns, err := ignorefile.ReadAll(f)
		f.Close()
		if err != nil {
			return nil, &BuildError{Err: fmt.Errorf("%s: %w", name, err)}
		}
		if len(patterns) == 0 {
			return nil, nil
		}
		pm, err := patternmatcher.New(patterns)
		if err != nil {
			return nil, &BuildError{Err: fmt.Errorf("%s: %w", name, err)}
		}
		return pm, nil
	}
	return nil, nil
}

// excludedBy reports whether pm excludes p. A directory that is excluded
// but has a "!" exception somewhere below stays visible so the exception
// can be reached, mirroring BuildKit's file walker.
func excludedBy(pm *patternmatcher.PatternMatcher, p string, isDir bool) (bool, error) {
	if pm == nil || p == "" {
		return false, nil
	}
	m, err := pm.MatchesOrParentMatches(p)
	if err != nil || !m {
		return false, err
	}
	if isDir && pm.Exclusions() {
		dirSlash := p + "/"
		for _, pat := range pm.Patterns() {
			if pat.Exclusion() && strings.HasPrefix(pat.String()+"/", dirSlash) {
				return false, nil
			}
		}
	}
	return true, nil
}

func (c *contextFS) abs(p string) string {
	return filepath.Join(c.root, filepath.FromSlash(p))
}

func (c *contextFS) lstat(p string) (*node, error) {
	full := c.abs(p)
	lstat := os.Lstat
	if p == "" {
		lstat = os.Stat // the context root may itself be a symlink
	}
	fi, err := lstat(full)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if ex, err := excludedBy(c.ignore, p, fi.IsDir()); err != nil || ex {
		return nil, err
	}
	return nodeFromFileInfo(full, fi)
}

func (c *contextFS) readDir(p string) ([]string, error) {
	ents, err := os.ReadDir(c.abs(p))
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(ents))
	for _, e := range ents {
		child := joinPath(p, e.Name())
		if ex, err := excludedBy(c.ignore, child, e.IsDir()); err != nil {
			return nil, err
		} else if ex {
			continue
		}
		t := e.Type()
		if t.IsRegular() || t.IsDir() || t&fs.ModeSymlink != 0 {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	return names, nil
}

// nodeFromFileInfo describes a context file. Owner and time are not taken
// from disk: the context is always copied as root with epoch times, so
// the result does not depend on who checked it out or when.
func nodeFromFileInfo(full string, fi fs.FileInfo) (*node, error) {
	m := fi.Mode()
	n := &node{mode: int64(m.Perm())}
	if m&fs.ModeSetuid != 0 {
		n.mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		n.mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		n.mode |= 0o1000
	}
	switch {
	case m.IsRegular():
		n.typ = typeReg
		n.size = fi.Size()
		n.open = func() (io.ReadCloser, error) { return os.Open(full) }
	case m.IsDir():
		n.typ = typeDir
	case m&fs.ModeSymlink != 0:
		target, err := os.Readlink(full)
		if err != nil {
			return nil, err
		}
		n.typ = typeSymlink
		n.linkname = target
		n.mode = 0o777
	default:
		// Sockets, fifos and devices are not part of a build context.
		return nil, nil
	}
	return n, nil
}
