package gitsource

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/format/pktline"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp/capability"

	v1 "github.com/buildq/buildq/api/v1"
)

// This file speaks version 0 of git's pack protocol (the one every server
// speaks, over smart HTTP and SSH alike) with go-git's encoders: one ref
// advertisement, then upload-pack requests that each name their wants and
// a depth, send no haves (every Fetch starts from an empty store) and
// end with "done", so each answer is a NAK (after any shallow lines)
// followed by the pack, multiplexed on sideband channel 1.

// maxAdvertisement bounds a ref advertisement: go-git keeps every
// advertised ref in maps, at several times its bytes.
const maxAdvertisement = 16 << 20

// agent is the agent capability buildq announces.
const agent = "buildq"

// remote is one repository's git server.
type remote interface {
	// advertise returns the server's ref advertisement; it asks once.
	advertise(ctx context.Context) (*packp.AdvRefs, error)
	// uploadPack sends one upload-pack request (after the advertisement)
	// and returns the server's answer.
	uploadPack(ctx context.Context, body []byte) (io.ReadCloser, error)
	// close ends the conversation.
	close() error
}

// uploadRequest is what one upload-pack exchange asks for.
type uploadRequest struct {
	wants []plumbing.Hash
	// depth is the commits of history wanted from each want (0 = all);
	// it is dropped when the server cannot make shallow packs.
	depth int
	// filter omits objects ("blob:none") when the server can.
	filter packp.Filter
}

// encoded is an upload-pack request body and the shape of its answer.
type encoded struct {
	body     []byte
	shallow  bool // the answer starts with a shallow-update section
	sideband bool // the pack comes multiplexed
	ofsDelta bool // deltas come against offsets in the pack, not hashes
}

// encode writes q for a server advertising caps.
func (q uploadRequest) encode(caps *capability.List) (encoded, error) {
	req := packp.NewUploadRequest()
	var out encoded
	var setErr error
	set := func(c capability.Capability, values ...string) {
		if err := req.Capabilities.Set(c, values...); err != nil && setErr == nil {
			setErr = err
		}
	}
	switch {
	case caps.Supports(capability.Sideband64k):
		set(capability.Sideband64k)
		out.sideband = true
	case caps.Supports(capability.Sideband):
		set(capability.Sideband)
		out.sideband = true
	}
	// Deltas by offset, which the pack guard can place, and never a thin
	// pack: every delta's base is in the same pack.
	if caps.Supports(capability.OFSDelta) {
		set(capability.OFSDelta)
		out.ofsDelta = true
	}
	if caps.Supports(capability.NoProgress) {
		set(capability.NoProgress)
	}
	if caps.Supports(capability.Agent) {
		set(capability.Agent, agent)
	}
	if q.depth > 0 && caps.Supports(capability.Shallow) {
		set(capability.Shallow)
		req.Depth = packp.DepthCommits(q.depth)
		out.shallow = true
	}
	if q.filter != "" && caps.Supports(capability.Filter) {
		set(capability.Filter)
		req.Filter = q.filter
	}
	if setErr != nil {
		return out, fmt.Errorf("encode the upload-pack request: %w", setErr)
	}
	req.Wants = append(req.Wants, q.wants...)
	var buf bytes.Buffer
	if err := req.Encode(&buf); err != nil {
		return out, fmt.Errorf("encode the upload-pack request: %w", err)
	}
	if err := pktline.NewEncoder(&buf).EncodeString("done\n"); err != nil {
		return out, fmt.Errorf("encode the upload-pack request: %w", err)
	}
	out.body = buf.Bytes()
	return out, nil
}

// decodeAdvertisement reads a ref advertisement (with or without smart
// HTTP's "# service" prefix).
func decodeAdvertisement(rd io.Reader, display string) (*packp.AdvRefs, error) {
	lr := &io.LimitedReader{R: rd, N: maxAdvertisement + 1}
	ar := packp.NewAdvRefs()
	if err := ar.Decode(lr); err != nil {
		var el *pktline.ErrorLine
		switch {
		case lr.N <= 0:
			return nil, tooLarge(fmt.Sprintf("%s advertises more than %d MiB of refs", display, maxAdvertisement>>20), nil)
		case errors.As(err, &el):
			return nil, refuse(v1.ReasonGitAuthFailed,
				fmt.Sprintf("%s refused to list its refs: %s", display, serverWords(el.Text)), &serverError{text: el.Text})
		case errors.Is(err, packp.ErrEmptyAdvRefs):
			return nil, refuse(v1.ReasonGitRefNotFound, display+" is an empty repository", err)
		case errors.Is(err, packp.ErrEmptyInput):
			return nil, io.ErrUnexpectedEOF
		}
		return nil, fmt.Errorf("read the ref advertisement of %s: %w", display, err)
	}
	if ar.IsEmpty() {
		return nil, refuse(v1.ReasonGitRefNotFound, display+" is an empty repository", nil)
	}
	for _, f := range ar.Capabilities.Get(capability.ObjectFormat) {
		if f != "sha1" {
			return nil, invalid(fmt.Sprintf("%s is a %s repository; only SHA-1 repositories are supported", display, f))
		}
	}
	return ar, nil
}

