package v1

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func validRequest() *Request {
	return &Request{
		APIVersion:    APIVersion,
		RequestID:     "req-1",
		Tenant:        "acme",
		Name:          "web",
		Source:        Source{S3: &S3Source{Bucket: "buildq", Key: "contexts/sha256/" + strings.Repeat("a", 64) + ".tar.gz"}},
		ContextDigest: "sha256:" + strings.Repeat("a", 64),
		Dockerfile:    "docker/Dockerfile",
		BuildArgs:     map[string]string{"VERSION": "1"},
		Target:        "runtime",
		Platforms:     []string{"linux/arm64", "linux/amd64"},
		Image:         "registry.example.com/acme/web",
		Tags:          []string{"v1", "latest"},
		Timeout:       Duration{10 * time.Minute},
		Labels:        map[string]string{"org.opencontainers.image.source": "https://example.com/x"},
	}
}

func TestRequestJSONRoundTrip(t *testing.T) {
	t.Parallel()
	in := validRequest()
	in.SubmittedAt = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"timeout":"10m0s"`) {
		t.Errorf("timeout not a duration string: %s", b)
	}
	out, err := DecodeRequest(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(in, out) {
		t.Fatalf("round trip changed the request:\n in %+v\nout %+v", in, out)
	}
}

func TestResultJSONRoundTrip(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	data := ResultData{
		RequestID: "req-1", Tenant: "acme", Name: "web", Key: strings.Repeat("b", 64), Status: StatusSucceeded,
		Origin: OriginInflight, Image: "r/acme/web:bbbbbbbbbbbb", Digest: "sha256:" + strings.Repeat("c", 64),
		ImageRef: "r/acme/web@sha256:" + strings.Repeat("c", 64), Job: "buildq-x", Attempts: 1,
		Timings: Timings{QueuedAt: now, StartedAt: now.Add(time.Second), FinishedAt: now.Add(time.Minute), QueueWaitMs: 1000, BuildMs: 59000},
	}
	ev := NewResult("/buildq/worker/w1", data, now)
	b, err := json.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	// The CloudEvents attributes a third-party subscriber relies on.
	var raw map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{
		"specversion": "1.0", "type": "dev.buildq.build.succeeded.v1", "id": "req-1",
		"subject": "acme/web", "source": "/buildq/worker/w1", "datacontenttype": "application/json",
		"time": "2026-01-02T03:04:05Z",
	} {
		if raw[k] != want {
			t.Errorf("%s = %v, want %v", k, raw[k], want)
		}
	}
	var back Result
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(ev, back) {
		t.Fatalf("round trip changed the result:\n%+v\n%+v", ev, back)
	}
}

func TestValidateRejects(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		field string
		mut   func(r *Request)
	}{
		{"wrong apiVersion", "apiVersion", func(r *Request) { r.APIVersion = "v0" }},
		{"missing requestId", "requestId", func(r *Request) { r.RequestID = "" }},
		{"requestId with spaces", "requestId", func(r *Request) { r.RequestID = "a b" }},
		{"long requestId", "requestId", func(r *Request) { r.RequestID = strings.Repeat("a", 129) }},
		{"tenant with dot", "tenant", func(r *Request) { r.Tenant = "a.b" }},
		{"tenant with star", "tenant", func(r *Request) { r.Tenant = "*" }},
		{"tenant with gt", "tenant", func(r *Request) { r.Tenant = ">" }},
		{"uppercase name", "name", func(r *Request) { r.Name = "Web" }},
		{"300-character name", "name", func(r *Request) { r.Name = strings.Repeat("a", 300) }},
		{"name with space", "name", func(r *Request) { r.Name = "a b" }},
		{"no source", "source", func(r *Request) { r.Source = Source{} }},
		{"both sources", "source", func(r *Request) {
			r.Source.Git = &GitSource{URL: "https://x/y.git", Commit: strings.Repeat("a", 40)}
		}},
		{"bad bucket", "source.s3.bucket", func(r *Request) { r.Source.S3.Bucket = "B" }},
		{"absolute key", "source.s3.key", func(r *Request) { r.Source.S3.Key = "/etc/passwd" }},
		{"escaping key", "source.s3.key", func(r *Request) { r.Source.S3.Key = "../x" }},
		{"bad digest", "contextDigest", func(r *Request) { r.ContextDigest = "md5:abc" }},
		{"git short commit", "source.git.commit", func(r *Request) {
			r.Source = Source{Git: &GitSource{URL: "https://x/y.git", Commit: "abc"}}
			r.ContextDigest = ""
		}},
		{"git file url", "source.git.url", func(r *Request) {
			r.Source = Source{Git: &GitSource{URL: "file:///etc", Commit: strings.Repeat("a", 40)}}
			r.ContextDigest = ""
		}},
		{"git without ref or commit", "source.git", func(r *Request) {
			r.Source = Source{Git: &GitSource{URL: "https://x/y.git"}}
			r.ContextDigest = ""
		}},
		{"git ref like a flag", "source.git.ref", func(r *Request) {
			r.Source = Source{Git: &GitSource{URL: "https://x/y.git", Ref: "--upload-pack=touch /tmp/x"}}
			r.ContextDigest = ""
		}},
		{"git ref with dot-dot", "source.git.ref", func(r *Request) {
			r.Source = Source{Git: &GitSource{URL: "https://x/y.git", Ref: "refs/heads/../../x"}}
			r.ContextDigest = ""
		}},
		{"git ref with a control character", "source.git.ref", func(r *Request) {
			r.Source = Source{Git: &GitSource{URL: "https://x/y.git", Ref: "main\n"}}
			r.ContextDigest = ""
		}},
		{"dockerfile escapes", "dockerfile", func(r *Request) { r.Dockerfile = "../../Dockerfile" }},
		{"bad build arg name", "buildArgs", func(r *Request) { r.BuildArgs = map[string]string{"A-B": "1"} }},
		{"huge build arg", "buildArgs.BIG", func(r *Request) { r.BuildArgs = map[string]string{"BIG": strings.Repeat("x", 5000)} }},
		{"bad target", "target", func(r *Request) { r.Target = "a b" }},
		{"unknown platform", "platforms", func(r *Request) { r.Platforms = []string{"plan9/mips"} }},
		{"platform twice", "platforms", func(r *Request) { r.Platforms = []string{"linux/amd64", "linux/amd64"} }},
		{"image with metacharacters", "image", func(r *Request) { r.Image = "registry.example.com/acme/web;rm -rf" }},
		{"image with tag", "image", func(r *Request) { r.Image = "registry.example.com/acme/web:v1" }},
		{"image with digest", "image", func(r *Request) { r.Image = "registry.example.com/acme/web@sha256:" + strings.Repeat("a", 64) }},
		{"uppercase image", "image", func(r *Request) { r.Image = "Registry.example.com/Acme/Web" }},
		{"bad tag", "tags", func(r *Request) { r.Tags = []string{"-x"} }},
		{"bad priority", "priority", func(r *Request) { r.Priority = "urgent" }},
		{"too many tags", "tags", func(r *Request) { r.Tags = strings.Split(strings.Repeat("t,", 17)[:33], ",") }},
		{"timeout too short", "timeout", func(r *Request) { r.Timeout = Duration{time.Second} }},
		{"timeout too long", "timeout", func(r *Request) { r.Timeout = Duration{48 * time.Hour} }},
		{"bad label key", "labels", func(r *Request) { r.Labels = map[string]string{"a b": "c"} }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := validRequest()
			c.mut(r)
			err := r.Validate()
			var ve *ValidationError
			if !errors.As(err, &ve) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate() = %v, want a *ValidationError", err)
			}
			found := false
			for _, f := range ve.Fields {
				if f.Field == c.field {
					found = true
				}
			}
			if !found {
				t.Fatalf("error %q does not name field %q", err, c.field)
			}
		})
	}
}

func TestValidateAccepts(t *testing.T) {
	t.Parallel()
	if err := validRequest().Validate(); err != nil {
		t.Fatal(err)
	}
	r := validRequest()
	r.Source = Source{Git: &GitSource{URL: "https://github.com/acme/web.git", Commit: strings.Repeat("f", 40), SubPath: "app"}}
	r.ContextDigest = ""
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, g := range []GitSource{
		{URL: "https://github.com/acme/web.git", Ref: "main"},
		{URL: "ssh://git@github.com/acme/web.git", Ref: "refs/tags/v1.2.3", Commit: strings.Repeat("e", 40)},
		{URL: "http://git.internal:3000/acme/web.git", Ref: "release/2026-12", Submodules: true},
	} {
		r.Source = Source{Git: &g}
		if err := r.Validate(); err != nil {
			t.Errorf("%+v: %v", g, err)
		}
	}
}

func TestDecodeRequestRefuses(t *testing.T) {
	t.Parallel()
	valid, err := json.Marshal(validRequest())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeRequest(valid); err != nil {
		t.Fatalf("the valid request is refused: %v", err)
	}
	// Each input is the valid request with one defect, so only the decoder
	// can be what refuses it.
	body := strings.TrimSuffix(string(valid), "}")
	for name, in := range map[string]string{
		"not json":      "{",
		"unknown field": body + `,"bogus":1}`,
		"trailing data": string(valid) + ` {}`,
		"bad timeout":   strings.Replace(string(valid), `"timeout":"10m0s"`, `"timeout":"soon"`, 1),
		"too large":     body + `,"labels":{"big":"` + strings.Repeat("a", MaxRequestBytes) + `"}}`,
	} {
		_, err := DecodeRequest([]byte(in))
		var de *DecodeError
		if !errors.As(err, &de) || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err = %v, want a *DecodeError", name, err)
		}
	}
}

func TestBuildKey(t *testing.T) {
	t.Parallel()
	base := validRequest()
	k := BuildKey(base, "kaniko@x")
	if len(k) != 64 {
		t.Fatalf("key %q", k)
	}
	same := []func(r *Request){
		func(r *Request) { r.RequestID = "other" },
		func(r *Request) { r.Image = "other.example.com/x/y" },
		func(r *Request) { r.Tags = nil },
		func(r *Request) { r.Timeout = Duration{} },
		func(r *Request) { r.Priority = PriorityHigh },
		func(r *Request) { r.Tenant, r.Name = "other", "other" },
		func(r *Request) { r.Platforms = []string{"linux/amd64", "linux/arm64"} },
	}
	for i, m := range same {
		r := validRequest()
		m(r)
		if got := BuildKey(r, "kaniko@x"); got != k {
			t.Errorf("same-content change %d changed the key", i)
		}
	}
	differ := []func(r *Request){
		func(r *Request) { r.ContextDigest = "sha256:" + strings.Repeat("b", 64) },
		func(r *Request) { r.Dockerfile = "Dockerfile" },
		func(r *Request) { r.BuildArgs = map[string]string{"VERSION": "2"} },
		func(r *Request) { r.Target = "" },
		func(r *Request) { r.Platforms = nil },
		// Labels go into the image config: another label is another image.
		func(r *Request) { r.Labels = nil },
		func(r *Request) {
			r.Labels = map[string]string{"org.opencontainers.image.source": "https://example.com/y"}
		},
	}
	for i, m := range differ {
		r := validRequest()
		m(r)
		if got := BuildKey(r, "kaniko@x"); got == k {
			t.Errorf("content change %d kept the key", i)
		}
	}
	if BuildKey(base, "kaniko@y") == k {
		t.Error("another executor kept the key")
	}
	// A request without labels keeps the key it had before labels counted.
	noLabels := validRequest()
	noLabels.Labels = map[string]string{}
	nilLabels := validRequest()
	nilLabels.Labels = nil
	if BuildKey(noLabels, "kaniko@x") != BuildKey(nilLabels, "kaniko@x") {
		t.Error("empty and absent labels give different keys")
	}
	// Unset Dockerfile and platforms equal their defaults.
	a, b := validRequest(), validRequest()
	a.Dockerfile, a.Platforms = "", nil
	b.Dockerfile, b.Platforms = "Dockerfile", []string{"linux/amd64"}
	if BuildKey(a, "e") != BuildKey(b, "e") {
		t.Error("defaults are not canonical")
	}
}

func FuzzDecodeRequest(f *testing.F) {
	b, _ := json.Marshal(validRequest())
	f.Add(b)
	f.Add([]byte(`{"apiVersion":"buildq.dev/v1","tenant":"a.*>"}`))
	f.Add([]byte(`{"timeout":"-1s","platforms":["linux/amd64/v9"]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := DecodeRequest(data)
		if err == nil {
			// Whatever passes validation is safe to use in subjects.
			for _, s := range []string{r.Tenant, r.Name} {
				if strings.ContainsAny(s, ".*> \t\r\n") {
					t.Fatalf("unsafe token %q accepted", s)
				}
			}
			_ = BuildKey(r, "e")
		} else if !errors.Is(err, ErrInvalid) {
			t.Fatalf("error %v does not match ErrInvalid", err)
		}
	})
}
