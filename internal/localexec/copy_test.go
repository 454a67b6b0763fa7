package localexec

import (
	"archive/tar"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestCopySemantics(t *testing.T) {
	t.Parallel()
	files := map[string]file{
		"a.txt":          {content: "a"},
		"b.txt":          {content: "b"},
		"c.md":           {content: "c"},
		"dir/x":          {content: "x"},
		"dir/nested/y":   {content: "y"},
		"dir/link":       {symlink: "x"},
		"link-to-a":      {symlink: "a.txt"},
		"tree/keep.go":   {content: "go"},
		"tree/drop.log":  {content: "log"},
		"tree/sub/z.log": {content: "log"},
		"secret.env":     {content: "TOKEN=1"},
		"node_modules/m": {content: "m"},
		".dockerignore":  {content: "secret.env\nnode_modules\n"},
	}
	tests := []struct {
		name  string
		body  string
		want  map[string]string // path -> content ("" for directories, "->target" for symlinks)
		avoid []string
	}{
		{
			name: "file to a new name",
			body: "COPY a.txt /renamed",
			want: map[string]string{"renamed": "a"},
		},
		{
			name: "several files into a directory",
			body: "COPY a.txt b.txt /d/",
			want: map[string]string{"d": "", "d/a.txt": "a", "d/b.txt": "b"},
		},
		{
			name: "file into an existing directory without trailing slash",
			body: "COPY a.txt /d/\nCOPY b.txt /d",
			want: map[string]string{"d/a.txt": "a", "d/b.txt": "b"},
		},
		{
			name: "directory contents, not the directory, go to dest",
			body: "COPY dir /target",
			want: map[string]string{"target/x": "x", "target/nested/y": "y", "target/link": "->x"},
		},
		{
			name:  "wildcards",
			body:  "COPY *.txt /w/",
			want:  map[string]string{"w/a.txt": "a", "w/b.txt": "b"},
			avoid: []string{"w/c.md"},
		},
		{
			name: "a wildcard matching nothing is fine",
			body: "COPY *.none /nothing/",
			want: map[string]string{"nothing": ""},
		},
		{
			name: "a symlink source is followed",
			body: "COPY link-to-a /followed",
			want: map[string]string{"followed": "a"},
		},
		{
			name: "destination relative to WORKDIR",
			body: "WORKDIR /srv\nCOPY a.txt .\nCOPY b.txt rel/\nCOPY c.md renamed.md",
			want: map[string]string{"srv/a.txt": "a", "srv/rel/b.txt": "b", "srv/renamed.md": "c"},
		},
		{
			name:  "dockerignore hides files",
			body:  "COPY . /ctx/",
			want:  map[string]string{"ctx/a.txt": "a", "ctx/dir/nested/y": "y"},
			avoid: []string{"ctx/secret.env", "ctx/node_modules", "ctx/node_modules/m"},
		},
		{
			name:  "exclude flag",
			body:  "COPY --exclude=*.log --exclude=sub tree /t/",
			want:  map[string]string{"t/keep.go": "go"},
			avoid: []string{"t/drop.log", "t/sub", "t/sub/z.log"},
		},
		{
			name: "heredoc",
			body: "ARG WHO=world\nCOPY <<EOF /etc/motd\nhello $WHO\nEOF",
			want: map[string]string{"etc/motd": "hello world\n"},
		},
		{
			name: "later source overwrites earlier in the same COPY",
			body: "COPY a.txt /same\nCOPY b.txt /same",
			want: map[string]string{"same": "b"},
		},
		{
			name:  "copy through a symlinked directory lands in its target",
			body:  "COPY root /\nCOPY dir /real/\nCOPY a.txt /lnk/new.txt\nCOPY b.txt /lnk/",
			want:  map[string]string{"lnk": "->real", "real/new.txt": "a", "real/b.txt": "b", "real/x": "x"},
			avoid: []string{"lnk/new.txt", "lnk/b.txt"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctxDir := writeContext(t, "FROM scratch\n"+tc.body+"\n", withFile(files, "root/lnk", file{symlink: "real"}))
			fs := flatten(t, build(t, Options{ContextDir: ctxDir}))
			for p, want := range tc.want {
				e, ok := fs[p]
				if !ok {
					t.Errorf("%s missing; have %v", p, keys(fs))
					continue
				}
				got := e.content
				if e.typ == tar.TypeSymlink {
					got = "->" + e.linkname
				}
				if got != want {
					t.Errorf("%s = %q, want %q", p, got, want)
				}
			}
			for _, p := range tc.avoid {
				if _, ok := fs[p]; ok {
					t.Errorf("%s should not be in the image", p)
				}
			}
		})
	}
}

func TestChownChmod(t *testing.T) {
	t.Parallel()
	files := map[string]file{"f": {content: "f"}, "d/g": {content: "g"}, "d/sub/h": {content: "h"}}
	tests := []struct {
		name string
		body string
		want map[string][3]int64 // name -> uid, gid, mode
	}{
		{
			name: "numeric uid and gid with chmod",
			body: "COPY --chown=1000:2000 --chmod=0750 f /opt/f",
			want: map[string][3]int64{"opt/": {1000, 2000, 0o755}, "opt/f": {1000, 2000, 0o750}},
		},
		{
			name: "lone uid doubles as gid",
			body: "COPY --chown=55 f /f",
			want: map[string][3]int64{"f": {55, 55, 0o644}},
		},
		{
			name: "directory copy chowns every entry and chmod applies to dirs too",
			body: "COPY --chown=7:8 --chmod=700 d /app/",
			want: map[string][3]int64{"app/": {7, 8, 0o755}, "app/g": {7, 8, 0o700}, "app/sub/": {7, 8, 0o700}, "app/sub/h": {7, 8, 0o700}},
		},
		{
			name: "build args expand in chown",
			body: "ARG UID=1234\nCOPY --chown=${UID}:${UID} f /f",
			want: map[string][3]int64{"f": {1234, 1234, 0o644}},
		},
		{
			name: "names resolve from the stage's passwd and group",
			body: "COPY passwd /etc/passwd\nCOPY group /etc/group\nCOPY --chown=app:staff f /f",
			want: map[string][3]int64{"f": {1001, 50, 0o644}},
		},
		{
			name: "user name alone takes the primary group",
			body: "COPY passwd group /etc/\nCOPY --chown=app f /f",
			want: map[string][3]int64{"f": {1001, 1001, 0o644}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs := withFile(files, "passwd", file{content: "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001::/home/app:/bin/sh\n"})
			fs = withFile(fs, "group", file{content: "root:x:0:\nstaff:x:50:app\n"})
			img := build(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", fs)})
			layers := imageLayers(t, img)
			last := layers[len(layers)-1]
			got := map[string][3]int64{}
			for _, e := range last {
				got[e.name] = [3]int64{int64(e.uid), int64(e.gid), e.mode}
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("last layer owners/modes %v, want %v", got, tc.want)
			}
		})
	}
}

func TestAddArchive(t *testing.T) {
	t.Parallel()
	headers := []tar.Header{
		{Name: "./", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "./pkg/", Typeflag: tar.TypeDir, Mode: 0o750, Uid: 10, Gid: 20},
		{Name: "./pkg/bin", Typeflag: tar.TypeReg, Mode: 0o755, Uid: 10, Gid: 20},
		{Name: "./pkg/hard", Typeflag: tar.TypeLink, Linkname: "./pkg/bin"},
		{Name: "./pkg/soft", Typeflag: tar.TypeSymlink, Linkname: "bin"},
		{Name: "implied/dir/file", Typeflag: tar.TypeReg, Mode: 0o600},
	}
	contents := map[string]string{"./pkg/bin": "binary", "implied/dir/file": "deep"}
	files := map[string]file{
		"release.tar.gz": {content: string(makeTar(t, true, headers, contents))},
		"plain.data":     {content: string(makeTar(t, false, headers, contents))},
		"notes.txt":      {content: "just text"},
	}
	tests := []struct {
		name  string
		body  string
		want  map[string]entry
		avoid []string
	}{
		{
			name: "gzip tar is extracted keeping modes and owners",
			body: "ADD release.tar.gz /opt/",
			want: map[string]entry{
				"opt/pkg":              {typ: tar.TypeDir, mode: 0o750, uid: 10, gid: 20},
				"opt/pkg/bin":          {typ: tar.TypeReg, mode: 0o755, uid: 10, gid: 20, content: "binary"},
				"opt/pkg/hard":         {typ: tar.TypeReg, mode: 0o755, uid: 10, gid: 20, content: "binary"},
				"opt/pkg/soft":         {typ: tar.TypeSymlink, mode: 0o777, linkname: "bin"},
				"opt/implied/dir/file": {typ: tar.TypeReg, mode: 0o600, content: "deep"},
			},
			avoid: []string{"opt/release.tar.gz"},
		},
		{
			name: "archive detection ignores the file name and dest needs no slash",
			body: "ADD --chown=3:4 plain.data /x",
			want: map[string]entry{
				"x/pkg/bin":  {typ: tar.TypeReg, mode: 0o755, uid: 3, gid: 4, content: "binary"},
				"x/implied":  {typ: tar.TypeDir, mode: 0o755, uid: 3, gid: 4},
				"x/pkg/soft": {typ: tar.TypeSymlink, mode: 0o777, uid: 3, gid: 4, linkname: "bin"},
			},
		},
		{
			name: "non-archives are copied as files",
			body: "ADD notes.txt /notes.txt",
			want: map[string]entry{"notes.txt": {typ: tar.TypeReg, mode: 0o644, content: "just text"}},
		},
		{
			name:  "COPY never extracts",
			body:  "COPY release.tar.gz /r/",
			want:  map[string]entry{"r/release.tar.gz": {typ: tar.TypeReg, mode: 0o644, content: files["release.tar.gz"].content}},
			avoid: []string{"r/pkg"},
		},
		{
			name:  "ADD --unpack=false copies the archive",
			body:  "ADD --unpack=false release.tar.gz /r/",
			want:  map[string]entry{"r/release.tar.gz": {typ: tar.TypeReg, mode: 0o644, content: files["release.tar.gz"].content}},
			avoid: []string{"r/pkg"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs := flatten(t, build(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", files)}))
			for p, want := range tc.want {
				got, ok := fs[p]
				if !ok {
					t.Errorf("%s missing; have %v", p, keys(fs))
					continue
				}
				got.name, got.mtime = "", time.Time{}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("%s = %+v, want %+v", p, got, want)
				}
			}
			for _, p := range tc.avoid {
				if _, ok := fs[p]; ok {
					t.Errorf("%s should not be in the image", p)
				}
			}
		})
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestDockerfileLocation(t *testing.T) {
	t.Parallel()
	files := map[string]file{
		"build/app.Dockerfile":              {content: "FROM scratch\nCOPY . /ctx/\n"},
		"build/app.Dockerfile.dockerignore": {content: "*.secret\nbuild\n"},
		".dockerignore":                     {content: "keep.txt\n"},
		"keep.txt":                          {content: "k"},
		"x.secret":                          {content: "s"},
	}
	img := build(t, Options{ContextDir: writeContext(t, "", files), Dockerfile: "build/app.Dockerfile"})
	fs := flatten(t, img)
	if _, ok := fs["ctx/keep.txt"]; !ok {
		t.Error("the Dockerfile-specific ignore file should replace .dockerignore")
	}
	for _, p := range []string{"ctx/x.secret", "ctx/build"} {
		if _, ok := fs[p]; ok {
			t.Errorf("%s should be ignored", p)
		}
	}
}

func TestAddRefusals(t *testing.T) {
	t.Parallel()
	xz := string([]byte{0xfd, '7', 'z', 'X', 'Z', 0x00, 1, 2, 3})
	tests := []struct {
		name string
		body string
		want string
	}{
		{"xz archives", "ADD data.tar.xz /d/", "xz-compressed archives are not supported"},
		{"checksum", "ADD --checksum=sha256:0000000000000000000000000000000000000000000000000000000000000000 data.tar.xz /d/", "--checksum"},
		{"http URL", "ADD http://example.com/file /file", "ADD of a URL is not supported by the local executor; use COPY"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := tryBuild(t, Options{ContextDir: writeContext(t, "FROM scratch\n"+tc.body+"\n", map[string]file{"data.tar.xz": {content: xz}})})
			var be *BuildError
			if !errors.As(err, &be) || be.Line != 2 || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want a BuildError at line 2 mentioning %q", err, tc.want)
			}
		})
	}
}
