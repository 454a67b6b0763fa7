package gitsource

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode"

	v1 "github.com/buildq/buildq/api/v1"
)

// Error is why a Fetch failed. Either the request's own failure
// (Transient false; Reason is a v1.ReasonGit* word, or
// v1.ReasonInvalidRequest for a source that is malformed or whose
// repository content cannot be a context; it fails at once) or transient
// trouble (Transient true, Reason ""; network errors, 5xx answers, a
// canceled Fetch), worth another try. Message never holds a credential or
// URL userinfo.
type Error struct {
	Reason    string
	Message   string
	Transient bool
	Err       error
}

// Error returns Message.
func (e *Error) Error() string { return e.Message }

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// errTimeout is the cause of a Fetch's own deadline.
var errTimeout = errors.New("gitsource: fetch timeout")

// errLimit marks the error a reader returns once a limit is crossed; the
// limit itself is the run's recorded failure.
var errLimit = errors.New("gitsource: limit exceeded")

// refuse is the request's own failure.
func refuse(reason, msg string, err error) *Error {
	return &Error{Reason: reason, Message: msg, Err: err}
}

// tooLarge is a limit crossed.
func tooLarge(msg string, err error) *Error {
	return refuse(v1.ReasonGitTooLarge, "git source too large: "+msg, err)
}

// tooMany is a refusal for more objects than MaxObjects.
func tooMany(msg string, err error) *Error {
	return refuse(v1.ReasonGitTooManyObjects, "git source has too many objects: "+msg, err)
}

// tooDeep is a refusal for history or a delta chain deeper than allowed.
func tooDeep(msg string, err error) *Error {
	return refuse(v1.ReasonGitTooDeep, "git source too deep: "+msg, err)
}

// invalid is a source that cannot be a context, for a reason of its own
// that has no git reason word.
func invalid(msg string) *Error {
	return refuse(v1.ReasonInvalidRequest, msg, nil)
}

// invalidf is invalid with a cause, which it wraps.
func invalidf(err error, format string, args ...any) *Error {
	return refuse(v1.ReasonInvalidRequest, fmt.Sprintf(format, args...)+": "+err.Error(), err)
}

// transient is trouble another attempt may cure.
func transient(what string, err error) *Error {
	return &Error{Message: fmt.Sprintf("%s: %v", what, err), Transient: true, Err: err}
}

// serverError is a refusal in the git server's own words: an "ERR"
// pkt-line, a message on sideband channel 3, an SSH server's stderr.
// early says it came before any pack data: the server declining the
// request itself (such as a want it will not serve), not failing on the
// way.
type serverError struct {
	text  string
	early bool
}

func (e *serverError) Error() string { return "the git server said: " + e.text }

// fail records f as the run's failure unless one is recorded already, and
// returns the recorded one. Readers and dialers call it where the error
// they return would be flattened by the code above them (net/http, the
// ssh handshake); classify reports the recorded failure first.
func (r *run) fail(f *Error) *Error {
	r.failure.CompareAndSwap(nil, f)
	return r.failure.Load()
}

// classify turns whatever a Fetch step returned into the *Error Fetch
// reports, scrubbed of secrets.
func (r *run) classify(ctx context.Context, err error) *Error {
	var e *Error
	switch {
	case r.failure.Load() != nil:
		e = r.failure.Load()
	case errors.Is(context.Cause(ctx), errTimeout):
		e = refuse(v1.ReasonGitTimeout,
			fmt.Sprintf("fetching %s took longer than the limit of %s (Timeout)", r.display, r.lim.Timeout), context.DeadlineExceeded)
	case ctx.Err() != nil:
		e = transient("fetch "+r.display, ctx.Err())
	case errors.As(err, &e):
	default:
		e = &Error{Message: fmt.Sprintf("fetch %s: %v", r.display, err), Transient: true, Err: err}
	}
	return r.scrub(e)
}

// userinfoRe finds URL userinfo ("scheme://user:pass@").
var userinfoRe = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@`)

// maxMessage bounds an error message: server words can be long.
const maxMessage = 2000

// scrub returns a copy of e whose message (and cause, if its text would
// tell) holds no credential, no URL userinfo and no control character.
func (r *run) scrub(e *Error) *Error {
	out := *e
	out.Message = r.clean(e.Message)
	if e.Err != nil && r.leaks(e.Err.Error()) {
		out.Err = errors.New(r.clean(e.Err.Error()))
	}
	return &out
}

// leaks reports whether s holds a credential or URL userinfo.
func (r *run) leaks(s string) bool {
	for _, secret := range r.secrets {
		if strings.Contains(s, secret) {
			return true
		}
	}
	return userinfoRe.MatchString(s)
}

// clean removes secrets, userinfo and control characters from s.
func (r *run) clean(s string) string {
	for _, secret := range r.secrets {
		s = strings.ReplaceAll(s, secret, "[redacted]")
	}
	s = userinfoRe.ReplaceAllString(s, "$1")
	s = strings.Map(func(c rune) rune {
		if c == '\n' || c == '\t' {
			return ' '
		}
		if unicode.IsControl(c) {
			return -1
		}
		return c
	}, s)
	s = strings.TrimSpace(s)
	if len(s) > maxMessage {
		s = s[:maxMessage] + "…"
	}
	return s
}

// serverWords is a server's message made fit for an error message.
func serverWords(s string) string {
	s = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(s), "ERR "))
	if len(s) > 500 {
		s = s[:500] + "…"
	}
	return s
}
