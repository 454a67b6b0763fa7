// Package devstack runs the infrastructure buildq needs (NATS with
// JetStream, an S3-compatible object store and an OCI registry) inside the
// current process, so that `buildq dev` works on a laptop or in CI without
// Docker, MinIO or a registry container.
//
// It starts the infrastructure only; the buildq worker is wired on top by the
// caller using the endpoints published in Stack.
//
// Everything persists under Options.DataDir: JetStream streams in nats/, S3
// objects in s3/ (a bbolt file) and registry blobs and manifests in
// registry/. Starting again on the same DataDir brings the previous state
// back.
package devstack

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// Fixed dev credentials for the embedded S3 server. gofakes3 does not verify
// signatures, so any key would work; fixed values keep the printed
// configuration stable between runs and let users copy it into other tools.
const (
	DevAccessKey = "buildq-dev"
	DevSecretKey = "buildq-dev-secret"
	// DevRegion is the region S3 clients should use against the embedded
	// server. gofakes3 ignores it, but clients that sign requests need one.
	DevRegion = "us-east-1"
)

// Default addresses. They are fixed (not random) so that a developer can
// point other tools at a running `buildq dev` without reading its output.
const (
	DefaultNATSAddr     = "127.0.0.1:4222"
	DefaultS3Addr       = "127.0.0.1:9000"
	DefaultRegistryAddr = "127.0.0.1:5000"
	DefaultBucket       = "buildq"
)

// Flag names quoted in error messages, so a user who hits a busy port knows
// what to change. They must match the flags `buildq dev` defines.
const (
	natsFlag     = "--nats-addr"
	s3Flag       = "--s3-addr"
	registryFlag = "--registry-addr"
)

// readyTimeout bounds how long Start waits for each service to answer once
// it is listening. Everything is in-process, so a healthy service answers in
// milliseconds; the bound only matters when something is badly wrong.
const readyTimeout = 15 * time.Second

// shutdownTimeout bounds how long Close lets in-flight HTTP requests finish
// before it drops their connections.
const shutdownTimeout = 5 * time.Second

// Options configures Start.
type Options struct {
	// DataDir holds everything (nats/, s3/, registry/); created if missing.
	// Required (the caller passes a temp dir when the user gives none).
	DataDir string
	// NATSAddr is the NATS client address. Default "127.0.0.1:4222"; port 0
	// ("127.0.0.1:0") picks a free port.
	NATSAddr string
	// S3Addr is the S3 HTTP address. Default "127.0.0.1:9000"; port 0 picks a
	// free port.
	S3Addr string
	// RegistryAddr is the registry HTTP address. Default "127.0.0.1:5000";
	// port 0 picks a free port.
	RegistryAddr string
	// UnsafeListen lets S3Addr and RegistryAddr be addresses other than
	// loopback, so that a cluster's Pods (kind, k3d, a VM) can reach them.
	// Neither has any authentication: whoever reaches them can read and
	// replace every context and image. NATS stays on loopback.
	UnsafeListen bool
	// Bucket is created at start if missing. Default "buildq".
	Bucket string
	// Logger receives the services' own logs at debug level. Default no-op.
	// The registry logs through the process-wide logrus standard logger,
	// which is therefore routed here while any Stack runs (see routeLogrus);
	// nothing is ever printed to stdout or stderr.
	Logger *zap.Logger
}

// Stack is the running set of services.
type Stack struct {
	// NATSURL is the client URL, e.g. nats://127.0.0.1:4222.
	NATSURL string
	// S3Endpoint is the S3 base URL, e.g. http://127.0.0.1:9000 (path-style,
	// plain HTTP).
	S3Endpoint string
	// S3AccessKey and S3SecretKey are DevAccessKey and DevSecretKey.
	S3AccessKey string
	S3SecretKey string
	// Bucket exists when Start returns.
	Bucket string
	// RegistryAddr is host:port of the plain-HTTP registry, e.g.
	// 127.0.0.1:5000. Image references use it as their registry part.
	RegistryAddr string
	// DataDir is the directory everything persists under.
	DataDir string

	log *zap.Logger

	// closers run in reverse order of start; each stops one service.
	closers []namedCloser

	closeOnce sync.Once
	closeErr  error
}

