package contexttar

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
)

func TestWriteReportsProgress(t *testing.T) {
	t.Parallel()
	dir := newTree(t, sample, buildOpts{})
	type call struct {
		bytes int64
		files int
	}
	var calls []call
	res, err := Write(context.Background(), dir, io.Discard, Options{Progress: func(b int64, n int) {
		calls = append(calls, call{b, n})
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != res.Files {
		t.Fatalf("%d progress calls for %d entries", len(calls), res.Files)
	}
	var total int64
	for _, n := range sample {
		if !n.dir && n.link == "" {
			total += int64(len(n.content))
		}
	}
	if last := calls[len(calls)-1]; last != (call{total, res.Files}) {
		t.Errorf("last progress call = %+v, want {%d %d}", last, total, res.Files)
	}
	for i := 1; i < len(calls); i++ {
		if calls[i].files != calls[i-1].files+1 || calls[i].bytes < calls[i-1].bytes {
			t.Fatalf("progress not monotonic at call %d: %+v then %+v", i, calls[i-1], calls[i])
		}
	}
}

// TestWriteStreams checks that packing a file does not buffer it: the heap
// allocated while packing a 24 MiB file must stay far below its size. It is
// not parallel because runtime.MemStats counts every goroutine's
// allocations.
func TestWriteStreams(t *testing.T) {
	const size = 24 << 20
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	for range size / len(chunk) {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	res, err := Write(context.Background(), dir, io.Discard, Options{})
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	if res.Size < size {
		t.Fatalf("Size = %d, want at least %d", res.Size, size)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > size/4 {
		t.Errorf("Write allocated %d bytes for a %d-byte file; it should stream", alloc, size)
	}
}

// TestDigestMatchesWrite checks that Digest, which skips the compression,
// returns exactly Write's Result, makes the same progress calls and fails
// the same way, so a context hashed with Digest is named as before.
func TestDigestMatchesWrite(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 4))
	large := make([]byte, 5<<20+1) // several copy buffers, not block-aligned
	for i := range large {
		large[i] = byte(rng.Uint32())
	}
	tests := []struct {
		name string
		tree tree
		opts Options
	}{
		{name: "sample (symlinks, empty directory, PAX names)", tree: sample},
		{name: "empty context", tree: tree{"empty": dirNode()}},
		{
			name: "dockerignore with exceptions",
			tree: tree{
				".dockerignore":         file("node_modules\n*.log\n!keep.log\nbuild\n!build/out/keep\ncache\n!cache/**/*.keep\ndocker\n"),
				"node_modules/x/i.js":   file("x"),
				"a.log":                 file("a"),
				"keep.log":              file("k"),
				"build/tmp/o":           file("o"),
				"build/out/keep":        file("keep"),
				"cache/a/b.keep":        file("b"),
				"cache/a/c.tmp":         file("c"),
				"docker/Dockerfile.dev": file("FROM scratch\n"),
				"src/main.go":           file("package main\n"),
				"src/empty":             dirNode(),
				"src/link":              link("main.go"),
			},
			opts: Options{Dockerfile: "docker/Dockerfile.dev"},
		},
		{name: "large file", tree: tree{"Dockerfile": file("FROM scratch\n"), "big.bin": file(string(large)), "tool": exe("#!/bin/sh\n")}},
		{name: "over the byte cap", tree: sample, opts: Options{MaxBytes: 100}},
	}
	type call struct {
		bytes int64
		files int
	}
	run := func(opts Options, f func(Options) (Result, error)) (Result, []call, error) {
		var calls []call
		opts.Progress = func(b int64, n int) { calls = append(calls, call{b, n}) }
		res, err := f(opts)
		return res, calls, err
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := newTree(t, tt.tree, buildOpts{})
			want, wantCalls, wantErr := run(tt.opts, func(o Options) (Result, error) {
				return Write(context.Background(), dir, io.Discard, o)
			})
			got, gotCalls, err := run(tt.opts, func(o Options) (Result, error) {
				return Digest(context.Background(), dir, o)
			})
			if fmt.Sprint(err) != fmt.Sprint(wantErr) {
				t.Fatalf("Digest error = %v, Write error = %v", err, wantErr)
			}
			if got != want {
				t.Errorf("Digest = %+v, Write = %+v", got, want)
			}
			if !slices.Equal(gotCalls, wantCalls) {
				t.Errorf("Digest progress = %v, Write progress = %v", gotCalls, wantCalls)
			}
		})
	}
}

// writeBenchContext lays out 64 MiB in 256 files (16 directories of 16
// files of 256 KiB of text-like data, so gzip has real work) and returns
// its root and content size.
func writeBenchContext(b *testing.B) (string, int64) {
	const (
		dirs, filesPerDir = 16, 16
		fileSize          = 256 << 10
	)
	root := b.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte("etaoin shrdlu\n{}();=")
	buf := make([]byte, fileSize)
	for d := range dirs {
		sub := filepath.Join(root, fmt.Sprintf("pkg%02d", d))
		if err := os.Mkdir(sub, 0o755); err != nil {
			b.Fatal(err)
		}
		for f := range filesPerDir {
			for i := range buf {
				buf[i] = alphabet[rng.IntN(len(alphabet))]
			}
			if err := os.WriteFile(filepath.Join(sub, fmt.Sprintf("file%02d.txt", f)), buf, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	return root, dirs * filesPerDir * fileSize
}

// BenchmarkWrite packs writeBenchContext's 64 MiB to io.Discard.
func BenchmarkWrite(b *testing.B) {
	root, size := writeBenchContext(b)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Write(context.Background(), root, io.Discard, Options{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDigest hashes the same 64 MiB as BenchmarkWrite without
// compressing it: the difference between the two is what a hash-only pass
// (s3store.UploadContext's first, `buildq render`'s only) saves.
func BenchmarkDigest(b *testing.B) {
	root, size := writeBenchContext(b)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Digest(context.Background(), root, Options{}); err != nil {
			b.Fatal(err)
		}
	}
}
