package worker

// Handler (handle.go, process.go): bad input is refused with one
// failed/InvalidRequest result, addressed to the subject's tenant and the
// request id its producer waits on, then terminated: no Job, no
// redelivery (docs/design.md §2 step 2).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// badRequest is one malformed request, published raw: the publisher SDK
// would refuse most of them, a hostile or buggy producer would not.
type badRequest struct {
	name string
	// mutate spoils an otherwise valid request (ignored when raw is set).
	mutate func(r *v1.Request)
	// raw is the whole body, for input that is not a Request at all.
	raw func(id string) []byte
	// subject defaults to buildq.requests.acme.
	subject string
	// want are substrings the result's message must hold: the field and
	// what is wrong with it.
	want []string
	// wantName is the result's name ("" means "web", the base request's).
	wantName string
}

// validBase is a valid request as it would travel, but for the spoils.
func validBase(id string) *v1.Request {
	d := hex64("validation")
	return &v1.Request{
		APIVersion: v1.APIVersion, RequestID: id, Tenant: "acme", Name: "web",
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/acme/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
	}
}

func validJSON(id string) []byte {
	b, err := json.Marshal(validBase(id))
	if err != nil {
		panic(err)
	}
	return b
}

func manyArgs(n int) map[string]string {
	m := map[string]string{}
	for i := range n {
		m[fmt.Sprintf("ARG_%d", i)] = "x"
	}
	return m
}

func manyTags(n int) []string {
	var t []string
	for i := range n {
		t = append(t, fmt.Sprintf("t%d", i))
	}
	return t
}

var gitSource = &v1.GitSource{URL: "https://git.example.com/acme/web.git", Commit: strings.Repeat("a", 40)}

