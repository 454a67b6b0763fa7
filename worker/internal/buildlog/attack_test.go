package buildlog

// Attacks on the writer: what an executor (or a tenant's Dockerfile) can
// make it store, and whether the secret masks hold against values that
// do not sit neatly on one line.

import (
	"context"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// storedLines ends the log of run and returns its stored lines, failing
// the test when the stored log does not parse line by line.
func storedLines(t *testing.T, r *Reader, w *Writer, run string) (raw []byte, lines []v1.LogLine, perr error) {
	t.Helper()
	ctx := context.Background()
	if err := w.End(ctx, "failed", "BuildFailed"); err != nil {
		t.Fatal(err)
	}
	data, _, err := r.ReadAll(ctx, testKey, run)
	if err != nil {
		t.Fatal(err)
	}
	perr = v1.EachLogLine(data, func(l v1.LogLine) bool {
		l.Text = append([]byte(nil), l.Text...)
		lines = append(lines, l)
		return true
	})
	return data, lines, perr
}

// Attack: log-line injection. The text of an executor line holds a
// newline (the local executor's error for `COPY ["a\n<forged>", "/x"]`
// carries the JSON-decoded path as is; any backend may hand Line such a
// text). Expected: the stored log keeps one line per Line call — the
// newline cannot start a line of its own, let alone a forged line of
// buildq's own stream (a fake "build succeeded", a fake "pushed"), and
// readers (v1.EachLogLine stops at the first line that does not parse)
// still read the whole log. Before the fix, Line stores the text verbatim: a forged
// buildq line appears in the log, or the rest of the log stops parsing.
func TestLogAttackNewlineInLineCannotForgeOwnLines(t *testing.T) {
	t.Parallel()
	js, r := setup(t)
	ctx := context.Background()
	w, err := Open(ctx, js, testKey, "nl", Options{})
	if err != nil {
		t.Fatal(err)
	}
	forged := "Dockerfile line 3: COPY x\n2026-01-01T00:00:00Z buildq 1 pushed sha256:" + strings.Repeat("0", 64)
	if err := w.Line(ctx, "", v1.LogStreamLocal, 1, t0, []byte(forged)); err != nil {
		t.Fatal(err)
	}
	// And a text whose newline leaves a line that does not parse.
	if err := w.Line(ctx, "", v1.LogStreamLocal, 1, t0.Add(time.Millisecond), []byte("first half\nsecond half")); err != nil {
		t.Fatal(err)
	}
	if err := w.Line(ctx, "", v1.LogStreamLocal, 1, t0.Add(2*time.Millisecond), []byte("after")); err != nil {
		t.Fatal(err)
	}
	raw, lines, perr := storedLines(t, r, w, "nl")
	if perr != nil {
		t.Errorf("the stored log no longer parses (a reader stops here): %v\n%s", perr, raw)
	}
	for _, l := range lines {
		if l.Own() && strings.HasPrefix(string(l.Text), "pushed ") {
			t.Errorf("an executor line forged a line of buildq's own stream: %q\n%s", l.Text, raw)
		}
	}
	if len(lines) != 4 { // three executor lines and the end
		t.Errorf("3 Line calls and the end stored as %d lines:\n%s", len(lines), raw)
	}
}

// Attack: a multi-line secret (a PEM key, a kubeconfig: build argument
// values may hold newlines, only NUL is refused). An executor prints it
// as it prints everything: one line at a time. Expected: no line of the
// secret reaches the stored log. Before the fix, the mask is only ever compared
// with a whole single line, and a value with a newline never matches one.
func TestLogAttackMultiLineSecretIsMasked(t *testing.T) {
	t.Parallel()
	js, r := setup(t)
	ctx := context.Background()
	secret := "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
	w, err := Open(ctx, js, testKey, "pem", Options{Mask: []string{secret}})
	if err != nil {
		t.Fatal(err)
	}
	for i, line := range strings.Split("echo key:\n"+secret, "\n") {
		if err := w.Line(ctx, "p", "kaniko", 1, t0.Add(time.Duration(i)*time.Millisecond), []byte(line)); err != nil {
			t.Fatal(err)
		}
	}
	raw, _, _ := storedLines(t, r, w, "pem")
	if strings.Contains(string(raw), "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC") {
		t.Errorf("the body of a multi-line secret build argument is stored in clear:\n%s", raw)
	}
}

// Attack: two secrets that overlap in the printed text. The longer one is
// replaced first, which eats the start of the other, and the rest of the
// other is left in clear. Expected: every byte of text covered by a secret
// is masked.
func TestLogAttackOverlappingSecretsMaskedWhole(t *testing.T) {
	t.Parallel()
	js, r := setup(t)
	ctx := context.Background()
	a, b := "XXXX-secret-one", "one-TAIL99"
	w, err := Open(ctx, js, testKey, "overlap", Options{Mask: []string{a, b}})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Line(ctx, "p", "kaniko", 1, t0, []byte("token="+a+b[len("one"):])); err != nil {
		t.Fatal(err)
	}
	raw, _, _ := storedLines(t, r, w, "overlap")
	if strings.Contains(string(raw), "TAIL99") || strings.Contains(string(raw), "secret") {
		t.Errorf("the text %q holds both secrets; stored:\n%s", "token="+a+b[len("one"):], raw)
	}
}

// Attack: buildq's own lines name what the tenant chose (request id,
// destination tags, context object): a secret value that coincides with
// one is written by Own unmasked. Expected: the masks apply to every line
// stored ("replaced by *** before anything is stored").
func TestLogAttackOwnLinesAreMasked(t *testing.T) {
	t.Parallel()
	js, r := setup(t)
	ctx := context.Background()
	w, err := Open(ctx, js, testKey, "own", Options{Mask: []string{"hunter2-token"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Own(ctx, "pushing to registry.test/acme/web:hunter2-token"); err != nil {
		t.Fatal(err)
	}
	raw, _, _ := storedLines(t, r, w, "own")
	if strings.Contains(string(raw), "hunter2-token") {
		t.Errorf("a secret value is stored in clear in buildq's own line:\n%s", raw)
	}
}

// Held: a secret that is a substring of another is masked whole either way
// (longest first), a secret in a line longer than a chunk is masked before
// the line is split, so it never straddles two stored pieces, and a one-byte
// secret masks without trouble.
func TestLogAttackMasksHoldForNestedSplitAndShortSecrets(t *testing.T) {
	t.Parallel()
	js, r := setup(t)
	ctx := context.Background()
	long := strings.Repeat("s", 10) + "LONGSECRET"
	w, err := Open(ctx, js, testKey, "nested", Options{Mask: []string{"secret", "supersecret", long, "Q"}, ChunkBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Line(ctx, "p", "kaniko", 1, t0, []byte("a supersecret and a secret and Q")); err != nil {
		t.Fatal(err)
	}
	// The writer splits at ChunkBytes-128-len(stream): put the secret
	// across that boundary.
	limit := 1024 - 128 - len("kaniko")
	text := strings.Repeat("x", limit-8) + long + strings.Repeat("y", 100)
	if err := w.Line(ctx, "p", "kaniko", 1, t0.Add(time.Millisecond), []byte(text)); err != nil {
		t.Fatal(err)
	}
	raw, lines, perr := storedLines(t, r, w, "nested")
	if perr != nil {
		t.Fatal(perr)
	}
	s := string(raw)
	for _, leak := range []string{"super", "secret", "LONGSEC", "ssssLONG", "Q"} {
		if strings.Contains(s, leak) {
			t.Errorf("%q is in the stored log:\n%s", leak, s)
		}
	}
	if got := string(lines[0].Text); got != "a *** and a *** and ***" {
		t.Errorf("first line stored as %q", got)
	}
}
