package registry

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
)

// authEntry is one value of a docker config.json "auths" map. "email" and
// "serveraddress" are ignored, as docker does.
type authEntry struct {
	Auth          string `json:"auth,omitempty"`
	Username      string `json:"username,omitempty"`
	Password      string `json:"password,omitempty"`
	IdentityToken string `json:"identitytoken,omitempty"`
	RegistryToken string `json:"registrytoken,omitempty"`
}

type dockerConfigFile struct {
	Auths map[string]authEntry `json:"auths"`
}

// credentials are the usable entries of one docker config.
type credentials struct {
	// byRepo: keys naming a repository or namespace ("host/project"); the
	// longest one containing the repository wins, as in podman (ggcr's
	// default keychain matches them exactly), so that per-project robot
	// accounts can sit next to a registry-wide entry.
	byRepo map[string]authn.AuthConfig
	// byHost: every entry under its hostname, as docker reduces keys
	// ("https://host/v1/" -> "host").
	byHost map[string]authn.AuthConfig
}

// parseDockerConfig parses and validates a docker config.json. Credential
// helpers ("credsStore", "credHelpers") are not consulted: in a Secret
// there is nothing to run them.
func parseDockerConfig(data []byte) (*credentials, error) {
	var f dockerConfigFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("invalid JSON: %w", err)
	}
	c := &credentials{byRepo: map[string]authn.AuthConfig{}, byHost: map[string]authn.AuthConfig{}}
	keys := make([]string, 0, len(f.Auths))
	for k := range f.Auths {
		keys = append(keys, k)
	}
	// Docker picks among keys for one host in map order; sorting makes the
	// choice stable, and a bare "host" key wins over decorated ones.
	sort.Strings(keys)
	bareSeen := map[string]bool{}
	for _, key := range keys {
		cfg, err := f.Auths[key].authConfig()
		if err != nil {
			return nil, fmt.Errorf("auths[%q]: %w", key, err)
		}
		if cfg == (authn.AuthConfig{}) {
			continue
		}
		stripped := stripScheme(key)
		host, path, _ := strings.Cut(stripped, "/")
		host = canonicalHost(host)
		if host == "" {
			continue
		}
		// "/v1/" and "/v2/" in docker's keys are API versions, not
		// namespaces.
		if path = strings.ToLower(strings.Trim(path, "/")); path != "" && path != "v1" && path != "v2" {
			c.byRepo[host+"/"+path] = cfg
		}
		bare := !strings.Contains(stripped, "/")
		if _, seen := c.byHost[host]; !seen || (bare && !bareSeen[host]) {
			c.byHost[host] = cfg
		}
		if bare {
			bareSeen[host] = true
		}
	}
	return c, nil
}

// authConfig decodes the entry; "auth" (base64 user:pass) takes precedence
// over "username"/"password", as in docker.
func (e authEntry) authConfig() (authn.AuthConfig, error) {
	cfg := authn.AuthConfig{
		Username:      e.Username,
		Password:      e.Password,
		IdentityToken: e.IdentityToken,
		RegistryToken: e.RegistryToken,
	}
	if a := strings.TrimSpace(e.Auth); a != "" {
		raw, err := base64.StdEncoding.DecodeString(a)
		if err != nil {
			if raw, err = base64.RawStdEncoding.DecodeString(a); err != nil {
				return authn.AuthConfig{}, errors.New(`"auth" is not valid base64`)
			}
		}
		user, pass, ok := strings.Cut(string(raw), ":")
		if !ok {
			return authn.AuthConfig{}, errors.New(`"auth" must be base64 of username:password`)
		}
		cfg.Username, cfg.Password = user, pass
	}
	return cfg, nil
}

// lookup finds the credentials for a repository ("host/path") or registry
// ("host"): the most specific repository or namespace key first, then the
// host's entry.
func (c *credentials) lookup(target string) (authn.AuthConfig, bool) {
	host, path, _ := strings.Cut(strings.ToLower(target), "/")
	host = canonicalHost(host)
	for path != "" {
		if cfg, ok := c.byRepo[host+"/"+path]; ok {
			return cfg, true
		}
		i := strings.LastIndex(path, "/")
		if i < 0 {
			break
		}
		path = path[:i]
	}
	cfg, ok := c.byHost[host]
	return cfg, ok
}

// stripScheme removes a leading http:// or https:// (any case).
func stripScheme(key string) string {
	k := strings.TrimSpace(key)
	for _, p := range []string{"https://", "http://"} {
		if len(k) >= len(p) && strings.EqualFold(k[:len(p)], p) {
			return k[len(p):]
		}
	}
	return k
}

// canonicalHost lower-cases host and folds Docker Hub's names into the one
// go-containerregistry uses.
func canonicalHost(host string) string {
	host = strings.ToLower(host)
	switch host {
	case "docker.io", "registry-1.docker.io", "registry.hub.docker.com":
		return "index.docker.io"
	}
	return host
}

// keychain resolves go-containerregistry auth from the parsed config.
type keychain struct{ creds *credentials }

var (
	_ authn.Keychain        = keychain{}
	_ authn.ContextKeychain = keychain{}
)

// Resolve implements authn.Keychain.
func (k keychain) Resolve(target authn.Resource) (authn.Authenticator, error) {
	return k.ResolveContext(context.Background(), target)
}

// ResolveContext implements authn.ContextKeychain.
func (k keychain) ResolveContext(_ context.Context, target authn.Resource) (authn.Authenticator, error) {
	cfg, ok := k.creds.lookup(target.String())
	if !ok {
		return authn.Anonymous, nil
	}
	return authn.FromConfig(cfg), nil
}

// DockerConfigJSON renders a docker config.json with one auth entry for
// registry (host[:port]), in the form docker login writes and Kubernetes
// expects in a kubernetes.io/dockerconfigjson Secret. Tests and dev tooling
// use it to create Secrets and files.
func DockerConfigJSON(registry, username, password string) ([]byte, error) {
	registry = strings.TrimSpace(registry)
	switch {
	case registry == "":
		return nil, errors.New("registry: docker config: empty registry")
	case username == "" || password == "":
		return nil, errors.New("registry: docker config: username and password are required")
	case strings.Contains(username, ":"):
		// "auth" is base64(username:password), split at the first colon.
		return nil, errors.New("registry: docker config: username must not contain ':'")
	}
	return json.Marshal(dockerConfigFile{Auths: map[string]authEntry{
		registry: {
			Username: username,
			Password: password,
			Auth:     base64.StdEncoding.EncodeToString([]byte(username + ":" + password)),
		},
	}})
}
