package naming

import (
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
)

// patternAsRegexp is the regular expression a destination pattern stands
// for: matchPattern must agree with it on every input.
func patternAsRegexp(pat string) *regexp.Regexp {
	var b strings.Builder
	b.WriteString("^")
	for i := 0; i < len(pat); i++ {
		switch {
		case strings.HasPrefix(pat[i:], "**"):
			b.WriteString(".+")
			i++
		case pat[i] == '*':
			b.WriteString("[^/]+")
		default:
			b.WriteString(regexp.QuoteMeta(pat[i : i+1]))
		}
	}
	b.WriteString("$")
	return regexp.MustCompile(b.String())
}

func TestMatchPatternAgreesWithItsRegularExpression(t *testing.T) {
	cases := []struct{ pat, s string }{
		{"reg:5000/acme/**", "reg:5000/acme/web"},
		{"reg:5000/acme/**", "reg:5000/acme/"},
		{"reg:5000/acme/**", "reg:5000/acme/a/b/c"},
		{"reg:5000/acme_*", "reg:5000/acme_web"},
		{"reg:5000/acme_*", "reg:5000/acme_web/x"},
		{"reg:5000/*/app", "reg:5000/acme/app"},
		{"reg:5000/*/app", "reg:5000//app"},
		{"reg:5000/**/app", "reg:5000/a/b/app"},
		{"a.b", "axb"},
		{"***", "a/b"},
		{"*", ""},
		{"", ""},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "b", "/", "*", "**", "."}
	gen := func(n int, stars bool) string {
		var b strings.Builder
		for range rng.IntN(n) {
			c := alphabet[rng.IntN(len(alphabet))]
			if !stars && strings.Contains(c, "*") {
				c = "a"
			}
			b.WriteString(c)
		}
		return b.String()
	}
	for range 5000 {
		cases = append(cases, struct{ pat, s string }{gen(7, true), gen(9, false)})
	}
	for _, c := range cases {
		if got, want := matchPattern(c.pat, c.s), patternAsRegexp(c.pat).MatchString(c.s); got != want {
			t.Errorf("matchPattern(%q, %q) = %v, the pattern's regular expression says %v", c.pat, c.s, got, want)
		}
	}
}
