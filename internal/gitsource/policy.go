package gitsource

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// Validate reports a malformed AllowedHosts or InsecureHosts entry, so
// that a worker can refuse its flags at start rather than fail every git
// source.
func (p Policy) Validate() error {
	_, err := compilePolicy(p)
	return err
}

// policy is a Policy, parsed.
type policy struct {
	allowed, insecure *hostSet
	allowPrivate      bool
}

// hostSet is a parsed list of host entries.
type hostSet struct {
	any      bool
	names    map[string]bool
	suffixes []string // ".example.com" for "*.example.com"
	prefixes []netip.Prefix
}

func compilePolicy(p Policy) (*policy, error) {
	allowed, err := parseHostSet("--allowed-git-host", p.AllowedHosts)
	if err != nil {
		return nil, err
	}
	insecure, err := parseHostSet("--insecure-git-host", p.InsecureHosts)
	if err != nil {
		return nil, err
	}
	return &policy{allowed: allowed, insecure: insecure, allowPrivate: p.AllowPrivate}, nil
}

func parseHostSet(flag string, entries []string) (*hostSet, error) {
	s := &hostSet{names: map[string]bool{}}
	for _, raw := range entries {
		e := normHost(strings.TrimSpace(raw))
		switch {
		case e == "*" && strings.TrimSpace(raw) == "*":
			s.any = true
		case e == "*":
			return nil, fmt.Errorf("%s %q: not a host name pattern", flag, raw)
		case strings.HasPrefix(e, "*."):
			if !validHostName(e[2:]) {
				return nil, fmt.Errorf("%s %q: not a host name pattern", flag, raw)
			}
			s.suffixes = append(s.suffixes, e[1:])
		case strings.Contains(e, "://"):
			return nil, fmt.Errorf("%s %q: a host, not a URL (e.g. github.com)", flag, raw)
		case strings.Contains(e, "/"):
			pfx, err := netip.ParsePrefix(e)
			if err != nil {
				return nil, fmt.Errorf("%s %q: not a CIDR (e.g. 10.0.0.0/8)", flag, raw)
			}
			s.prefixes = append(s.prefixes, unmapPrefix(pfx.Masked()))
		default:
			if a, err := netip.ParseAddr(e); err == nil {
				a = a.Unmap()
				s.prefixes = append(s.prefixes, netip.PrefixFrom(a, a.BitLen()))
				continue
			}
			if !validHostName(e) {
				return nil, fmt.Errorf("%s %q: not a host name, wildcard, IP address or CIDR", flag, raw)
			}
			s.names[e] = true
		}
	}
	return s, nil
}

// unmapPrefix turns an IPv4-mapped IPv6 prefix into its IPv4 form, as
// addresses are unmapped before they are compared.
func unmapPrefix(p netip.Prefix) netip.Prefix {
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p
}

func validHostName(h string) bool {
	if h == "" || len(h) > 253 {
		return false
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for _, c := range label {
			if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' && c != '_' {
				return false
			}
		}
	}
	return true
}

// normHost is a host as entries and URLs are compared: lower case, no
// IPv6 brackets, no trailing dot.
func normHost(h string) string {
	h = strings.ToLower(strings.TrimSuffix(strings.TrimPrefix(h, "["), "]"))
	return strings.TrimSuffix(h, ".")
}

// matchHost reports whether host (normalized) is in the set: an IP
// literal by the IP and CIDR entries, a name by the name entries.
func (s *hostSet) matchHost(host string) bool {
	if s.any {
		return true
	}
	if a, err := netip.ParseAddr(host); err == nil {
		return s.containsAddr(a)
	}
	if s.names[host] {
		return true
	}
	for _, suffix := range s.suffixes {
		if strings.HasSuffix(host, suffix) && len(host) > len(suffix) {
			return true
		}
	}
	return false
}

