package gitsource

import (
	"bufio"
	"compress/zlib"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Pack objects' types, as the pack format numbers them.
const (
	objCommit   = 1
	objTag      = 4
	objOFSDelta = 6
	objREFDelta = 7
)

// ingest streams one pack from src into the object store. A pack is a
// zip bomb's natural shape (a blob of gigabytes of zeros deflates to a few
// megabytes; a delta can claim any size; a pack header any number of
// objects), and go-git's indexer holds each object whole in memory, so
// the pack is checked object by object on its way in, before go-git sees
// more than that: the object count against MaxObjects, each object's
// inflated size (for a delta, the size it claims to produce) against
// MaxObjectBytes, their sum against MaxExpandedBytes. Each object is
// inflated here to find where it ends and to check it inflates to no more
// than its header says; the bytes go on to go-git's pack writer as read.
func (r *run) ingest(ctx context.Context, src io.Reader) error {
	pw, err := r.st.PackfileWriter()
	if err != nil {
		return transient("store the pack", err)
	}
	bw := bufio.NewWriterSize(pw, 256<<10)
	g := &packGuard{r: r, ctx: ctx, in: &teeReader{r: bufio.NewReaderSize(src, 256<<10), w: bw}}
	gerr := g.run()
	if gerr == nil {
		if err := bw.Flush(); err != nil {
			gerr = transient("store the pack", err)
		}
	}
	// Close waits for go-git to finish indexing what it was given; after
	// a refusal that is a truncated pack, which it discards.
	cerr := pw.Close()
	if gerr != nil {
		return gerr
	}
	if cerr != nil {
		return fmt.Errorf("index the pack: %w", cerr)
	}
	return nil
}

// packGuard reads one pack, checking it as ingest describes.
type packGuard struct {
	r   *run
	ctx context.Context
	in  *teeReader
	zr  io.ReadCloser
}

// errCorrupt marks a pack that does not follow the pack format.
var errCorrupt = errors.New("corrupt pack")

func (g *packGuard) run() error {
	r := g.r
	var hdr [12]byte
	if _, err := io.ReadFull(g.in, hdr[:]); err != nil {
		return readError("the pack header", err)
	}
	if string(hdr[:4]) != "PACK" {
		return fmt.Errorf("%w: the git server's answer is not a pack", errCorrupt)
	}
	if v := binary.BigEndian.Uint32(hdr[4:8]); v != 2 && v != 3 {
		return fmt.Errorf("%w: pack version %d", errCorrupt, v)
	}
	count := int64(binary.BigEndian.Uint32(hdr[8:12]))
	if r.objects+count > int64(r.lim.MaxObjects) {
		return r.fail(tooLarge(fmt.Sprintf("the git server is sending %d objects, more than MaxObjects=%d allows (%d fetched before)",
			count, r.lim.MaxObjects, r.objects), nil))
	}
	base := r.objects
	r.objects += count
	for i := range count {
		if err := g.ctx.Err(); err != nil {
			return err
		}
		if err := g.object(); err != nil {
			return err
		}
		r.emitThrottled(Progress{Step: StepFetching, Bytes: r.received.Load(), Objects: base + i + 1})
	}
	var trailer [20]byte
	if _, err := io.ReadFull(g.in, trailer[:]); err != nil {
		return readError("the pack trailer", err)
	}
	r.emit(Progress{Step: StepFetching, Bytes: r.received.Load(), Objects: r.objects,
		Message: fmt.Sprintf("received %d objects, %d bytes", count, r.received.Load())})
	return nil
}

// object checks and passes on one object.
func (g *packGuard) object() error {
	lim := g.r.lim
	b, err := g.in.ReadByte()
	if err != nil {
		return readError("an object header", err)
	}
	typ := (b >> 4) & 7
	size := uint64(b & 0x0f)
	for shift := uint(4); b&0x80 != 0; shift += 7 {
		if shift > 57 {
			return fmt.Errorf("%w: object header too long", errCorrupt)
		}
		if b, err = g.in.ReadByte(); err != nil {
			return readError("an object header", err)
		}
		size |= uint64(b&0x7f) << shift
	}
	switch typ {
	case objCommit, 2, 3, objTag:
	case objOFSDelta:
		for i := 0; ; i++ {
			if b, err = g.in.ReadByte(); err != nil {
				return readError("a delta offset", err)
			}
			if b&0x80 == 0 {
				break
			}
			if i == 9 {
				return fmt.Errorf("%w: delta offset too long", errCorrupt)
			}
		}
	case objREFDelta:
		var base [20]byte
		if _, err := io.ReadFull(g.in, base[:]); err != nil {
			return readError("a delta base", err)
		}
	default:
		return fmt.Errorf("%w: object type %d", errCorrupt, typ)
	}
	if size > uint64(lim.MaxObjectBytes) {
		return g.r.fail(tooLarge(fmt.Sprintf("an object of %d bytes is over MaxObjectBytes=%d", size, lim.MaxObjectBytes), nil))
	}
	if err := g.resetInflater(); err != nil {
		return err
	}
	body := &io.LimitedReader{R: g.zr, N: int64(size) + 1}
	expands := size
	if typ == objOFSDelta || typ == objREFDelta {
		if _, err := readUvarint(body); err != nil {
			return readError("a delta", err)
		}
		target, err := readUvarint(body)
		if err != nil {
			return readError("a delta", err)
		}
		if target > uint64(lim.MaxObjectBytes) {
			return g.r.fail(tooLarge(fmt.Sprintf("a delta claims an object of %d bytes, over MaxObjectBytes=%d", target, lim.MaxObjectBytes), nil))
		}
		expands = target
	}
	g.r.expanded += int64(expands)
	if g.r.expanded > lim.MaxExpandedBytes {
		return g.r.fail(tooLarge(fmt.Sprintf("the fetched objects expand to more than MaxExpandedBytes=%d bytes", lim.MaxExpandedBytes), nil))
	}
	if _, err := io.Copy(io.Discard, body); err != nil {
		return readError("an object", err)
	}
	if body.N != 1 {
		return fmt.Errorf("%w: an object inflates to other than the %d bytes its header says", errCorrupt, size)
	}
	return nil
}

// resetInflater points the zlib reader at the next object.
func (g *packGuard) resetInflater() error {
	if g.zr == nil {
		zr, err := zlib.NewReader(g.in)
		if err != nil {
			return readError("an object", err)
		}
		g.zr = zr
		return nil
	}
	if err := g.zr.(zlib.Resetter).Reset(g.in, nil); err != nil {
		return readError("an object", err)
	}
	return nil
}

// readError wraps an error met reading the pack; an early end is told
// apart from the server's words and from limits, which pass unchanged.
func readError(what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: the pack ended early, in %s", errCorrupt, what)
	}
	return fmt.Errorf("read %s: %w", what, err)
}

