package gitsource

import (
	"context"
	"os"

	"github.com/go-git/go-billy/v5"
)

// ctxFS is the object store's filesystem: once ctx ends, every read,
// write and seek of a file it opened fails with ctx's error. go-git
// indexes a pack in the pack writer's Close and rebuilds deltas when
// objects are read, and neither takes a context; both read the pack
// files through here, so a Fetch's Timeout ends that work too, soon
// after it expires rather than when go-git is done.
type ctxFS struct {
	billy.Filesystem
	ctx context.Context
}

func (fs ctxFS) wrap(f billy.File, err error) (billy.File, error) {
	if err != nil {
		return nil, err
	}
	return ctxFile{File: f, ctx: fs.ctx}, nil
}

// Create implements billy.Filesystem.
func (fs ctxFS) Create(name string) (billy.File, error) {
	return fs.wrap(fs.Filesystem.Create(name))
}

// Open implements billy.Filesystem.
func (fs ctxFS) Open(name string) (billy.File, error) {
	return fs.wrap(fs.Filesystem.Open(name))
}

// OpenFile implements billy.Filesystem.
func (fs ctxFS) OpenFile(name string, flag int, perm os.FileMode) (billy.File, error) {
	return fs.wrap(fs.Filesystem.OpenFile(name, flag, perm))
}

// TempFile implements billy.Filesystem.
func (fs ctxFS) TempFile(dir, prefix string) (billy.File, error) {
	return fs.wrap(fs.Filesystem.TempFile(dir, prefix))
}

// Chroot implements billy.Filesystem.
func (fs ctxFS) Chroot(path string) (billy.Filesystem, error) {
	sub, err := fs.Filesystem.Chroot(path)
	if err != nil {
		return nil, err
	}
	return ctxFS{Filesystem: sub, ctx: fs.ctx}, nil
}

// ctxFile is a file of a ctxFS.
type ctxFile struct {
	billy.File
	ctx context.Context
}

// Read implements io.Reader.
func (f ctxFile) Read(p []byte) (int, error) {
	if err := f.ctx.Err(); err != nil {
		return 0, err
	}
	return f.File.Read(p)
}

// ReadAt implements io.ReaderAt.
func (f ctxFile) ReadAt(p []byte, off int64) (int, error) {
	if err := f.ctx.Err(); err != nil {
		return 0, err
	}
	return f.File.ReadAt(p, off)
}

// Seek implements io.Seeker.
func (f ctxFile) Seek(offset int64, whence int) (int64, error) {
	if err := f.ctx.Err(); err != nil {
		return 0, err
	}
	return f.File.Seek(offset, whence)
}

// Write implements io.Writer.
func (f ctxFile) Write(p []byte) (int, error) {
	if err := f.ctx.Err(); err != nil {
		return 0, err
	}
	return f.File.Write(p)
}
