package main

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"
)

// deploy/'s overlays read one file of site values each (site.env, see
// deploy/README.md), handed to the worker as its environment: the worker's
// own variables (BUILDQ_*, NATS_URL) and SITE_* for what kustomize writes
// elsewhere (images, NetworkPolicy addresses, monitoring labels). The
// shipped files render and apply as they are, with example values an
// operator cannot mistake for real ones: hosts under the reserved domain
// .example (RFC 6761) and addresses of the documentation ranges (RFC 5737,
// RFC 3849). checkSiteValues refuses such a value, naming its key, so a
// site value that was never set stops the worker at start with that name
// instead of failing later with a connection error.

// documentationNets are the address ranges reserved for documentation.
var documentationNets = []netip.Prefix{
	netip.MustParsePrefix("192.0.2.0/24"),    // TEST-NET-1, RFC 5737
	netip.MustParsePrefix("198.51.100.0/24"), // TEST-NET-2
	netip.MustParsePrefix("203.0.113.0/24"),  // TEST-NET-3
	netip.MustParsePrefix("2001:db8::/32"),   // RFC 3849
}

// checkSiteValues returns an error naming every site value in environ (as
// os.Environ gives it) that is still a shipped example.
func checkSiteValues(environ []string) error {
	var bad []string
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(k, "BUILDQ_") && !strings.HasPrefix(k, "SITE_") && k != "NATS_URL" {
			continue
		}
		if why := exampleValue(v); why != "" {
			bad = append(bad, fmt.Sprintf("%s=%s (%s)", k, v, why))
		}
	}
	if len(bad) == 0 {
		return nil
	}
	sort.Strings(bad)
	return fmt.Errorf("site values still hold the shipped examples: %s; set them in your overlay's site.env (deploy/README.md, \"Site values\")", strings.Join(bad, ", "))
}

// exampleValue says why v is an example value, or "" when it is not: an
// item of a comma-separated list that is (or whose URL, image reference or
// CIDR names) a host under .example or an address of a documentation range.
func exampleValue(v string) string {
	for _, item := range strings.Split(v, ",") {
		host := strings.TrimSpace(item)
		if _, rest, ok := strings.Cut(host, "://"); ok {
			host = rest
		}
		if at := strings.LastIndex(host, "@"); at >= 0 && !strings.Contains(host[:at], "/") {
			host = host[at+1:] // user@host of a URL, not repo@sha256 of an image
		}
		if i := strings.Index(host, "/"); i >= 0 {
			if p, err := netip.ParsePrefix(host); err == nil {
				if documentation(p.Addr()) {
					return "a documentation address range"
				}
				continue
			}
			host = host[:i]
		}
		if h, _, ok := splitPort(host); ok {
			host = h
		}
		host = strings.TrimSuffix(strings.Trim(host, "[]"), ".")
		if a, err := netip.ParseAddr(host); err == nil {
			if documentation(a) {
				return "a documentation address"
			}
			continue
		}
		if l := strings.ToLower(host); l == "example" || strings.HasSuffix(l, ".example") {
			return "the reserved example domain .example"
		}
	}
	return ""
}

// splitPort splits host:port; ok is false when s has no port.
func splitPort(s string) (host, port string, ok bool) {
	if strings.HasPrefix(s, "[") { // [v6]:port
		if i := strings.LastIndex(s, "]:"); i >= 0 {
			return s[:i+1], s[i+2:], true
		}
		return s, "", false
	}
	if strings.Count(s, ":") != 1 {
		return s, "", false
	}
	h, p, _ := strings.Cut(s, ":")
	return h, p, true
}

func documentation(a netip.Addr) bool {
	a = a.Unmap()
	for _, n := range documentationNets {
		if n.Contains(a) {
			return true
		}
	}
	return false
}