var badRequests = []badRequest{
	// Image references: shell metacharacters never reach a kaniko argument.
	{name: "image with a semicolon", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/web;rm -rf /" }, want: []string{"image", "not a valid repository"}},
	{name: "image with a space", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/web app" }, want: []string{"image", "not a valid repository"}},
	{name: "image with command substitution", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/$(id)" }, want: []string{"image", "not a valid repository"}},
	{name: "image with backticks", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/`id`" }, want: []string{"image", "not a valid repository"}},
	{name: "image of 300 characters", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/" + strings.Repeat("a", 300) }, want: []string{"image", "longer than 255"}},
	{name: "image with a tag", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/web:latest" }, want: []string{"image", "holds a tag"}},
	{name: "image with a digest", mutate: func(r *v1.Request) { r.Image = "registry.test:5000/acme/web@" + digestOf("x") }, want: []string{"image", "holds a digest"}},

	// Tenant and name become subject tokens and label values.
	{name: "name of 300 characters", mutate: func(r *v1.Request) { r.Name = strings.Repeat("a", 300) }, want: []string{"name", "300 characters, more than 63"}, wantName: "_invalid"},
	{name: "tenant of 300 characters", mutate: func(r *v1.Request) { r.Tenant = strings.Repeat("a", 300) }, want: []string{"tenant", "300 characters, more than 63"}},
	{name: "tenant with a dot", mutate: func(r *v1.Request) { r.Tenant = "ac.me" }, want: []string{"tenant", "DNS-1123"}},
	{name: "tenant is a star wildcard", mutate: func(r *v1.Request) { r.Tenant = "*" }, want: []string{"tenant", "DNS-1123"}},
	{name: "tenant is a tail wildcard", mutate: func(r *v1.Request) { r.Tenant = ">" }, want: []string{"tenant", "DNS-1123"}},
	{name: "name with a dot", mutate: func(r *v1.Request) { r.Name = "web.prod" }, want: []string{"name", "DNS-1123"}, wantName: "_invalid"},
	{name: "name is a star wildcard", mutate: func(r *v1.Request) { r.Name = "*" }, want: []string{"name", "DNS-1123"}, wantName: "_invalid"},
	{name: "name is a tail wildcard", mutate: func(r *v1.Request) { r.Name = ">" }, want: []string{"name", "DNS-1123"}, wantName: "_invalid"},
	{name: "name in upper case", mutate: func(r *v1.Request) { r.Name = "Web" }, want: []string{"name", "DNS-1123"}, wantName: "_invalid"},
	{name: "tenant other than the subject's", mutate: func(r *v1.Request) { r.Tenant = "other" }, want: []string{"tenant", `"other" does not match the subject buildq.requests.acme`}},
	{name: "subject with an extra token", subject: "buildq.requests.acme.web", want: []string{"tenant", "does not match the subject buildq.requests.acme.web"}},

	// Build arguments end up in the Job spec: bounded in count and size.
	{name: "build arg value over 4096 bytes", mutate: func(r *v1.Request) { r.BuildArgs = map[string]string{"BIG": strings.Repeat("x", 4097)} }, want: []string{"buildArgs.BIG", "4097 bytes, more than 4096"}},
	{name: "65 build args", mutate: func(r *v1.Request) { r.BuildArgs = manyArgs(65) }, want: []string{"buildArgs", "65 entries, more than 64"}},
	{name: "build args over 32 KiB in total", mutate: func(r *v1.Request) {
		r.BuildArgs = map[string]string{}
		for i := range 9 {
			r.BuildArgs[fmt.Sprintf("A%d", i)] = strings.Repeat("y", 4000)
		}
	}, want: []string{"buildArgs", "more than 32768"}},
	{name: "build arg name with command substitution", mutate: func(r *v1.Request) { r.BuildArgs = map[string]string{"$(id)": "1"} }, want: []string{"buildArgs", "not a valid argument name"}},
	{name: "build arg value with a NUL byte", mutate: func(r *v1.Request) { r.BuildArgs = map[string]string{"V": "a\x00b"} }, want: []string{"buildArgs.V", "NUL"}},

	// Platforms.
	{name: "unknown architecture", mutate: func(r *v1.Request) { r.Platforms = []string{"linux/sparc"} }, want: []string{"platforms", `"linux/sparc" is not a known platform`}},
	{name: "unknown operating system", mutate: func(r *v1.Request) { r.Platforms = []string{"plan9/amd64"} }, want: []string{"platforms", "not a known platform"}},
	{name: "platform listed twice", mutate: func(r *v1.Request) { r.Platforms = []string{"linux/amd64", "linux/amd64"} }, want: []string{"platforms", "listed twice"}},

	// The context.
	{name: "context digest not hex", mutate: func(r *v1.Request) { r.ContextDigest = "sha256:xyz" }, want: []string{"contextDigest", "sha256:<64 hex digits>"}},
	{name: "context digest of another algorithm", mutate: func(r *v1.Request) { r.ContextDigest = "md5:" + strings.Repeat("a", 32) }, want: []string{"contextDigest", "sha256:<64 hex digits>"}},
	{name: "context digest missing", mutate: func(r *v1.Request) { r.ContextDigest = "" }, want: []string{"contextDigest", "sha256:<64 hex digits>"}},
	{name: "absolute S3 key", mutate: func(r *v1.Request) { r.Source.S3.Key = "/etc/passwd" }, want: []string{"source.s3.key", "must be a relative path"}},
	{name: "S3 key climbing out with dot-dot", mutate: func(r *v1.Request) { r.Source.S3.Key = "../other-tenant/ctx.tar.gz" }, want: []string{"source.s3.key", "without '..'"}},
	{name: "S3 key with dot-dot inside", mutate: func(r *v1.Request) { r.Source.S3.Key = "contexts/../../secrets.tar.gz" }, want: []string{"source.s3.key", "without '..'"}},
	{name: "invalid bucket", mutate: func(r *v1.Request) { r.Source.S3.Bucket = "Bad_Bucket" }, want: []string{"source.s3.bucket", "not a valid bucket name"}},
	{name: "absolute Dockerfile path", mutate: func(r *v1.Request) { r.Dockerfile = "/etc/Dockerfile" }, want: []string{"dockerfile", "must be a relative path"}},
	{name: "Dockerfile path climbing out", mutate: func(r *v1.Request) { r.Dockerfile = "../Dockerfile" }, want: []string{"dockerfile", "without '..'"}},
	{name: "Dockerfile path with dot-dot inside", mutate: func(r *v1.Request) { r.Dockerfile = "docker/../../Dockerfile" }, want: []string{"dockerfile", "without '..'"}},
	{name: "git source with a short commit", mutate: func(r *v1.Request) {
		r.Source = v1.Source{Git: &v1.GitSource{URL: gitSource.URL, Commit: "abc1234"}}
		r.ContextDigest = ""
	}, want: []string{"source.git.commit", "full commit hash"}},
	{name: "git source with a file URL", mutate: func(r *v1.Request) {
		r.Source = v1.Source{Git: &v1.GitSource{URL: "file:///etc", Commit: gitSource.Commit}}
		r.ContextDigest = ""
	}, want: []string{"source.git.url", "https://, http:// or ssh://"}},
	{name: "git sub-path climbing out", mutate: func(r *v1.Request) {
		r.Source = v1.Source{Git: &v1.GitSource{URL: gitSource.URL, Commit: gitSource.Commit, SubPath: "../.."}}
		r.ContextDigest = ""
	}, want: []string{"source.git.subPath", "without '..'"}},
	{name: "both sources", mutate: func(r *v1.Request) { r.Source.Git = gitSource }, want: []string{"source", "exactly one of s3 or git"}},
	{name: "no source", mutate: func(r *v1.Request) { r.Source = v1.Source{} }, want: []string{"source", "is required"}},

	// Tags.
	{name: "tag with a semicolon", mutate: func(r *v1.Request) { r.Tags = []string{"v1;rm"} }, want: []string{"tags", `"v1;rm" is not a valid tag`}},
	{name: "tag with a space", mutate: func(r *v1.Request) { r.Tags = []string{"v 1"} }, want: []string{"tags", "not a valid tag"}},
	{name: "tag starting with a dash", mutate: func(r *v1.Request) { r.Tags = []string{"-latest"} }, want: []string{"tags", "not a valid tag"}},
	{name: "17 tags", mutate: func(r *v1.Request) { r.Tags = manyTags(17) }, want: []string{"tags", "17 entries, more than 16"}},

	// Timeouts.
	{name: "timeout below the minimum", mutate: func(r *v1.Request) { r.Timeout = v1.Duration{Duration: time.Second} }, want: []string{"timeout", "must be between 10s and 24h0m0s"}},
	{name: "timeout above the maximum", mutate: func(r *v1.Request) { r.Timeout = v1.Duration{Duration: 48 * time.Hour} }, want: []string{"timeout", "must be between"}},
	{name: "negative timeout", mutate: func(r *v1.Request) { r.Timeout = v1.Duration{Duration: -5 * time.Minute} }, want: []string{"timeout", "must be between"}},
	{name: "timeout that is not a duration", raw: func(id string) []byte {
		return replaceJSON(validJSON(id), `"name":"web"`, `"name":"web","timeout":"forever"`)
	}, want: []string{"invalid duration"}},
	{name: "timeout as a number", raw: func(id string) []byte { return replaceJSON(validJSON(id), `"name":"web"`, `"name":"web","timeout":30`) }, want: []string{"duration must be a string"}},

	// Other fields.
	{name: "target with a semicolon", mutate: func(r *v1.Request) { r.Target = "stage;rm" }, want: []string{"target", "not a valid stage name"}},
	{name: "label key with a space", mutate: func(r *v1.Request) { r.Labels = map[string]string{"bad key": "v"} }, want: []string{"labels", "not a valid label key"}},
	{name: "request id with a slash", mutate: func(r *v1.Request) { r.RequestID += "/x" }, want: []string{"requestId", "may hold only"}},

	// Versions and encodings.
	{name: "wrong apiVersion", mutate: func(r *v1.Request) { r.APIVersion = "buildq.dev/v2" }, want: []string{"apiVersion", `must be "buildq.dev/v1", got "buildq.dev/v2"`}},
	{name: "missing apiVersion", mutate: func(r *v1.Request) { r.APIVersion = "" }, want: []string{"apiVersion", `got ""`}},
	{name: "unknown field", raw: func(id string) []byte { return replaceJSON(validJSON(id), `"name":"web"`, `"name":"web","sauce":1`) }, want: []string{`unknown field "sauce"`}},
	{name: "misspelt field", raw: func(id string) []byte {
		return replaceJSON(validJSON(id), `"name":"web"`, `"name":"web","buildArg":{"A":"1"}`)
	}, want: []string{`unknown field "buildArg"`}},
	{name: "not JSON at all", raw: func(string) []byte { return []byte("{nope") }, want: []string{"invalid character"}, wantName: "_invalid"},
	{name: "plain text", raw: func(string) []byte { return []byte("build my image please") }, want: []string{"invalid character"}, wantName: "_invalid"},
	{name: "empty body", raw: func(string) []byte { return nil }, want: []string{"the request body is empty"}, wantName: "_invalid"},
	{name: "whitespace body", raw: func(string) []byte { return []byte(" \n\t ") }, want: []string{"the request body is empty"}, wantName: "_invalid"},
	{name: "JSON array", raw: func(string) []byte { return []byte(`[1,2]`) }, want: []string{"cannot unmarshal array"}, wantName: "_invalid"},
	{name: "JSON null", raw: func(string) []byte { return []byte(`null`) }, want: []string{"apiVersion", "requestId: is required"}, wantName: "_invalid"},
	{name: "trailing data", raw: func(id string) []byte { return append(validJSON(id), []byte(`{"again":true}`)...) }, want: []string{"trailing data"}, wantName: "_invalid"},
	{name: "request over 64 KiB", raw: func(id string) []byte {
		return replaceJSON(validJSON(id), `"name":"web"`, `"name":"web","target":"`+strings.Repeat("t", v1.MaxRequestBytes)+`"`)
	}, want: []string{"more than the 65536 allowed"}},
}

func replaceJSON(b []byte, old, repl string) []byte {
	if !bytes.Contains(b, []byte(old)) {
		panic("replaceJSON: " + old + " not in " + string(b))
	}
	return bytes.Replace(b, []byte(old), []byte(repl), 1)
}

// Origin: input hardening of kaniko Jobs (dfb1424).
func TestInvalidRequestsFailWithoutJobs(t *testing.T) {
	t.Parallel()
	if n := len(badRequests); n < 25 {
		t.Fatalf("only %d bad requests", n)
	}
	// Every case spoils a request that is valid as it stands.
	if _, err := v1.DecodeRequest(validJSON("base")); err != nil {
		t.Fatalf("the base request is invalid: %v", err)
	}
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	ids := map[string]badRequest{}
	for i, c := range badRequests {
		id := fmt.Sprintf("bad-%02d", i)
		var body []byte
		switch {
		case c.raw != nil:
			body = c.raw(id)
		default:
			r := validBase(id)
			if c.mutate != nil {
				c.mutate(r)
			}
			var err error
			if body, err = json.Marshal(r); err != nil {
				t.Fatal(err)
			}
			if r.RequestID != id {
				// The result of a request with an unusable id is
				// addressed by its Nats-Msg-Id; here the id is usable.
				id = r.RequestID
			}
		}
		subject := c.subject
		if subject == "" {
			subject = v1.RequestSubject("acme")
		}
		m := nats.NewMsg(subject)
		m.Header.Set(v1.MsgIDHeader, id)
		m.Data = body
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatalf("%s: publish: %v", c.name, err)
		}
		ids[id] = c
	}

	results.waitFor(t, len(badRequests), 30*time.Second)
	eventually(t, 10*time.Second, "every request terminated", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	// Give a duplicate result time to show up before counting.
	time.Sleep(300 * time.Millisecond)
	got := map[string][]v1.Result{}
	for _, r := range results.snapshot() {
		got[r.ID] = append(got[r.ID], r)
	}
	for id, c := range ids {
		t.Run(c.name, func(t *testing.T) {
			rs := got[id]
			if len(rs) != 1 {
				t.Fatalf("%d results for %s, want exactly 1: %s", len(rs), id, mustJSON(t, rs))
			}
			r := rs[0]
			if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || r.Type != "dev.buildq.build.failed.v1" {
				t.Errorf("status %q reason %q type %q, want failed/InvalidRequest", r.Data.Status, r.Data.Reason, r.Type)
			}
			for _, w := range c.want {
				if !strings.Contains(r.Data.Message, w) {
					t.Errorf("message %q does not mention %q", r.Data.Message, w)
				}
			}
			if len(r.Data.Message) > 2048 {
				t.Errorf("message is %d bytes: bad input must not be echoed back in full", len(r.Data.Message))
			}
			// Addressed by the subject's tenant, never by a bad token.
			wantName := c.wantName
			if wantName == "" {
				wantName = "web"
			}
			if r.Data.Tenant != "acme" || r.Data.Name != wantName || r.Subject != "acme/"+wantName {
				t.Errorf("addressed to %q/%q (subject %q), want acme/%s", r.Data.Tenant, r.Data.Name, r.Subject, wantName)
			}
			if r.Data.Attempts != 1 {
				t.Errorf("attempts %d: bad input is not redelivered", r.Data.Attempts)
			}
		})
	}
	if len(got) != len(ids) {
		t.Errorf("results for %d request ids, want %d", len(got), len(ids))
	}
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Errorf("%d redeliveries of bad input", redelivered)
	}
	if c := e.creates.total(); c != 0 {
		t.Errorf("%d jobs created for bad input", c)
	}
	if jobs, err := e.kube.BatchV1().Jobs(testNamespace).List(context.Background(), listAll); err != nil || len(jobs.Items) != 0 {
		t.Errorf("jobs in the cluster: %v %v", jobs, err)
	}
}

// Origin: the build pipeline spine (0bdb2cd).
func TestInvalidRequestIsTerminatedWithoutJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	cases := []struct {
		name    string
		subject string
		msgID   string
		body    string
		wantID  string
	}{
		{"not json", "buildq.requests.acme", "bad-1", "{nope", "bad-1"},
		{"unknown field", "buildq.requests.acme", "", `{"apiVersion":"buildq.dev/v1","requestId":"bad-2","tenant":"acme","name":"web","sauce":1}`, "bad-2"},
		{"bad name", "buildq.requests.acme", "", `{"apiVersion":"buildq.dev/v1","requestId":"bad-3","tenant":"acme","name":"Web.*","source":{"s3":{"bucket":"buildq","key":"k"}},"contextDigest":"sha256:` + hex64("x") + `"}`, "bad-3"},
	}
	for _, c := range cases {
		m := nats.NewMsg(c.subject)
		if c.msgID != "" {
			m.Header.Set(v1.MsgIDHeader, c.msgID)
		}
		m.Data = []byte(c.body)
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]v1.Result{}
	for _, r := range results.waitFor(t, len(cases), 10*time.Second) {
		got[r.ID] = r
	}
	for _, c := range cases {
		r := got[c.wantID]
		if r.ID != c.wantID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || r.Data.Message == "" {
			t.Errorf("%s: result %s", c.name, mustJSON(t, r))
		}
	}
	eventually(t, 5*time.Second, "requests terminated", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	if c := e.creates.total(); c != 0 {
		t.Errorf("%d jobs created for bad input", c)
	}
}

// TestRefusalCarriesTheBodysRequestID: a refused request is answered under
// the request id its producer waits on, whatever Nats-Msg-Id form it used
// (the SDK's <tenant>/<id>/<nonce>, <tenant>/<id>, bare); a header that
// names another id than the body's is answered under the header's (what
// JetStream deduped the message on). Issue 23: the SDK's form was answered
// as "<id>/<nonce>", so publisher.Wait never got the refusal.
//
// Origin: issue 23 (98418f0).
func TestRefusalCarriesTheBodysRequestID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// The SDK's own publish: valid for the client, refused by the worker
	// (its context is outside the tenant's prefix).
	t.Run("SDK form, publisher.Wait", func(t *testing.T) {
		r := request("refused-sdk")
		r.Name = "sdk"
		r.Source.S3.Key = "elsewhere/" + r.ContextDigest[7:] + ".tar.gz"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		got, err := e.pub.Wait(ctx, "acme", "sdk", r.RequestID, time.Time{})
		if err != nil {
			t.Fatalf("publisher.Wait for a refused request: %v", err)
		}
		if got.ID != r.RequestID || got.Data.RequestID != r.RequestID || got.Data.Reason != v1.ReasonInvalidRequest {
			t.Fatalf("result %s, want InvalidRequest for %s", mustJSON(t, got), r.RequestID)
		}
	})

	results := e.collect()
	cases := []struct {
		name, header, wantID string
		body                 func(id string) []byte
	}{
		{"SDK form, undecodable body", "acme/sdk-broken/0123abcd", "sdk-broken",
			func(id string) []byte { return replaceJSON(validJSON(id), `"apiVersion"`, `"apiVersion": 3, "x"`) }},
		{"tenant form", "acme/tenant-form", "tenant-form",
			func(id string) []byte { return replaceJSON(validJSON(id), `"name":"web"`, `"name":"Web"`) }},
		{"bare form", "bare-form", "bare-form",
			func(id string) []byte { return replaceJSON(validJSON(id), `"name":"web"`, `"name":"Web"`) }},
		{"requeue form", "acme/requeue-form/requeue-abc-7", "requeue-form",
			func(id string) []byte { return replaceJSON(validJSON(id), `"name":"web"`, `"name":"Web"`) }},
		{"header names another id", "acme/the-header/0123", "the-header",
			func(string) []byte { return replaceJSON(validJSON("the-body"), `"name":"web"`, `"name":"Web"`) }},
	}
	for _, c := range cases {
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, c.header)
		m.Data = c.body(c.wantID)
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
	}
	got := map[string]v1.Result{}
	for _, r := range results.waitFor(t, len(cases)+1, 20*time.Second) { // and the SDK case's
		got[r.Data.RequestID] = r
	}
	for _, c := range cases {
		r, ok := got[c.wantID]
		if !ok || r.ID != c.wantID || r.Data.Reason != v1.ReasonInvalidRequest {
			t.Errorf("%s (Nats-Msg-Id %q): no InvalidRequest result for %q; results: %s", c.name, c.header, c.wantID, mustJSON(t, got))
		}
	}
}

// A source with both s3 and git, or an s3 source without a contextDigest,
// is InvalidRequest before any possession read, claim or Job.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestMalformedSourcesNeverReachPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
	e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()

	both := tenantRequestFor("mallory", digestOf("both"))
	both.APIVersion, both.RequestID = v1.APIVersion, "both-sources"
	both.Source.Git = &v1.GitSource{URL: "https://git.example.com/acme/private.git", Commit: strings.Repeat("cd", 20)}
	noDigest := tenantRequestFor("mallory", digestOf("no digest"))
	noDigest.APIVersion, noDigest.RequestID, noDigest.ContextDigest = v1.APIVersion, "no-digest", ""
	for _, r := range []*v1.Request{both, noDigest} {
		body, _ := json.Marshal(r)
		if _, err := publishRaw(e.js, v1.RequestSubject("mallory"), map[string]string{v1.MsgIDHeader: v1.MsgID("mallory", r.RequestID)}, body); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"both-sources", "no-digest"} {
		if r := oneResult(t, results, id); r.Data.Reason != v1.ReasonInvalidRequest {
			t.Errorf("%s: %s", id, mustJSON(t, r))
		}
	}
	store.mu.Lock()
	opened := len(store.opens)
	store.mu.Unlock()
	if opened != 0 || e.creates.total() != 0 {
		t.Fatalf("%d objects opened, %d Jobs", opened, e.creates.total())
	}
}
