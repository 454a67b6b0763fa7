package localexec

import (
	"testing"
)

func TestFinalBaseFollowsStages(t *testing.T) {
	df := "ARG V=3\nFROM registry.test/alpine:${V} AS a\nFROM a AS b\nFROM scratch AS s\nFROM b\n"
	for target, want := range map[string]string{"": "registry.test/alpine:3", "s": "", "a": "registry.test/alpine:3"} {
		got, err := FinalBase([]byte(df), nil, target, "linux/amd64")
		if err != nil || got != want {
			t.Fatalf("target %q: %q, %v; want %q", target, got, err, want)
		}
	}
}
