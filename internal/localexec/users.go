package localexec

import (
	"bufio"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// stageFS returns the index of the stage's current filesystem, reading the
// base image once on first need: COPY and WORKDIR must know what already
// exists so they neither clobber directories (e.g. /tmp's 1777) nor miss
// that a destination is a directory.
func (b *builder) stageFS(s *stageState) (*imageFS, error) {
	if s.fs == nil {
		f, err := b.snapshot(s.img, false)
		if err != nil {
			return nil, fmt.Errorf("pull base image %s: read filesystem: %w", s.pullRef, err)
		}
		s.fs = f
	}
	return s.fs, nil
}

// resolveOwner turns "user[:group]" into numeric ids. Numbers are taken as
// they are (a lone uid doubles as gid, as docker documents); names are
// looked up in the stage's own /etc/passwd and /etc/group, as BuildKit
// does. Unlike BuildKit, which silently falls back to root, an unknown
// name is an error: a file owned by the wrong user is a security bug that
// surfaces only at run time.
func (b *builder) resolveOwner(s *stageState, spec string, line int) (uid, gid int, err error) {
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	if userPart == "" || (hasGroup && groupPart == "") {
		return 0, 0, userErrorf(line, "invalid --chown %q: want user[:group]", spec)
	}
	if n, ok := parseID(userPart); ok {
		uid, gid = n, n
	} else {
		entries, err := b.readUserDB(s, "etc/passwd", line)
		if err != nil {
			return 0, 0, err
		}
		e, ok := entries[userPart]
		if !ok {
			return 0, 0, userErrorf(line, "user %q not found in /etc/passwd of the stage; use a numeric uid or add the user to the base image", userPart)
		}
		uid, gid = e[0], e[1]
	}
	if hasGroup {
		if n, ok := parseID(groupPart); ok {
			gid = n
		} else {
			entries, err := b.readUserDB(s, "etc/group", line)
			if err != nil {
				return 0, 0, err
			}
			e, ok := entries[groupPart]
			if !ok {
				return 0, 0, userErrorf(line, "group %q not found in /etc/group of the stage; use a numeric gid or add the group to the base image", groupPart)
			}
			gid = e[0]
		}
	}
	return uid, gid, nil
}

func parseID(s string) (int, bool) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}

// readUserDB parses /etc/passwd (name → uid, gid) or /etc/group
// (name → gid) of the stage being built.
func (b *builder) readUserDB(s *stageState, file string, line int) (map[string][]int, error) {
	idx, err := b.stageFS(s)
	if err != nil {
		return nil, err
	}
	_, n, err := resolvePath(idx, file, true)
	if err != nil || n == nil || n.typ != typeReg || n.open == nil {
		return nil, userErrorf(line, "cannot resolve user or group names: the stage has no readable /%s; use numeric ids", file)
	}
	rc, err := n.open()
	if err != nil {
		return nil, fmt.Errorf("read /%s: %w", file, err)
	}
	defer rc.Close()
	idField := 2 // both files keep the id in the third field
	out := map[string][]int{}
	sc := bufio.NewScanner(io.LimitReader(rc, 4<<20))
	for sc.Scan() {
		t := strings.TrimSpace(sc.Text())
		if t == "" || strings.HasPrefix(t, "#") {
			continue
		}
		f := strings.Split(t, ":")
		if len(f) <= idField {
			continue
		}
		id, ok := parseID(f[idField])
		if !ok {
			continue
		}
		ids := []int{id}
		if file == "etc/passwd" && len(f) > 3 {
			g, ok := parseID(f[3])
			if !ok {
				continue
			}
			ids = append(ids, g)
		} else if file == "etc/passwd" {
			continue
		}
		if _, dup := out[f[0]]; !dup { // first entry wins, as in getpwnam
			out[f[0]] = ids
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read /%s: %w", file, err)
	}
	return out, nil
}
