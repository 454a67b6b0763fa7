package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/buildq/buildq/publisher"
	"github.com/nats-io/nats.go"
	"github.com/spf13/pflag"
)

// defaultNATSURL is where `buildq dev` listens.
const defaultNATSURL = "nats://127.0.0.1:4222"

// natsFlags are the connection flags every command shares.
type natsFlags struct {
	url     string
	creds   string
	nkey    string
	tlsCA   string
	tlsCert string
	tlsKey  string
	// inboxPrefix replaces _INBOX in reply subjects: a tenant's NATS user
	// may subscribe only to its own inbox (deploy/nats: _INBOX_<tenant>).
	inboxPrefix string
	name        string
}

func (f *natsFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.url, "nats-url", defaultNATSURL, "NATS server URL(s), comma-separated (also NATS_URL)")
	fs.StringVar(&f.creds, "nats-creds", "", "NATS credentials file (JWT + nkey seed)")
	fs.StringVar(&f.nkey, "nats-nkey", "", "NATS nkey seed file")
	fs.StringVar(&f.tlsCA, "nats-tls-ca", "", "CA certificate to verify the NATS server")
	fs.StringVar(&f.tlsCert, "nats-tls-cert", "", "client certificate for NATS mutual TLS")
	fs.StringVar(&f.tlsKey, "nats-tls-key", "", "client key for NATS mutual TLS")
	fs.StringVar(&f.inboxPrefix, "inbox-prefix", "", "prefix of this connection's reply subjects instead of _INBOX; a tenant's NATS user may only read its own (deploy/nats: _INBOX_<tenant>)")
}

// envExtra maps flags to the conventional variables they also read.
var natsEnv = map[string]string{"nats-url": "NATS_URL"}

func (f *natsFlags) options(extra ...nats.Option) ([]nats.Option, error) {
	opts := []nats.Option{nats.Name(f.name), nats.Timeout(5 * time.Second)}
	if f.creds != "" {
		opts = append(opts, nats.UserCredentials(f.creds))
	}
	if f.nkey != "" {
		o, err := nats.NkeyOptionFromSeed(f.nkey)
		if err != nil {
			return nil, usageErr("--nats-nkey %s: %v", f.nkey, err)
		}
		opts = append(opts, o)
	}
	if f.tlsCA != "" {
		opts = append(opts, nats.RootCAs(f.tlsCA))
	}
	if (f.tlsCert == "") != (f.tlsKey == "") {
		return nil, usageErr("--nats-tls-cert and --nats-tls-key go together")
	}
	if f.tlsCert != "" {
		opts = append(opts, nats.ClientCert(f.tlsCert, f.tlsKey))
	}
	if f.inboxPrefix != "" {
		if strings.ContainsAny(f.inboxPrefix, "*> \t\r\n") || strings.HasPrefix(f.inboxPrefix, ".") ||
			strings.HasSuffix(f.inboxPrefix, ".") || strings.Contains(f.inboxPrefix, "..") {
			return nil, usageErr("--inbox-prefix %q: want subject tokens without wildcards or whitespace, e.g. _INBOX_acme", f.inboxPrefix)
		}
		opts = append(opts, nats.CustomInboxPrefix(f.inboxPrefix))
	}
	return append(opts, extra...), nil
}

// publisher connects as client name and returns the connection (for
// the caller to close) and the SDK's client on it.
func (f *natsFlags) publisher(name string) (*nats.Conn, *publisher.Client, error) {
	f.name = name
	nc, err := f.connect()
	if err != nil {
		return nil, nil, err
	}
	pub, err := publisher.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, failed(err)
	}
	return nc, pub, nil
}

// connect dials NATS and turns the common failure into advice.
func (f *natsFlags) connect(extra ...nats.Option) (*nats.Conn, error) {
	opts, err := f.options(extra...)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(f.url, opts...)
	if errors.Is(err, nats.ErrNoServers) {
		hint := "is `buildq dev` running?"
		if f.url != defaultNATSURL {
			hint = "check --nats-url / NATS_URL"
		}
		return nil, failed(fmt.Errorf("no NATS at %s — %s", f.url, hint))
	}
	if err != nil {
		return nil, failed(fmt.Errorf("connect to NATS at %s: %w", f.url, err))
	}
	return nc, nil
}
