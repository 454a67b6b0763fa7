//go:build unix

package contexttar

import (
	"net"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

func TestWriteSkipsSpecialFiles(t *testing.T) {
	t.Parallel()
	files := tree{"Dockerfile": file("FROM scratch"), "sub/f": file("f")}
	dir := newTree(t, files, buildOpts{})
	if err := syscall.Mkfifo(filepath.Join(dir, "sub", "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Sockets are made by binding to a path; a live listener keeps it.
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: shortSocketPath(t, dir), Net: "unix"})
	if err != nil {
		t.Skipf("cannot create a unix socket: %v", err)
	}
	defer l.Close()

	res, tgz := pack(t, dir, Options{})
	if got, want := names(t, tgz), wantNames("Dockerfile", "sub/f"); !slices.Equal(got, want) {
		t.Errorf("archive names = %q, want %q (FIFO and socket skipped)", got, want)
	}
	if want := digestOf(t, newTree(t, files, buildOpts{}), Options{}); res.Digest != want {
		t.Errorf("digest with special files %s != without %s", res.Digest, want)
	}
}

// shortSocketPath returns a socket path inside dir, skipping the test when
// it would not fit the ~100-byte sun_path limit.
func shortSocketPath(t *testing.T, dir string) string {
	p := filepath.Join(dir, "sock")
	if len(p) >= 100 {
		t.Skipf("temp dir path too long for a unix socket: %s", p)
	}
	return p
}
