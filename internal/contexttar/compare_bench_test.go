package contexttar

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// The packer under measurement runs in a child process (this test binary,
// re-executed), so its peak RSS is its own and comparable with tar's.
const packChildEnv = "BUILDQ_PACK_CHILD_DIR"

func TestMain(m *testing.M) {
	if dir := os.Getenv(packChildEnv); dir != "" {
		res, err := Write(context.Background(), dir, io.Discard, Options{MaxBytes: 4 << 30})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Println(res.Digest)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// BenchmarkPack200MB packs and hashes a 200 MB directory and compares it
// with `tar -cz` of the same directory. It reports MB/s and the child
// process's peak RSS for both; it asserts nothing.
func BenchmarkPack200MB(b *testing.B) {
	dir := b.TempDir()
	const files, size = 200, 1 << 20
	buf := make([]byte, size)
	for i := range files {
		// Half random (incompressible), half repetitive, like real sources
		// plus assets.
		if i%2 == 0 {
			_, _ = rand.Read(buf)
		} else {
			for j := range buf {
				buf[j] = byte('a' + j%26)
			}
		}
		p := filepath.Join(dir, fmt.Sprintf("d%02d", i%16), fmt.Sprintf("f%03d.bin", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(p, buf, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	total := int64(files * size)
	run := func(b *testing.B, cmd func() *exec.Cmd) {
		b.SetBytes(total)
		var maxRSS int64
		for b.Loop() {
			c := cmd()
			var stderr bytes.Buffer
			c.Stdout, c.Stderr = io.Discard, &stderr
			if err := c.Run(); err != nil {
				b.Fatalf("%v: %s", err, stderr.String())
			}
			if ru, ok := c.ProcessState.SysUsage().(*syscall.Rusage); ok {
				maxRSS = max(maxRSS, ru.Maxrss)
			}
		}
		b.ReportMetric(float64(maxRSS)/1024, "peak-RSS-MB")
	}
	b.Run("buildq", func(b *testing.B) {
		run(b, func() *exec.Cmd {
			c := exec.Command(os.Args[0], "-test.run=^$")
			c.Env = append(os.Environ(), packChildEnv+"="+dir)
			return c
		})
	})
	b.Run("tar-cz", func(b *testing.B) {
		if _, err := exec.LookPath("tar"); err != nil {
			b.Skip("tar is not installed")
		}
		run(b, func() *exec.Cmd { return exec.Command("sh", "-c", "tar -cz -C \"$0\" . >/dev/null", dir) })
	})
}
