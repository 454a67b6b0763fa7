//go:build integration && benche2e

package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/s3store"
)

// p6CPUProfileEnv, when set to a path, makes TestBenchE2EP6 write a CPU
// profile of its first buildq round there (go tool pprof -top PATH).
const p6CPUProfileEnv = "BUILDQ_BENCH_P6_CPUPROFILE"

// TestBenchE2EP6 measures figure P6 of docs/benchmarks.md: what `buildq
// submit` spends on a 200 MB context before it publishes, i.e. packing it
// into the normalized tar.gz, hashing it and uploading it to S3, through
// the very calls the command makes (s3store.New with the command's
// defaults, Store.ForTenant, Store.UploadContext with contexttar.Options
// carrying the default Dockerfile and byte cap).
//
// The baseline, measured in the same run against the same MinIO, is what a
// script would do by hand: the system `tar -cz` writing a file, then
// minio-go's FPutObject of that file with default options. Both pack the
// same files (the .dockerignore excludes nothing that exists, so buildq
// keeps everything tar does) and both upload the whole compressed context.
// The rounds alternate which side goes first; the figures are medians.
// Every run reads the context from the page cache: the generated files were
// just written and fit in memory.
//
// It asserts nothing about speed; it fails only when a step fails.
func TestBenchE2EP6(t *testing.T) {
	began := time.Now()
	ctx := context.Background()
	if _, err := exec.LookPath("tar"); err != nil {
		// The figure is a ratio to the baseline: without tar there is
		// no figure, which is a failure of the benchmark, not a pass.
		t.Fatal("P6's baseline needs tar (Debian's tar package):", err)
	}

	dir := filepath.Join(t.TempDir(), "context")
	files, contentBytes := generateP6Context(t, dir)
	work := t.TempDir()

	// What `buildq submit` builds from its flags' defaults
	// (cmd/buildq/submit.go, requestflags.go); the tenant only names the
	// key prefix, and a tenant of its own keeps this test's objects apart.
	const tenant = "bench-p6"
	store, err := s3store.New(s3store.Config{Endpoint: shared.minioEndpoint, Region: s3store.DefaultRegion,
		AccessKey: shared.minioUser, SecretKey: shared.minioPassword, Bucket: shared.bucket})
	if err != nil {
		t.Fatal(err)
	}
	store = store.ForTenant(tenant)
	opts := contexttar.Options{Dockerfile: "Dockerfile", MaxBytes: contexttar.DefaultMaxBytes}

	u, err := url.Parse(shared.minioEndpoint)
	if err != nil {
		t.Fatal(err)
	}
	mc, err := minio.New(u.Host, &minio.Options{Creds: credentials.NewStaticV4(shared.minioUser, shared.minioPassword, ""), Region: s3store.DefaultRegion})
	if err != nil {
		t.Fatal(err)
	}
	remove := func(key string) {
		if err := mc.RemoveObject(ctx, shared.bucket, key, minio.RemoveObjectOptions{}); err != nil {
			t.Errorf("remove %s: %v", key, err)
		}
	}

	// The key is the context's digest: compute it once (untimed) so that a
	// leftover object cannot turn the first round into a skipped upload.
	digest, err := contexttar.Write(ctx, dir, io.Discard, opts)
	if err != nil {
		t.Fatal(err)
	}
	buildqKey := s3store.TenantContextKey(tenant, digest.Digest)
	remove(buildqKey)
	const baselineKey = "bench/p6/baseline.tar.gz"
	t.Cleanup(func() { remove(buildqKey); remove(baselineKey) })

	var (
		buildqSecs, baseSecs   []float64
		buildqHeap, baseHeap   []float64 // peak HeapInuse growth, MiB
		buildqAlloc            []float64 // bytes allocated, MB
		buildqHash             []float64 // the hashing pass, s
		baseTar                []float64 // tar -cz alone, s
		buildqSize, baseSize   int64     // compressed objects
		tarSize                int64     // uncompressed tar, buildq's
		profilePath, profileOn = os.Getenv(p6CPUProfileEnv), false
	)

	runBuildq := func(round int) {
		if round == 0 && profilePath != "" {
			f, err := os.Create(profilePath)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if err := pprof.StartCPUProfile(f); err != nil {
				t.Fatal(err)
			}
			profileOn = true
			defer pprof.StopCPUProfile()
		}
		stop := p6SampleHeap()
		t0 := time.Now()
		var hashed time.Time
		up, err := store.UploadContext(ctx, dir, opts, func(phase string, _, total int64) {
			// The hashing pass's last call, the only one with its total.
			if phase == s3store.PhaseHashing && total >= 0 {
				hashed = time.Now()
			}
		})
		el := time.Since(t0)
		peak, alloc := stop()
		if err != nil {
			t.Fatalf("buildq upload: %v", err)
		}
		if up.Skipped || up.Key != buildqKey {
			t.Fatalf("buildq upload: skipped=%v key=%s, want an upload to %s", up.Skipped, up.Key, buildqKey)
		}
		st, err := mc.StatObject(ctx, shared.bucket, up.Key, minio.StatObjectOptions{})
		if err != nil {
			t.Fatalf("stat buildq's object: %v", err)
		}
		buildqSize, tarSize = st.Size, up.Size
		buildqSecs = append(buildqSecs, el.Seconds())
		buildqHeap = append(buildqHeap, float64(peak)/(1<<20))
		buildqAlloc = append(buildqAlloc, float64(alloc)/1e6)
		buildqHash = append(buildqHash, hashed.Sub(t0).Seconds())
		t.Logf("round %d buildq:   %6.2fs (hashing pass %.2fs; %d entries, tar %.1f MB, object %.1f MB, peak heap +%.1f MiB)",
			round, el.Seconds(), hashed.Sub(t0).Seconds(), up.Files, float64(up.Size)/1e6, float64(st.Size)/1e6, float64(peak)/(1<<20))
		remove(up.Key) // or the next round would find it and skip
	}

	runBaseline := func(round int) {
		archive := filepath.Join(work, "context.tar.gz")
		stop := p6SampleHeap()
		t0 := time.Now()
		var stderr bytes.Buffer
		tar := exec.CommandContext(ctx, "tar", "-cz", "-f", archive, "-C", dir, ".")
		tar.Stderr = &stderr
		if err := tar.Run(); err != nil {
			stop()
			t.Fatalf("tar -cz: %v: %s", err, stderr.String())
		}
		packed := time.Since(t0)
		info, err := mc.FPutObject(ctx, shared.bucket, baselineKey, archive, minio.PutObjectOptions{ContentType: "application/gzip"})
		el := time.Since(t0)
		peak, _ := stop()
		if err != nil {
			t.Fatalf("baseline upload: %v", err)
		}
		fi, err := os.Stat(archive)
		if err != nil {
			t.Fatal(err)
		}
		if info.Size != fi.Size() {
			t.Fatalf("baseline upload stored %d bytes of a %d-byte archive", info.Size, fi.Size())
		}
		baseSize = fi.Size()
		baseSecs = append(baseSecs, el.Seconds())
		baseHeap = append(baseHeap, float64(peak)/(1<<20))
		baseTar = append(baseTar, packed.Seconds())
		t.Logf("round %d baseline: %6.2fs (tar -cz %.2fs; object %.1f MB)", round, el.Seconds(), packed.Seconds(), float64(fi.Size())/1e6)
		remove(baselineKey)
		if err := os.Remove(archive); err != nil {
			t.Fatal(err)
		}
	}

	const rounds = 3
	for r := range rounds {
		if r%2 == 0 {
			runBuildq(r)
			runBaseline(r)
		} else {
			runBaseline(r)
			runBuildq(r)
		}
	}
	if profileOn {
		t.Logf("CPU profile of round 0's buildq run: %s", profilePath)
	}

	bq, base := p6Median(buildqSecs), p6Median(baseSecs)
	mb := float64(tarSize) / 1e6
	res := benchfmt.Result{
		ID:       "P6",
		Title:    "context pack + hash + upload of 200 MB",
		Baseline: "tar -cz + minio-go FPutObject, same files, same MinIO",
		Rows: []benchfmt.Row{
			benchfmt.Compared("wall time, median of 3", "s", bq, base),
			benchfmt.Compared("throughput (uncompressed tar bytes)", "MB/s", mb/bq, mb/base),
			benchfmt.Plain("buildq: hashing pass, median", "s", p6Median(buildqHash)),
			benchfmt.Plain("buildq: pack + upload pass, median", "s", p6Median(p6Sub(buildqSecs, buildqHash))),
			benchfmt.Plain("baseline: tar -cz, median", "s", p6Median(baseTar)),
			benchfmt.Plain("baseline: FPutObject, median", "s", p6Median(p6Sub(baseSecs, baseTar))),
			benchfmt.Plain("context: regular-file content", "MB", float64(contentBytes)/1e6),
			benchfmt.Plain("context: files", "files", float64(files)),
			benchfmt.Plain("context: uncompressed tar (buildq)", "MB", mb),
			benchfmt.Plain("uploaded object, buildq (gzip BestSpeed)", "MB", float64(buildqSize)/1e6),
			benchfmt.Plain("uploaded object, baseline (gzip -6)", "MB", float64(baseSize)/1e6),
			benchfmt.Plain("buildq peak heap growth, max of 3", "MiB", p6Max(buildqHeap)),
			benchfmt.Plain("buildq bytes allocated per run, median", "MB", p6Median(buildqAlloc)),
			benchfmt.Plain("baseline peak heap growth (upload only; tar and gzip are processes of their own), max of 3", "MiB", p6Max(baseHeap)),
		},
		Notes: []string{
			"buildq compresses at gzip.BestSpeed (a fixed level, for reproducible archives) and tar -cz at gzip's default level 6, " +
				"hence the different object sizes; buildq also reads the context twice (a hashing pass names the content-addressed key " +
				"and lets an existing context skip the upload, then a packing pass streams the upload) and never writes a temporary file.",
		},
	}
	if ratio := bq / base; ratio > 1.5 {
		res.Notes = append(res.Notes, fmt.Sprintf("buildq took %.2f× the baseline's time.", ratio))
	}
	res.Seconds = time.Since(began).Seconds()

	for _, row := range res.Rows {
		if row.Baseline != nil {
			t.Logf("P6 %-45s %10.2f %-5s baseline %10.2f ratio %.2f", row.Metric, row.Value, row.Unit, *row.Baseline, *row.Ratio)
		} else {
			t.Logf("P6 %-45s %10.2f %s", row.Metric, row.Value, row.Unit)
		}
	}
	for _, n := range res.Notes {
		t.Logf("P6 note: %s", n)
	}
	if path, err := benchfmt.Write(res); err != nil {
		t.Fatal(err)
	} else if path != "" {
		t.Logf("P6 written to %s", path)
	}
}