// readResponse reads the answer to an upload-pack request up to its
// pack, which it returns (demultiplexed). The server's words before the
// pack are its answer to the request (serverError.early).
func readResponse(body io.Reader, e encoded) (io.Reader, error) {
	pack, err := readPreamble(body, e)
	var se *serverError
	if errors.As(err, &se) {
		return nil, &serverError{text: se.text, early: true}
	}
	return pack, err
}

func readPreamble(body io.Reader, e encoded) (io.Reader, error) {
	br := bufio.NewReaderSize(body, 64<<10)
	sc := pktline.NewScanner(br)
	if e.shallow {
		for {
			if !sc.Scan() {
				return nil, pktError(sc.Err())
			}
			line := sc.Bytes()
			if len(line) == 0 {
				break
			}
			if !bytes.HasPrefix(line, []byte("shallow ")) && !bytes.HasPrefix(line, []byte("unshallow ")) {
				return nil, fmt.Errorf("unexpected line in the shallow list: %q", truncate(string(line), 80))
			}
		}
	}
	for first := true; ; first = false {
		if !first {
			// Some servers repeat ACK/NAK; the pack never starts so.
			p, _ := br.Peek(8)
			if len(p) < 8 || (!bytes.Equal(p[4:7], []byte("ACK")) && !bytes.Equal(p[4:7], []byte("NAK"))) {
				break
			}
		}
		if !sc.Scan() {
			return nil, pktError(sc.Err())
		}
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte("NAK")) && !bytes.HasPrefix(line, []byte("ACK ")) {
			return nil, fmt.Errorf("unexpected line before the pack: %q", truncate(string(line), 80))
		}
	}
	if e.sideband {
		return &demux{sc: sc}, nil
	}
	return br, nil
}

// pktError turns a pkt-line scanner's error into this package's.
func pktError(err error) error {
	var el *pktline.ErrorLine
	switch {
	case err == nil:
		return io.ErrUnexpectedEOF
	case errors.As(err, &el):
		return &serverError{text: serverWords(el.Text)}
	}
	return fmt.Errorf("read the git server's answer: %w", err)
}

// demux reads the pack from a side-band(-64k) stream: channel 1 is the
// pack, 2 progress (dropped), 3 a fatal error in the server's words.
type demux struct {
	sc      *pktline.Scanner
	pending []byte
	done    bool
}

// Read implements io.Reader.
func (d *demux) Read(p []byte) (int, error) {
	for len(d.pending) == 0 {
		if d.done || !d.sc.Scan() {
			d.done = true
			if err := d.sc.Err(); err != nil {
				return 0, pktError(err)
			}
			return 0, io.EOF
		}
		line := d.sc.Bytes()
		switch {
		case len(line) == 0:
			d.done = true
		case line[0] == 1:
			d.pending = line[1:]
		case line[0] == 2:
		case line[0] == 3:
			return 0, &serverError{text: serverWords(string(line[1:]))}
		default:
			return 0, fmt.Errorf("unknown sideband channel %d", line[0])
		}
	}
	n := copy(p, d.pending)
	d.pending = d.pending[n:]
	return n, nil
}

// fetchPack runs one upload-pack exchange with rem and stores its pack.
func (r *run) fetchPack(ctx context.Context, rp *repo, q uploadRequest) error {
	e, err := q.encode(rp.adv.Capabilities)
	if err != nil {
		return err
	}
	rc, err := rp.rem.uploadPack(ctx, e.body)
	if err != nil {
		return err
	}
	defer func() { _ = rc.Close() }()
	pack, err := readResponse(rc, e)
	if err != nil {
		return err
	}
	return r.ingest(ctx, pack, rp.display, e.ofsDelta)
}

// refusedWant reports whether err is the server declining a request
// (such as a want it does not have or will not serve by hash), as
// opposed to trouble on the way or a limit.
func refusedWant(err error) (string, bool) {
	var se *serverError
	if errors.As(err, &se) && se.early {
		return se.text, true
	}
	return "", false
}

// looksNotFound reports whether a server's words (an SSH server's
// stderr, the only channel it has) say the repository is missing or
// hidden, as GitHub, GitLab, Bitbucket and git itself word it.
func looksNotFound(words string) bool {
	w := strings.ToLower(words)
	for _, s := range []string{"not found", "does not exist", "does not appear to be a git repository",
		"access denied", "permission denied", "no such repository", "could not be found"} {
		if strings.Contains(w, s) {
			return true
		}
	}
	return false
}
