package contexttar

import (
	"slices"
	"strings"
	"testing"
)

func TestWriteAppliesDockerignore(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		ignore   string
		files    tree
		kept     []string // paths of files that must survive; dirs with a trailing slash
		excluded []string // paths that must be absent
	}{
		{
			name:     "excluded file",
			ignore:   "secret.env\n",
			files:    tree{"a.txt": file("a"), "secret.env": file("TOKEN=1"), "src/main.go": file("package main")},
			kept:     []string{"a.txt", "src/main.go"},
			excluded: []string{"secret.env"},
		},
		{
			name:     "excluded directory",
			ignore:   "node_modules/\n",
			files:    tree{"app.js": file("x"), "node_modules/z.js": file("z"), "node_modules/x/y.js": file("y")},
			kept:     []string{"app.js"},
			excluded: []string{"node_modules/", "node_modules/z.js", "node_modules/x/y.js"},
		},
		{
			name:     "exception re-includes a file",
			ignore:   "*.log\n!keep.log\n",
			files:    tree{"a.log": file("a"), "b.log": file("b"), "keep.log": file("k"), "main.go": file("m")},
			kept:     []string{"keep.log", "main.go"},
			excluded: []string{"a.log", "b.log"},
		},
		{
			name:     "exception inside an excluded directory",
			ignore:   "build\n!build/keep.txt\n",
			files:    tree{"build/out.bin": file("o"), "build/keep.txt": file("k"), "build/sub/x": file("x"), "main.go": file("m")},
			kept:     []string{"build/keep.txt", "main.go"},
			excluded: []string{"build/out.bin", "build/sub/", "build/sub/x"},
		},
		{
			name:     "exception re-includes a subdirectory",
			ignore:   "assets\n!assets/img\n",
			files:    tree{"assets/css/a.css": file("c"), "assets/img/logo.png": file("l"), "assets/img/sub/x.png": file("x")},
			kept:     []string{"assets/img/logo.png", "assets/img/sub/x.png"},
			excluded: []string{"assets/css/", "assets/css/a.css"},
		},
		{
			name:     "wildcard exception walks into an excluded directory",
			ignore:   "cache\n!cache/**/*.keep\n",
			files:    tree{"cache/a/b.keep": file("b"), "cache/a/c.tmp": file("c"), "cache/d.tmp": file("d"), "x.txt": file("x")},
			kept:     []string{"cache/a/b.keep", "x.txt"},
			excluded: []string{"cache/a/c.tmp", "cache/d.tmp"},
		},
		{
			name:     "exception matching nothing leaves no empty directory",
			ignore:   "vendor\n!vendor/missing.go\n",
			files:    tree{"vendor/a.go": file("a"), "main.go": file("m")},
			kept:     []string{"main.go"},
			excluded: []string{"vendor/", "vendor/a.go"},
		},
		{
			name:     "double star excludes at any depth",
			ignore:   "**/*.tmp\n",
			files:    tree{"a.tmp": file("a"), "d/b.tmp": file("b"), "d/e/c.tmp": file("c"), "d/keep.txt": file("k")},
			kept:     []string{"d/e/", "d/keep.txt"},
			excluded: []string{"a.tmp", "d/b.tmp", "d/e/c.tmp"},
		},
		{
			name:     "single star stays in one directory",
			ignore:   "*.md\n",
			files:    tree{"README.md": file("r"), "docs/guide.md": file("g")},
			kept:     []string{"docs/guide.md"},
			excluded: []string{"README.md"},
		},
		{
			name:     "comments blank lines and leading slash",
			ignore:   "# a comment\n\n   /secret   \n",
			files:    tree{"secret": file("s"), "public": file("p"), "sub/secret": file("nested, not matched")},
			kept:     []string{"public", "sub/secret"},
			excluded: []string{"secret"},
		},
		{
			name:     "later pattern overrides an exception",
			ignore:   "*.txt\n!important.txt\nimportant.txt\n",
			files:    tree{"important.txt": file("i"), "notes.txt": file("n"), "main.go": file("m")},
			kept:     []string{"main.go"},
			excluded: []string{"important.txt", "notes.txt"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ignore := tree{".dockerignore": file(tt.ignore)}
			full := newTree(t, tt.files.with(ignore), buildOpts{})

			// The copy holds only what must survive, with the same
			// .dockerignore (which is itself part of the context).
			only := ignore.with(nil)
			for _, p := range tt.kept {
				if strings.HasSuffix(p, "/") {
					only[strings.TrimSuffix(p, "/")] = dirNode()
				} else {
					only[p] = tt.files[p]
				}
			}
			without := newTree(t, only, buildOpts{reverse: true})

			res, tgz := pack(t, full, Options{})
			if want := digestOf(t, without, Options{}); res.Digest != want {
				t.Errorf("digest with excluded files %s != digest of a copy without them %s", res.Digest, want)
			}
			got := names(t, tgz)
			if want := wantNames(append([]string{".dockerignore"}, tt.kept...)...); !slices.Equal(got, want) {
				t.Errorf("archive names = %q\nwant             %q", got, want)
			}
			for _, p := range tt.excluded {
				if slices.Contains(got, p) {
					t.Errorf("excluded %q is in the archive", p)
				}
			}
		})
	}
}

func TestWriteKeepsDockerfileAndDockerignore(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		ignore     string
		dockerfile string
		files      tree
		want       []string
	}{
		{
			name:   "everything excluded",
			ignore: "*\n",
			files:  tree{"Dockerfile": file("FROM scratch"), "main.go": file("m")},
			want:   []string{".dockerignore", "Dockerfile"},
		},
		{
			name:   "both listed by name",
			ignore: "Dockerfile\n.dockerignore\n",
			files:  tree{"Dockerfile": file("FROM scratch"), "main.go": file("m")},
			want:   []string{".dockerignore", "Dockerfile", "main.go"},
		},
		{
			name:       "custom Dockerfile in an excluded directory",
			ignore:     "build\n",
			dockerfile: "build/prod.Dockerfile",
			files:      tree{"build/prod.Dockerfile": file("FROM scratch"), "build/other": file("o"), "main.go": file("m")},
			want:       []string{".dockerignore", "build/prod.Dockerfile", "main.go"},
		},
		{
			name:       "custom Dockerfile given with ./",
			ignore:     "*.Dockerfile\n",
			dockerfile: "./ci.Dockerfile",
			files:      tree{"ci.Dockerfile": file("FROM scratch"), "old.Dockerfile": file("o")},
			want:       []string{".dockerignore", "ci.Dockerfile"},
		},
		{
			name:       "Dockerfile name with pattern characters",
			ignore:     "*\n",
			dockerfile: "Dockerfile.[prod]",
			files:      tree{"Dockerfile.[prod]": file("FROM scratch"), "Dockerfile.p": file("decoy")},
			want:       []string{".dockerignore", "Dockerfile.[prod]"},
		},
		{
			name:   "missing Dockerfile is not an error",
			ignore: "*\n",
			files:  tree{"main.go": file("m")},
			want:   []string{".dockerignore"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := newTree(t, tt.files.with(tree{".dockerignore": file(tt.ignore)}), buildOpts{})
			_, tgz := pack(t, dir, Options{Dockerfile: tt.dockerfile})
			if got, want := names(t, tgz), wantNames(tt.want...); !slices.Equal(got, want) {
				t.Errorf("archive names = %q, want %q", got, want)
			}
		})
	}
}