// readUvarint reads a delta header's size (7 bits a byte, little end
// first) one byte at a time, so as not to read past it.
func readUvarint(r io.Reader) (uint64, error) {
	var v uint64
	var b [1]byte
	for shift := uint(0); ; shift += 7 {
		if shift > 63 {
			return 0, fmt.Errorf("%w: delta size too long", errCorrupt)
		}
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return 0, err
		}
		v |= uint64(b[0]&0x7f) << shift
		if b[0]&0x80 == 0 {
			return v, nil
		}
	}
}

// teeReader passes every byte it reads on to w. It is an io.ByteReader,
// so the zlib reader consumes exactly one object's stream from it and
// nothing of the next.
type teeReader struct {
	r *bufio.Reader
	w *bufio.Writer
}

// ReadByte implements io.ByteReader.
func (t *teeReader) ReadByte() (byte, error) {
	b, err := t.r.ReadByte()
	if err != nil {
		return 0, err
	}
	if err := t.w.WriteByte(b); err != nil {
		return 0, transient("store the pack", err)
	}
	return b, nil
}

// Read implements io.Reader.
func (t *teeReader) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	if n > 0 {
		if _, werr := t.w.Write(p[:n]); werr != nil {
			return n, transient("store the pack", werr)
		}
	}
	return n, err
}
