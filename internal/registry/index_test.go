package registry

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

func TestPushIndex(t *testing.T) {
	t.Parallel()
	host := serve(t, memRegistry())
	c := newClient(t, Options{Insecure: []string{host}})
	ctx := context.Background()
	amd, arm := randomImage(t), randomImage(t)
	seed(t, host+"/team/app:bq-amd", amd)
	seed(t, host+"/team/app:bq-arm", arm)
	children := []IndexChild{
		{Ref: host + "/team/app@" + digestOf(t, amd), Platform: "linux/amd64"},
		{Ref: host + "/team/app@" + digestOf(t, arm), Platform: "linux/arm64/v8"},
	}

	got, err := c.PushIndex(ctx, children, []string{host + "/team/app:v1", host + "/team/app:latest"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"v1", "latest"} {
		if d := mustHead(t, c, host+"/team/app:"+tag); d != got {
			t.Fatalf("%s holds %s, want the index %s", tag, d, got)
		}
	}
	r, _ := name.ParseReference(host+"/team/app@"+got, name.Insecure)
	desc, err := remote.Get(r)
	if err != nil {
		t.Fatal(err)
	}
	if desc.MediaType != types.OCIImageIndex {
		t.Fatalf("media type %s, want an OCI image index", desc.MediaType)
	}
	plats, err := c.IndexPlatforms(ctx, host+"/team/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if len(plats) != 2 || plats["linux/amd64"] != digestOf(t, amd) || plats["linux/arm64/v8"] != digestOf(t, arm) {
		t.Fatalf("index platforms %v, want amd64 → %s and arm64/v8 → %s", plats, digestOf(t, amd), digestOf(t, arm))
	}

	t.Run("the same children make the same index", func(t *testing.T) {
		again, err := c.PushIndex(ctx, children, []string{host + "/team/app:v2"})
		if err != nil || again != got {
			t.Fatalf("pushed again: %s, %v; want %s", again, err, got)
		}
	})
	t.Run("a child that is not stored fails, naming it", func(t *testing.T) {
		missing := host + "/team/app@sha256:" + strings.Repeat("0", 64)
		_, err := c.PushIndex(ctx, []IndexChild{children[0], {Ref: missing, Platform: "linux/386"}}, []string{host + "/team/app:v3"})
		if !IsNotFound(err) || !strings.Contains(err.Error(), missing) {
			t.Fatalf("error %v, want not found naming %s", err, missing)
		}
		if _, err := c.Head(ctx, host+"/team/app:v3"); !IsNotFound(err) {
			t.Fatalf("v3 was written anyway: %v", err)
		}
	})
	t.Run("bad input is refused", func(t *testing.T) {
		for _, tc := range []struct {
			children []IndexChild
			refs     []string
			want     string
		}{
			{nil, []string{host + "/team/app:x"}, "no platform images"},
			{children, nil, "no references"},
			{[]IndexChild{{Ref: children[0].Ref, Platform: "amd64"}}, []string{host + "/team/app:x"}, "not a platform"},
			{children, []string{host + "/team/app@" + got}, "digest"},
		} {
			if _, err := c.PushIndex(ctx, tc.children, tc.refs); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("PushIndex(%v, %v): %v, want an error saying %q", tc.children, tc.refs, err, tc.want)
			}
		}
	})
}
