package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/devstack"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/internal/units"
	"github.com/buildq/buildq/publisher"
)

// s3Flags say where contexts are uploaded. The defaults are those of
// `buildq dev`, so submitting against it needs no flag.
type s3Flags struct {
	endpoint  string
	region    string
	accessKey string
	secretKey string
}

func (f *s3Flags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&f.endpoint, "s3-endpoint", "http://127.0.0.1:9000", "S3 endpoint for build contexts, with scheme")
	fs.StringVar(&f.region, "s3-region", "us-east-1", "S3 region")
	fs.StringVar(&f.accessKey, "s3-access-key", devstack.DevAccessKey, "S3 access key (also AWS_ACCESS_KEY_ID)")
	fs.StringVar(&f.secretKey, "s3-secret-key", devstack.DevSecretKey, "S3 secret key (also AWS_SECRET_ACCESS_KEY)")
}

var s3Env = map[string]string{"s3-access-key": "AWS_ACCESS_KEY_ID", "s3-secret-key": "AWS_SECRET_ACCESS_KEY", "s3-region": "AWS_REGION"}

func mergeEnv(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

func newSubmitCmd() *cobra.Command {
	var (
		rf          requestFlags
		gf          gitFlags
		nf          natsFlags
		sf          s3Flags
		wait        bool
		waitTimeout time.Duration
		output      string
	)
	cmd := &cobra.Command{
		Use:   "submit (DIR | --git URL --ref REF)",
		Short: "Publish a build request: of a directory (packed and uploaded) or of a git commit",
		Long: `Pack DIR into a reproducible context (honouring .dockerignore), upload it to
S3 unless it is already there, and publish a build request.

With --git instead of DIR, nothing is uploaded: the worker resolves --ref to
a commit, fetches exactly that commit with the tenant's own git credentials
and packs --subpath the same way, so a build of a commit and a build of its
checked-out directory share one build key. --commit pins the commit (with
--ref it must be reachable from it). The build Pod never sees git.

Without --wait it prints the request id and returns. With --wait it streams
progress to stderr (for git: resolving, fetching with bytes and objects,
packing) and prints the result; with -o json stdout carries exactly one JSON
object, the result's data.

Against a running "buildq dev" no connection flag is needed.

Exit status: 0 succeeded (or submitted), 1 failed or canceled, 2 invalid input.`,
		Example: `  buildq submit ./examples/static-site --image 127.0.0.1:5000/demo/site --wait
  buildq submit . --image 127.0.0.1:5000/acme/api --build-arg VERSION=1.2 --wait -o json
  buildq submit --git https://github.com/acme/web.git --ref main --subpath app --wait`,
		Args: func(cmd *cobra.Command, args []string) error {
			if gf.url != "" {
				if len(args) > 0 {
					return usageErr("give DIR or --git, not both")
				}
				return nil
			}
			return exactArgs(1, "DIR")(cmd, args)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bindEnv(cmd, mergeEnv(natsEnv, s3Env)); err != nil {
				return err
			}
			if output != "text" && output != "json" {
				return usageErr("-o must be text or json, got %q", output)
			}
			if gf.url != "" {
				return runSubmitGit(cmd.Context(), cmd, &rf, &gf, &nf, wait, waitTimeout, output == "json")
			}
			if err := gf.unused(); err != nil {
				return err
			}
			return runSubmit(cmd.Context(), cmd, args[0], &rf, &nf, &sf, wait, waitTimeout, output == "json")
		},
	}
	rf.register(cmd.Flags())
	gf.register(cmd.Flags())
	nf.register(cmd.Flags())
	sf.register(cmd)
	cmd.Flags().BoolVar(&wait, "wait", false, "wait for the result, streaming progress to stderr")
	cmd.Flags().DurationVar(&waitTimeout, "wait-timeout", 0, "give up waiting after this long (default: wait until the result)")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json")
	return cmd
}

func runSubmit(ctx context.Context, cmd *cobra.Command, dir string, rf *requestFlags, nf *natsFlags, sf *s3Flags, wait bool, waitTimeout time.Duration, asJSON bool) error {
	stderr := cmd.ErrOrStderr()
	req, err := rf.request(dir)
	if err != nil {
		return err
	}
	// Check every flag before any upload: a placeholder digest stands in
	// for the real one.
	setSource(req, rf.bucket, "sha256:"+strings.Repeat("0", 64))
	if err := validate(req); err != nil {
		return err
	}
	store, err := s3store.New(s3store.Config{Endpoint: sf.endpoint, Region: sf.region, AccessKey: sf.accessKey, SecretKey: sf.secretKey, Bucket: rf.bucket})
	if err != nil {
		return usageErr("%v", err)
	}
	nc, pub, err := nf.publisher("buildq-submit")
	if err != nil {
		return err
	}
	defer nc.Close()

	bar := newProgress(stderr)
	up, err := store.ForTenant(req.Tenant).UploadContext(ctx, dir, contexttar.Options{Dockerfile: req.Dockerfile, MaxBytes: rf.maxContext}, bar.update)
	bar.done()
	switch {
	case errors.Is(err, contexttar.ErrTooLarge) || errors.Is(err, contexttar.ErrUnsafePath):
		return usageErr("context %s: %v", dir, err)
	case err != nil && s3store.IsTransient(err):
		return failed(fmt.Errorf("upload context to %s: %w — is `buildq dev` running? (or set --s3-endpoint)", sf.endpoint, err))
	case err != nil:
		return failed(fmt.Errorf("upload context to %s: %w", sf.endpoint, err))
	}
	if up.Skipped {
		fmt.Fprintf(stderr, "context %s already uploaded (%d files)\n", short(up.Digest), up.Files)
	} else {
		fmt.Fprintf(stderr, "uploaded context %s (%d files, %s)\n", short(up.Digest), up.Files, units.Bytes(up.Size))
	}
	setSource(req, up.Bucket, up.Digest)
	req.Source.S3.Key = up.Key
	return publishAndWait(ctx, cmd, nc, pub, req, wait, waitTimeout, asJSON)
}

// publishAndWait publishes req under a new request id and, with wait,
// streams its progress and prints its result.
func publishAndWait(ctx context.Context, cmd *cobra.Command, nc *nats.Conn, pub *publisher.Client, req *v1.Request, wait bool, waitTimeout time.Duration, asJSON bool) error {
	stderr := cmd.ErrOrStderr()
	req.RequestID = publisher.NewRequestID()

	// Subscribe to progress before publishing, so "queued" is not missed.
	var events chan v1.Event
	ectx, stopEvents := context.WithCancel(ctx)
	defer stopEvents()
	if wait {
		events = make(chan v1.Event, 64)
		go func() {
			_ = pub.Events(ectx, req.Tenant, req.Name, func(e v1.Event) {
				if e.RequestID == req.RequestID {
					select {
					case events <- e:
					default:
					}
				}
			})
		}()
		if err := nc.Flush(); err != nil {
			return failed(err)
		}
	}
	published := time.Now()
	if _, err := pub.Publish(ctx, req); err != nil {
		if errors.Is(err, v1.ErrInvalid) {
			return usageErr("%v", err)
		}
		return failed(err)
	}
	fmt.Fprintf(stderr, "submitted %s/%s as request %s\n", req.Tenant, req.Name, req.RequestID)
	if !wait {
		if asJSON {
			out := map[string]string{"requestId": req.RequestID, "tenant": req.Tenant, "name": req.Name}
			if req.ContextDigest != "" {
				out["contextDigest"] = req.ContextDigest
			}
			return writeJSON(cmd.OutOrStdout(), out)
		}
		fmt.Fprintln(cmd.OutOrStdout(), req.RequestID)
		return nil
	}

	wctx := ctx
	if waitTimeout > 0 {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, waitTimeout)
		defer cancel()
	}
	show := func(e v1.Event) {
		msg := e.Message
		if e.Platform != "" && !strings.HasPrefix(msg, e.Platform) {
			msg = e.Platform + ": " + msg
		}
		fmt.Fprintf(stderr, "%s  %-8s %s\n", e.Time.Local().Format("15:04:05"), phaseWord(e), msg)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	waited := make(chan struct{})
	go func() {
		defer wg.Done()
		for {
			select {
			case e := <-events:
				show(e)
				if e.Phase == v1.PhaseFinished {
					return
				}
			case <-waited:
				// The result is in; the last progress event was published
				// before it and may still be on its way.
				select {
				case e := <-events:
					show(e)
					if e.Phase == v1.PhaseFinished {
						return
					}
				case <-time.After(250 * time.Millisecond):
					return
				}
			}
		}
	}()
	res, err := pub.Wait(wctx, req.Tenant, req.Name, req.RequestID, published.Add(-time.Minute))
	close(waited)
	wg.Wait()
	stopEvents()
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return failed(fmt.Errorf("no result for request %s within %s; it is still queued or building (buildq status %s)", req.RequestID, waitTimeout, req.RequestID))
		}
		return failed(fmt.Errorf("wait for request %s: %w", req.RequestID, err))
	}
	return printResult(cmd.OutOrStdout(), res, asJSON)
}

