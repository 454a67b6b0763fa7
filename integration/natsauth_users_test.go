//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
)

// natsUser is one connection of the test as a NATS user, with the
// server's asynchronous errors (permission violations) it received.
type natsUser struct {
	nc   *nats.Conn
	mu   sync.Mutex
	errs []error
}

func (s *suite) connectAs(t *testing.T, opts ...nats.Option) *natsUser {
	t.Helper()
	u := &natsUser{}
	nc, err := nats.Connect(s.natsURL, append(opts,
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			u.mu.Lock()
			u.errs = append(u.errs, err)
			u.mu.Unlock()
		}))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	u.nc = nc
	return u
}

func (u *natsUser) errors() []error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]error(nil), u.errs...)
}

// events subscribes to tenant/name's progress events (before the request
// is published: the subscription is on the server when this returns).
func (u *natsUser) events(t *testing.T, tenant, name string) <-chan v1.Event {
	t.Helper()
	ch := make(chan v1.Event, 64)
	sub, err := u.nc.Subscribe(v1.EventSubject(tenant, name), func(m *nats.Msg) {
		var e v1.Event
		if json.Unmarshal(m.Data, &e) == nil {
			select {
			case ch <- e:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := u.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return ch
}

// refused asserts that the server refused op ("Publish", "Subscription")
// on subject to this user.
func (u *natsUser) refused(t *testing.T, op, subject string) {
	t.Helper()
	u.refusedMatch(t, fmt.Sprintf("Permissions Violation for %s to %q", op, subject))
}

// refusedPrefix asserts a refusal of op on a subject that starts with prefix.
func (u *natsUser) refusedPrefix(t *testing.T, op, prefix string) {
	t.Helper()
	u.refusedMatch(t, fmt.Sprintf("Permissions Violation for %s to \"%s", op, prefix))
}

func (u *natsUser) refusedMatch(t *testing.T, want string) {
	t.Helper()
	_ = u.nc.Flush()
	var got []error
	eventuallyOK := func() bool {
		got = u.errors()
		for _, e := range got {
			if errors.Is(e, nats.ErrPermissionViolation) && strings.Contains(e.Error(), want) {
				return true
			}
		}
		return false
	}
	deadline := time.Now().Add(5 * time.Second)
	for !eventuallyOK() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s from the server; errors received: %v", want, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// subscribeRefused subscribes to subject, asserts the server's refusal
// and that nothing arrives.
func (u *natsUser) subscribeRefused(t *testing.T, subject string) {
	t.Helper()
	sub, err := u.nc.SubscribeSync(subject)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	u.refused(t, "Subscription", subject)
	if m, err := sub.NextMsg(300 * time.Millisecond); err == nil {
		t.Fatalf("received %s on a refused subscription", m.Subject)
	}
}

// requestRefused sends a request on subject, asserts the server's refusal
// and that no answer came.
func (u *natsUser) requestRefused(t *testing.T, subject, payload string) {
	t.Helper()
	inbox := u.nc.NewInbox()
	sub, err := u.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := u.nc.PublishRequest(subject, inbox, []byte(payload)); err != nil {
		t.Fatal(err)
	}
	u.refused(t, "Publish", subject)
	if m, err := sub.NextMsg(300 * time.Millisecond); err == nil {
		t.Fatalf("request on %s answered: %s", subject, m.Data)
	}
}

// jsRefusedWait is how long a JetStream call the server refuses is given
// to fail (nothing answers it: the refusal itself is asserted apart).
const jsRefusedWait = 500 * time.Millisecond

// request asks one of the tenant API subjects as u (default inbox) and
// decodes the answer.
func request(t *testing.T, u *natsUser, subject, payload string, reply any) {
	t.Helper()
	m, err := u.nc.Request(subject, []byte(payload), 20*time.Second)
	if err != nil {
		t.Fatalf("request on %s: %v", subject, err)
	}
	if err := json.Unmarshal(m.Data, reply); err != nil {
		t.Fatalf("reply on %s: %v: %s", subject, err, m.Data)
	}
}

// tenantRequest uploads a one-file context and returns an unpublished
// request of tenant/name for it.
func (s *suite) tenantRequest(t *testing.T, tenant, name, content string) *v1.Request {
	t.Helper()
	dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f.txt /f.txt\n", "f.txt": content})
	up, err := s.store.ForTenant(tenant).UploadContext(context.Background(), dir, contexttar.Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &v1.Request{Tenant: tenant, Name: name,
		Source:        v1.Source{S3: &v1.S3Source{Bucket: up.Bucket, Key: up.Key}},
		ContextDigest: up.Digest}
}

// runCLIEnv is runCLI with extra environment variables.
func runCLIEnv(t *testing.T, timeout time.Duration, env []string, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(shared.bin, "buildq"), args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		return out.String(), errOut.String(), ee.ExitCode()
	case err != nil:
		t.Fatalf("buildq %v: %v", args, err)
	}
	return out.String(), errOut.String(), 0
}
