package gateway

import (
	"strings"
	"testing"
)

// The URLs a forge gives for one repository all match the trigger's.
func TestNormalizeRepo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"https://github.com/acme/web", "github.com/acme/web"},
		{"https://github.com/Acme/Web.git", "github.com/acme/web"},
		{"https://github.com/acme/web/", "github.com/acme/web"},
		{"git@github.com:acme/web.git", "github.com/acme/web"},
		{"ssh://git@github.com:22/acme/web.git", "github.com/acme/web"},
		{"git://github.com/acme/web.git", "github.com/acme/web"},
		{"http://gitlab.example.com:8080/group/sub/api.git", "gitlab.example.com/group/sub/api"},
		{"git@gitlab.example.com:group/sub/api.git", "gitlab.example.com/group/sub/api"},
		{"", ""},
		{"https://github.com/", ""},
		{"not a url", ""},
		{"/local/path", ""},
		{"https://", ""},
	} {
		if got := normalizeRepo(tc.in); got != tc.want {
			t.Errorf("normalizeRepo(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// Branch and tag filters: none builds every branch and tag; one kind
// given keeps the other kind out; * stays within a path segment.
func TestRefMatches(t *testing.T) {
	t.Parallel()
	main := Trigger{Branches: []string{"main", "release/*"}}
	tags := Trigger{Tags: []string{"v*"}}
	both := Trigger{Branches: []string{"main"}, Tags: []string{"v[0-9]*"}}
	for _, tc := range []struct {
		tr   Trigger
		ref  string
		want bool
	}{
		{Trigger{}, "refs/heads/anything/at/all", true},
		{Trigger{}, "refs/tags/x", true},
		{Trigger{}, "refs/notes/commits", false},
		{main, "refs/heads/main", true},
		{main, "refs/heads/release/1.0", true},
		{main, "refs/heads/release/1.0/fix", false},
		{main, "refs/heads/mainline", false},
		{main, "refs/tags/main", false},
		{tags, "refs/tags/v1.2.3", true},
		{tags, "refs/heads/main", false},
		{both, "refs/tags/v2", true},
		{both, "refs/tags/vx", false},
		{both, "refs/heads/main", true},
	} {
		if got := refMatches(tc.tr, tc.ref); got != tc.want {
			t.Errorf("%+v on %s: %v, want %v", tc.tr, tc.ref, got, tc.want)
		}
	}
}

// Request ids are stable, distinct per input, and valid request ids; the
// Nats-Msg-Id nonce depends on the key.
func TestIDs(t *testing.T) {
	t.Parallel()
	a := EventRequestID("acme", "/ci", "1")
	if a != EventRequestID("acme", "/ci", "1") || !strings.HasPrefix(a, "ce-") || len(a) != 3+idHexLen {
		t.Fatalf("EventRequestID %q", a)
	}
	for _, other := range []string{EventRequestID("globex", "/ci", "1"), EventRequestID("acme", "/ci", "2"), EventRequestID("acme", "/ci1", ""), EventRequestID("acme", "/c", "i1")} {
		if other == a {
			t.Errorf("two events share the id %s", a)
		}
	}
	tr := Trigger{Repository: "https://github.com/acme/web", Name: "web"}
	g := hookRequestID(forgeGitHub, "acme", "d1", tr)
	if !strings.HasPrefix(g, "gh-") || g == hookRequestID(forgeGitHub, "acme", "d2", tr) || g == hookRequestID(forgeGitHub, "acme", "d1", Trigger{Repository: tr.Repository, Name: "web2"}) {
		t.Errorf("webhook ids do not tell pushes or triggers apart")
	}
	if !strings.HasPrefix(hookRequestID(forgeGitLab, "acme", "d1", tr), "gl-") {
		t.Error("a GitLab id is not gl-")
	}
	k1, k2 := []byte(strings.Repeat("a", 32)), []byte(strings.Repeat("b", 32))
	first := msgID(k1, "acme", a)
	if first == msgID(k2, "acme", a) || first != msgID(k1, "acme", a) {
		t.Error("the Nats-Msg-Id nonce does not follow the key")
	}
}