// printResult prints a result and maps its status to the exit code.
func printResult(stdout io.Writer, res *v1.Result, asJSON bool) error {
	d := res.Data
	if asJSON {
		if err := writeJSON(stdout, d); err != nil {
			return err
		}
	} else {
		switch d.Status {
		case v1.StatusSucceeded:
			fmt.Fprintf(stdout, "succeeded (%s) %s\n  image  %s\n  digest %s\n", d.Origin, d.ImageRef, d.Image, d.Digest)
			printPlatforms(stdout, "  ", d.Platforms)
			if src := d.Source; src != nil && src.Commit != "" {
				fmt.Fprintf(stdout, "  source %s@%s (%s), context %s\n", src.GitURL, src.Commit, cmp.Or(src.Ref, "commit"), short(src.ContextDigest))
			}
			if d.Attestation != "" {
				// The signed provenance; buildq verify checks it.
				fmt.Fprintf(stdout, "  provenance %s\n", d.Attestation)
			}
			if d.SBOM != "" {
				fmt.Fprintf(stdout, "  sbom   %s\n", d.SBOM)
			}
			for _, p := range slices.Sorted(maps.Keys(d.SBOMs)) {
				fmt.Fprintf(stdout, "  sbom   %s %s\n", d.SBOMs[p], p)
			}
		default:
			fmt.Fprintf(stdout, "%s: %s: %s\n", d.Status, d.Reason, d.Message)
			if len(d.Platforms) > 0 {
				fmt.Fprintln(stdout, "  built before the failure:")
				printPlatforms(stdout, "  ", d.Platforms)
			}
			if d.LogTail != "" && d.LogTail != d.Message {
				fmt.Fprintf(stdout, "--- log tail ---\n%s\n", d.LogTail)
			}
		}
	}
	if d.Status != v1.StatusSucceeded {
		return &exitError{code: exitFailed, err: errors.New("")}
	}
	return nil
}

