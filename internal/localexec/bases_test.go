package localexec

import (
	"slices"
	"testing"
)

func TestBaseImagesExpandsArgsAndSkipsStages(t *testing.T) {
	df := `ARG REG=registry.test
ARG TAG=1
FROM ${REG}/golang:${TAG} AS build
COPY --from=registry.test/tools/protoc:3 /protoc /protoc
FROM scratch AS empty
FROM build AS test
COPY --from=0 /x /x
FROM ${REG}/base/alpine:3-${TARGETARCH}
COPY --from=build /out /out
COPY --from=empty / /
`
	got, err := BaseImages([]byte(df), map[string]string{"TAG": "2"}, "", "linux/arm64")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"registry.test/golang:2", "registry.test/tools/protoc:3", "registry.test/base/alpine:3-arm64"}
	if !slices.Equal(got, want) {
		t.Fatalf("base images %q, want %q", got, want)
	}
	got, err = BaseImages([]byte(df), nil, "test", "linux/amd64")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"registry.test/golang:1", "registry.test/tools/protoc:3"}; !slices.Equal(got, want) {
		t.Fatalf("with target test: %q, want %q", got, want)
	}
	if _, err := BaseImages([]byte("FROM"), nil, "", ""); err == nil {
		t.Fatal("a Dockerfile that does not parse gave no error")
	}
}

func TestFinalBaseFollowsStages(t *testing.T) {
	df := "ARG V=3\nFROM registry.test/alpine:${V} AS a\nFROM a AS b\nFROM scratch AS s\nFROM b\n"
	for target, want := range map[string]string{"": "registry.test/alpine:3", "s": "", "a": "registry.test/alpine:3"} {
		got, err := FinalBase([]byte(df), nil, target, "linux/amd64")
		if err != nil || got != want {
			t.Fatalf("target %q: %q, %v; want %q", target, got, err, want)
		}
	}
}