// containsAddr reports whether an IP or CIDR entry contains a.
func (s *hostSet) containsAddr(a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range s.prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// checkURL refuses a URL whose host is not allowed, or that is plain
// http:// to a host not allowed to be insecure. It runs before every
// connection and on every redirect hop.
func (p *policy) checkURL(u *url.URL) *Error {
	host := normHost(u.Hostname())
	if !p.allowed.matchHost(host) {
		return refuse(v1.ReasonGitHostRefused,
			fmt.Sprintf("git host %q is not allowed on this worker (--allowed-git-host)", host), nil)
	}
	if strings.EqualFold(u.Scheme, "http") && !p.insecure.matchHost(host) {
		return refuse(v1.ReasonGitHostRefused,
			fmt.Sprintf("git host %q may not be reached over plain http:// on this worker (--insecure-git-host); use https://", host), nil)
	}
	return nil
}

// specialPrefixes are address ranges other than those netip classifies
// that no git server of the public internet lives in.
var specialPrefixes = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),         // "this network"
	netip.MustParsePrefix("100.64.0.0/10"),     // shared address space (CGNAT; some clouds' metadata)
	netip.MustParsePrefix("192.0.0.0/24"),      // IETF protocol assignments
	netip.MustParsePrefix("198.18.0.0/15"),     // benchmarking
	netip.MustParsePrefix("240.0.0.0/4"),       // reserved, broadcast
	netip.MustParsePrefix("::/96"),             // IPv4-compatible (deprecated)
	netip.MustParsePrefix("64:ff9b::/96"),      // NAT64: may embed any IPv4 address
	netip.MustParsePrefix("64:ff9b:1::/48"),    // local-use NAT64
	netip.MustParsePrefix("2001:db8::/32"),     // documentation
	netip.MustParsePrefix("fec0::/10"),         // site-local (deprecated)
	netip.MustParsePrefix("100::/64"),          // discard-only
	netip.MustParsePrefix("2001:10::/28"),      // ORCHID
	netip.MustParsePrefix("2001::/32"),         // Teredo: embeds an IPv4 address
	netip.MustParsePrefix("2002::/16"),         // 6to4: embeds an IPv4 address
	netip.MustParsePrefix("ff00::/8"),          // multicast
	netip.MustParsePrefix("169.254.0.0/16"),    // link-local (also netip's)
	netip.MustParsePrefix("fd00:ec2::254/128"), // AWS metadata (also in fc00::/7)
}

// specialKind names the kind of a that is refused by default, or "".
func specialKind(a netip.Addr) string {
	a = a.Unmap()
	switch {
	case a.IsLoopback():
		return "loopback"
	case a.IsUnspecified():
		return "unspecified"
	case a.IsLinkLocalUnicast():
		return "link-local"
	case a.IsPrivate():
		return "private"
	case a.IsMulticast(), a.IsLinkLocalMulticast(), a.IsInterfaceLocalMulticast():
		return "multicast"
	}
	for _, p := range specialPrefixes {
		if p.Contains(a) {
			return "reserved"
		}
	}
	return ""
}

// refusedAddr names why a may not be dialed, or "".
func (p *policy) refusedAddr(a netip.Addr) string {
	kind := specialKind(a)
	if kind == "" || p.allowPrivate || p.allowed.containsAddr(a) {
		return ""
	}
	return kind
}

// addrRefused is the error the dialer's control hook returns for an
// address the policy refuses: the connection is never attempted.
type addrRefused struct {
	host string
	addr netip.Addr
	kind string
}

func (e *addrRefused) Error() string {
	return fmt.Sprintf("git host %q resolves to %s, a %s address this worker may not reach (--allowed-git-host)", e.host, e.addr, e.kind)
}

// dialContext connects to addr ("host:port") for the run. The address
// is checked in the dialer's control hook, that is, the very address the
// socket is about to connect to after DNS resolution, so a name that
// resolves differently on a second lookup (DNS rebinding) gains nothing.
// Every byte read from the connection is counted against MaxFetchBytes.
func (r *run) dialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", addr, err)
	}
	// The hook may run on several goroutines at once (one per address
	// family, RFC 6555), hence the atomic.
	var first atomic.Pointer[addrRefused]
	d := &net.Dialer{
		Timeout:   30 * time.Second,
		KeepAlive: 30 * time.Second,
		ControlContext: func(_ context.Context, _, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return fmt.Errorf("dial %s: unparsable address %q: %w", host, address, err)
			}
			if kind := r.pol.refusedAddr(ap.Addr()); kind != "" {
				e := &addrRefused{host: normHost(host), addr: ap.Addr().Unmap(), kind: kind}
				first.CompareAndSwap(nil, e)
				return e
			}
			return nil
		},
	}
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		// Any address refused by the policy makes the refusal the answer,
		// even if another address failed otherwise.
		if refused := first.Load(); refused != nil {
			return nil, r.fail(refuse(v1.ReasonGitHostRefused, refused.Error(), refused))
		}
		return nil, err
	}
	return &countingConn{Conn: conn, r: r}, nil
}

// countingConn counts the bytes read from a git server.
type countingConn struct {
	net.Conn
	r *run
}

// Read implements net.Conn, failing once MaxFetchBytes is crossed.
func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if total := c.r.received.Add(int64(n)); total > c.r.lim.MaxFetchBytes {
		_ = c.r.fail(tooLarge(fmt.Sprintf("more than MaxFetchBytes=%d bytes received from the git server", c.r.lim.MaxFetchBytes), errLimit))
		return 0, errLimit
	}
	return n, err
}