// phaseWord is the word a person reads for a progress event: what
// happened, not only the phase. The finished event's message starts with
// the status and the origin ("succeeded (cache): …", the worker's
// finishedMessage): a build (this request's, or one it joined) pushed;
// a cache hit built and pushed nothing.
func phaseWord(e v1.Event) string {
	switch e.Phase {
	case v1.PhaseJobCreated, v1.PhaseRunning:
		return "building"
	case v1.PhaseSource:
		return "git"
	case v1.PhaseWaiting:
		if strings.HasPrefix(e.Message, "retrying") || strings.HasPrefix(e.Message, "requeued") {
			return "retry"
		}
	case v1.PhaseFinished:
		switch {
		case strings.HasPrefix(e.Message, string(v1.StatusSucceeded)+" ("+string(v1.OriginCache)+")"):
			return "cached"
		case strings.HasPrefix(e.Message, string(v1.StatusSucceeded)):
			return "pushed"
		}
		return "finished"
	}
	return string(e.Phase)
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func short(digest string) string {
	d := strings.TrimPrefix(digest, "sha256:")
	if len(d) > 12 {
		d = d[:12]
	}
	return "sha256:" + d
}

// progress draws a one-line progress bar on a terminal and stays silent
// otherwise (logs and pipes get the summary line only).
type progress struct {
	w      io.Writer
	tty    bool
	last   time.Time
	drawn  bool
	phase  string
	mu     sync.Mutex
	closed bool
}

func newProgress(w io.Writer) *progress {
	f, ok := w.(*os.File)
	return &progress{w: w, tty: ok && term.IsTerminal(int(f.Fd()))}
}

func (p *progress) update(phase string, done, total int64) {
	if !p.tty {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || (time.Since(p.last) < 100*time.Millisecond && done < total && phase == p.phase) {
		return
	}
	p.last, p.phase, p.drawn = time.Now(), phase, true
	if total <= 0 {
		// Size not known yet (the first pass is what measures it).
		fmt.Fprintf(p.w, "\r%-9s %s \033[K", phase, units.Bytes(done))
		return
	}
	pct := int(done * 100 / total)
	const width = 30
	fill := pct * width / 100
	fmt.Fprintf(p.w, "\r%-9s [%s%s] %3d%% %s / %s ", phase, strings.Repeat("=", fill), strings.Repeat(" ", width-fill), pct, units.Bytes(done), units.Bytes(total))
}

func (p *progress) done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
	}
	p.closed = true
}

// printPlatforms lists an image index's platforms and their images'
// digests, in platform order.
func printPlatforms(out io.Writer, indent string, platforms map[string]string) {
	for _, p := range slices.Sorted(maps.Keys(platforms)) {
		fmt.Fprintf(out, "%s%-14s %s\n", indent, p, platforms[p])
	}
}