type namedCloser struct {
	name  string
	close func() error
}

// AddrInUseError reports that a service could not listen because its address
// is taken — most often by another `buildq dev`. It unwraps to
// syscall.EADDRINUSE so callers can test for it with errors.Is.
type AddrInUseError struct {
	Service string // "nats", "s3" or "registry"
	Addr    string // the address that was asked for
	Flag    string // the flag that changes it
	Err     error  // the underlying listen error
}

func (e *AddrInUseError) Error() string {
	return fmt.Sprintf("%s: listen %s: address already in use — another buildq dev running? use %s",
		e.Service, e.Addr, e.Flag)
}

// Unwrap returns the listen error, which wraps syscall.EADDRINUSE.
func (e *AddrInUseError) Unwrap() error { return e.Err }

// Start creates the data directories, starts NATS, S3 and the registry and
// waits until each answers. If anything fails, what already started is
// stopped again before Start returns the error, so a failed Start leaves no
// listener and no lock behind.
//
// ctx bounds startup only; stop the stack with Close.
func Start(ctx context.Context, opts Options) (_ *Stack, err error) {
	if opts.DataDir == "" {
		return nil, errors.New("devstack: DataDir is required")
	}
	if opts.Bucket == "" {
		opts.Bucket = DefaultBucket
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}

	natsAddr, err := loopbackAddr("nats", opts.NATSAddr, DefaultNATSAddr, natsFlag, false)
	if err != nil {
		return nil, err
	}
	s3Addr, err := loopbackAddr("s3", opts.S3Addr, DefaultS3Addr, s3Flag, opts.UnsafeListen)
	if err != nil {
		return nil, err
	}
	regAddr, err := loopbackAddr("registry", opts.RegistryAddr, DefaultRegistryAddr, registryFlag, opts.UnsafeListen)
	if err != nil {
		return nil, err
	}

	dataDir, err := filepath.Abs(opts.DataDir)
	if err != nil {
		return nil, fmt.Errorf("devstack: data dir: %w", err)
	}
	dirs := map[string]string{
		"nats":     filepath.Join(dataDir, "nats"),
		"s3":       filepath.Join(dataDir, "s3"),
		"registry": filepath.Join(dataDir, "registry"),
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("devstack: create data dir: %w", err)
		}
	}

	s := &Stack{
		S3AccessKey: DevAccessKey,
		S3SecretKey: DevSecretKey,
		Bucket:      opts.Bucket,
		DataDir:     dataDir,
		log:         log,
	}
	defer func() {
		if err != nil {
			// Stop whatever came up; the start error is the one worth
			// reporting, so a cleanup error is only logged.
			if cerr := s.Close(); cerr != nil {
				log.Debug("devstack: cleanup after failed start", zap.Error(cerr))
			}
		}
	}()

	// S3 goes first: opening its bbolt file takes an exclusive lock, which
	// doubles as the lock on the whole DataDir. A second `buildq dev` on the
	// same directory therefore fails here, before NATS could open the same
	// JetStream store twice.
	s3srv, err := openS3(dirs["s3"], opts.Bucket, log)
	if err != nil {
		return nil, err
	}
	s.addCloser("s3 store", s3srv.closeStore)

	// Take both HTTP ports before the slower NATS and registry setup, so a
	// busy port is reported at once.
	s3ln, err := listen("s3", s3Addr, s3Flag)
	if err != nil {
		return nil, err
	}
	regLn, err := listen("registry", regAddr, registryFlag)
	if err != nil {
		_ = s3ln.Close()
		return nil, err
	}

	s3srv.serve(s3ln)
	s.addCloser("s3", s3srv.shutdown)
	s.S3Endpoint = "http://" + s3ln.Addr().String()

	reg, err := newRegistry(dirs["registry"], log)
	if err != nil {
		_ = regLn.Close()
		return nil, err
	}
	reg.serve(regLn)
	s.addCloser("registry", reg.shutdown)
	s.RegistryAddr = regLn.Addr().String()

	ns, err := startNATS(dirs["nats"], natsAddr, log)
	if err != nil {
		return nil, err
	}
	s.addCloser("nats", ns.shutdown)
	s.NATSURL = ns.url

	rctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	if err := ns.waitReady(rctx); err != nil {
		return nil, err
	}
	if err := waitHTTP(rctx, "s3", s.S3Endpoint+"/"); err != nil {
		return nil, err
	}
	if err := waitHTTP(rctx, "registry", "http://"+s.RegistryAddr+"/v2/"); err != nil {
		return nil, err
	}

	log.Info("devstack: started",
		zap.String("data_dir", dataDir),
		zap.String("nats", s.NATSURL),
		zap.String("s3", s.S3Endpoint),
		zap.String("bucket", s.Bucket),
		zap.String("registry", s.RegistryAddr))
	return s, nil
}

