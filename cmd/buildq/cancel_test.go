package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// fakeCancel answers acme's cancel service with rep and, once it has
// answered, publishes the canceled request's result.
func fakeCancel(t *testing.T, nc *nats.Conn, rep v1.CancelReply, publishResult bool) {
	t.Helper()
	sub, err := nc.Subscribe(v1.APICancelSubject("acme"), func(m *nats.Msg) {
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
		if publishResult {
			go func() {
				time.Sleep(200 * time.Millisecond)
				r := v1.NewResult("/test", v1.ResultData{RequestID: logsID, Tenant: "acme", Name: "web", Status: v1.StatusCanceled, Reason: v1.ReasonCanceled}, time.Now())
				b, _ := json.Marshal(r)
				_ = nc.Publish(v1.ResultSubject("acme", "web"), b)
			}()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

func TestCancelSaysTheResultFollows(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	fakeCancel(t, nc, v1.CancelReply{Key: hexKey64, Canceled: true, Requests: 1, Stopped: true, Message: "canceled 1 request(s) and stopped the build"}, false)
	code, out, errOut := cli(t, "cancel", logsID, "--tenant", "acme", "--nats-url", ns.URL())
	if code != 0 || strings.TrimSpace(out) != "canceled 1 request(s) and stopped the build (--wait prints the request's result)" {
		t.Fatalf("exit %d, out %q, err %q", code, out, errOut)
	}
}

func TestCancelWaitJSON(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	fakeCancel(t, nc, v1.CancelReply{Key: hexKey64, Canceled: true, Requests: 1, Stopped: true, Message: "canceled 1 request(s) and stopped the build"}, true)
	code, out, errOut := cli(t, "cancel", logsID, "--tenant", "acme", "--nats-url", ns.URL(), "--wait", "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d, out %q, err %q", code, out, errOut)
	}
	var got struct {
		v1.CancelReply
		Result *v1.ResultData `json:"result"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("%v: %q", err, out)
	}
	if !got.Canceled || !got.Stopped || got.Result == nil || got.Result.Status != v1.StatusCanceled || got.Result.RequestID != logsID {
		t.Fatalf("cancel -o json --wait: %s", out)
	}
}

func TestCancelWaitNeedsARequestID(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	fakeCancel(t, nc, v1.CancelReply{Key: hexKey64, Canceled: true, Requests: 2, Message: "canceled 2 request(s)"}, false)
	code, _, errOut := cli(t, "cancel", hexKey64, "--tenant", "acme", "--nats-url", ns.URL(), "--wait")
	if code != exitInvalid || !strings.Contains(errOut, "--wait needs a request id") {
		t.Fatalf("exit %d, err %q", code, errOut)
	}
}

const hexKey64 = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