// generateP6Context writes a deterministic 200 MB context into dir: a
// Dockerfile and a .dockerignore, ~150 MB of incompressible data in six
// large files (vendored binaries, model weights, assets) and ~50 MB of
// source-like text in 2,000 small files across 40 directories. It returns
// the number of regular files and their total size.
func generateP6Context(t *testing.T, dir string) (int, int64) {
	t.Helper()
	src := rand.NewChaCha8([32]byte{'b', 'u', 'i', 'l', 'd', 'q', '-', 'p', '6'})
	rng := rand.New(src)
	var files int
	var total int64
	write := func(rel string, b []byte) {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		files++
		total += int64(len(b))
	}

	write("Dockerfile", []byte("FROM scratch\nCOPY . /app\nENTRYPOINT [\"/app/bin/server\"]\n"))
	// Patterns matching nothing that exists: the matcher runs on every
	// entry, as in a real project, and both sides still pack the same files.
	write(".dockerignore", []byte(".git\nnode_modules\n**/*.log\ntmp/\n"))

	const bigFiles, bigSize = 6, 25_000_000
	buf := make([]byte, bigSize)
	for i := range bigFiles {
		// ChaCha8's Read fills buf with random bytes: incompressible.
		_, _ = src.Read(buf)
		write(fmt.Sprintf("assets/blob-%d.bin", i), buf)
	}

	words := []string{"func", "return", "if", "err", "nil", "for", "range", "var", "type", "struct",
		"ctx", "context.Context", "string", "int64", "error", "fmt.Errorf", "package", "import", "const",
		"true", "false", ":=", "=", "==", "!=", "{", "}", "(", ")", "[]byte", "len", "make", "append",
		"request", "tenant", "digest", "bucket", "upload", "worker", "queue", "build", "image", "layer"}
	const textDirs, textFiles, textTotal = 40, 2_000, 50_000_000
	var line bytes.Buffer
	for i := range textFiles {
		// Sizes from 5 to 45 KB, averaging 25 KB.
		size := textTotal/textFiles - 20_000 + rng.IntN(40_001)
		line.Reset()
		for line.Len() < size {
			line.WriteString("\t")
			for n := 3 + rng.IntN(9); n > 0; n-- {
				line.WriteString(words[rng.IntN(len(words))])
				line.WriteByte(' ')
			}
			fmt.Fprintf(&line, "// %d\n", rng.IntN(100000))
		}
		write(fmt.Sprintf("src/pkg%02d/file%04d.go", i%textDirs, i), line.Bytes()[:size])
	}
	return files, total
}

// p6SampleHeap collects garbage, then samples runtime.MemStats.HeapInuse
// every 5 ms until the returned function is called; that function returns
// the peak's growth over the start and the bytes allocated meanwhile.
func p6SampleHeap() func() (peakGrowth, allocated uint64) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base, alloc0 := ms.HeapInuse, ms.TotalAlloc
	stop := make(chan struct{})
	out := make(chan [2]uint64)
	go func() {
		peak := base
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			peak = max(peak, m.HeapInuse)
			select {
			case <-stop:
				runtime.ReadMemStats(&m)
				out <- [2]uint64{max(peak, m.HeapInuse) - base, m.TotalAlloc - alloc0}
				return
			case <-tick.C:
			}
		}
	}()
	return func() (uint64, uint64) {
		close(stop)
		r := <-out
		return r[0], r[1]
	}
}

func p6Median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func p6Max(xs []float64) float64 {
	var m float64
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}

// p6Sub is a[i]-b[i] for every i.
func p6Sub(a, b []float64) []float64 {
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] - b[i]
	}
	return out
}