func (s *Stack) addCloser(name string, f func() error) {
	s.closers = append(s.closers, namedCloser{name: name, close: f})
}

// Close stops everything (registry HTTP server, S3 server and store, NATS
// Shutdown + WaitForShutdown) in reverse start order and returns the first
// error. It is safe to call twice; later calls return the first call's
// result.
func (s *Stack) Close() error {
	s.closeOnce.Do(func() {
		for i := len(s.closers) - 1; i >= 0; i-- {
			c := s.closers[i]
			if err := c.close(); err != nil {
				s.log.Debug("devstack: stop", zap.String("service", c.name), zap.Error(err))
				if s.closeErr == nil {
					s.closeErr = fmt.Errorf("%s: %w", c.name, err)
				}
			}
		}
		s.closers = nil
	})
	return s.closeErr
}

// loopbackAddr applies the default and refuses anything but a loopback
// address unless unsafe is set: the dev stack has no authentication at all
// (fixed S3 keys that are not even checked, an open registry and NATS), so
// exposing it on a network interface would hand the machine's builds to
// anyone on that network.
func loopbackAddr(service, addr, def, flag string, unsafe bool) (string, error) {
	if addr == "" {
		addr = def
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("%s: bad address %q: %w (use %s host:port)", service, addr, err, flag)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		return "", fmt.Errorf("%s: bad port in %q (use %s host:port)", service, addr, flag)
	}
	switch host {
	case "", "localhost":
		host = "127.0.0.1"
	default:
		ip := net.ParseIP(host)
		switch {
		case ip == nil:
			return "", fmt.Errorf("%s: address %q: the host must be an IP address (use %s IP:PORT)", service, addr, flag)
		case ip.IsLoopback():
		case !unsafe:
			hint := ""
			if service != "nats" {
				hint = ", or add --unsafe-listen to let a cluster's Pods reach it, knowing that anyone who reaches it can read and replace every context and image"
			}
			return "", fmt.Errorf("%s: address %q is not a loopback address; buildq dev has no authentication and only listens on 127.0.0.1 (use %s 127.0.0.1:PORT%s)",
				service, addr, flag, hint)
		}
	}
	return net.JoinHostPort(host, port), nil
}

// listen opens a TCP listener and turns "address already in use" into an
// AddrInUseError that tells the user what to do.
func listen(service, addr, flag string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			return nil, &AddrInUseError{Service: service, Addr: addr, Flag: flag, Err: err}
		}
		return nil, fmt.Errorf("%s: %w (use %s)", service, err, flag)
	}
	return ln, nil
}

// waitHTTP polls url until it answers 200 OK: for S3 that is ListBuckets
// (GET /), for the registry the API version check (GET /v2/).
func waitHTTP(ctx context.Context, service, url string) error {
	// A private transport without keep-alives leaves no idle connection to
	// the server behind, and never goes through an HTTP proxy.
	client := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{DisableKeepAlives: true},
	}
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("%s: %w", service, err)
		}
		resp, err := client.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not ready: %w", service, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
