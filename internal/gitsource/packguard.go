package gitsource

import (
	"bufio"
	"cmp"
	"compress/zlib"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
)

// Pack objects' types, as the pack format numbers them.
const (
	objCommit   = 1
	objTag      = 4
	objOFSDelta = 6
	objREFDelta = 7
)

// maxDeltaDepth caps a pack's chains of deltas: the most deltas between
// an object and the whole object it is rebuilt from. It is git's default
// pack.depth, which upload-pack keeps to unless its server is configured
// otherwise (since git 2.13 also when it reuses deltas stored deeper).
const maxDeltaDepth = 50

// packHeaderSize is the bytes before a pack's first object.
const packHeaderSize = 12

// ingest streams one pack from src (display's answer; ofsDelta says the
// request asked for ofs-delta) into the object store. A pack is a zip
// bomb's natural shape (a blob of gigabytes of zeros deflates to a few
// megabytes; a delta can claim any size; a pack header any number of
// objects), and go-git's indexer holds each object whole in memory, so
// the pack is checked object by object on its way in, before go-git sees
// more than that: the object count against MaxObjects, each object's
// inflated size (for a delta, the size it claims to produce) against
// MaxObjectBytes, chains of deltas against maxDeltaDepth, and what go-git
// may inflate and rebuild to index the objects (see deltaCost) against
// MaxExpandedBytes. Each object is inflated here to find where it ends
// and to check it inflates to no more than its header says; the bytes go
// on to go-git's pack writer as read.
//
// go-git indexes the pack inside the pack writer's Close, which takes no
// context: its work is bounded by the limits checked here, and the
// Timeout reaches it through the store's files (ctxFS), which fail every
// read once the Fetch's context ends.
func (r *run) ingest(ctx context.Context, src io.Reader, display string, ofsDelta bool) error {
	pw, err := r.st.PackfileWriter()
	if err != nil {
		return transient("store the pack", err)
	}
	bw := bufio.NewWriterSize(pw, 256<<10)
	g := &packGuard{r: r, ctx: ctx, display: display, ofsDelta: ofsDelta,
		in: &teeReader{r: bufio.NewReaderSize(src, 256<<10), w: bw}}
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
	r        *run
	ctx      context.Context
	display  string
	ofsDelta bool
	in       *teeReader
	zr       io.ReadCloser
	// objs are the objects read so far, in pack order (so by offset),
	// for the deltas that name them as their base.
	objs []placed
}

// placed is an object of the pack being read.
type placed struct {
	off   int64 // where its header starts in the pack
	cost  int64 // the bytes rebuilding it from nothing inflates and writes
	depth int32 // deltas between it and a whole object (0: it is whole)
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
		return r.fail(tooMany(fmt.Sprintf("the git server is sending %d objects, more than MaxObjects=%d allows (%d fetched before)",
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
	start := g.in.n
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
	var base *placed
	switch typ {
	case objCommit, 2, 3, objTag:
	case objOFSDelta:
		if base, err = g.deltaBase(start); err != nil {
			return err
		}
	case objREFDelta:
		return g.refDelta()
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
	obj := placed{off: start, cost: int64(size)}
	charge := obj.cost
	if base != nil {
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
		obj.depth = base.depth + 1
		obj.cost, charge = deltaCost(base, int64(size), int64(target))
	}
	if charge > lim.MaxExpandedBytes-g.r.expanded {
		return g.r.fail(tooLarge(fmt.Sprintf("the fetched objects expand to more than MaxExpandedBytes=%d bytes "+
			"(a delta counted with the chain of deltas it is rebuilt from)", lim.MaxExpandedBytes), nil))
	}
	g.r.expanded += charge
	if _, err := io.Copy(io.Discard, body); err != nil {
		return readError("an object", err)
	}
	if body.N != 1 {
		return fmt.Errorf("%w: an object inflates to other than the %d bytes its header says", errCorrupt, size)
	}
	g.objs = append(g.objs, obj)
	return nil
}

// deltaCost is what go-git's indexing may spend on a delta of size bytes
// that makes an object of target bytes from base. go-git rebuilds each
// delta by first rebuilding its base, through a cache that a pack of
// interleaved chains defeats: at worst every delta is rebuilt from the
// whole object at the start of its chain, inflating and writing every
// object along the way (cost). Counting each object's size once would let
// a pack of a few hundred kilobytes declaring less than MaxExpandedBytes
// keep go-git busy for minutes: cost grows with the square of a chain's
// depth. charge is cost, and for a delta on a whole object once more its
// own bytes: go-git applies those a second time, right after their base.
func deltaCost(base *placed, size, target int64) (cost, charge int64) {
	own := addCapped(size, target)
	cost = addCapped(base.cost, own)
	charge = cost
	if base.depth == 0 {
		charge = addCapped(charge, own)
	}
	return cost, charge
}

// addCapped adds sizes without wrapping around.
func addCapped(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// deltaBase reads an OFS_DELTA's base offset (git's encoding: 7 bits a
// byte, big end first, each continuation adding one) and finds the object
// there, which must be an earlier object of this pack, fewer than
// maxDeltaDepth deltas deep.
func (g *packGuard) deltaBase(start int64) (*placed, error) {
	var off uint64
	for i := 0; ; i++ {
		b, err := g.in.ReadByte()
		if err != nil {
			return nil, readError("a delta offset", err)
		}
		off |= uint64(b & 0x7f)
		if b&0x80 == 0 {
			break
		}
		if i == 9 || off >= uint64(start) {
			return nil, fmt.Errorf("%w: delta offset too long", errCorrupt)
		}
		off = (off + 1) << 7
	}
	if off == 0 || off > uint64(start-packHeaderSize) {
		return nil, fmt.Errorf("%w: a delta's base offset %d is outside the pack", errCorrupt, off)
	}
	at := start - int64(off)
	i, found := slices.BinarySearchFunc(g.objs, at, func(p placed, off int64) int { return cmp.Compare(p.off, off) })
	if !found {
		return nil, fmt.Errorf("%w: a delta's base at offset %d is not an object of the pack", errCorrupt, at)
	}
	base := &g.objs[i]
	if base.depth >= maxDeltaDepth {
		return nil, g.r.fail(tooDeep(fmt.Sprintf("a chain of deltas is deeper than the limit of %d deltas "+
			"(git's default pack.depth)", maxDeltaDepth), nil))
	}
	return base, nil
}

// refDelta refuses a REF_DELTA, a delta whose base is named by its hash:
// the guard cannot tell where such a base is, hence what rebuilding the
// delta costs, without rebuilding every delta itself. buildq never asks
// for a thin pack and asks for ofs-delta whenever the server offers it,
// so an honest server sends none.
func (g *packGuard) refDelta() error {
	if g.ofsDelta {
		return g.r.fail(invalid(fmt.Sprintf("%s sent a delta against an object named by its hash (REF_DELTA) "+
			"although it agreed to send deltas by offset (ofs-delta)", g.display)))
	}
	return g.r.fail(invalid(fmt.Sprintf("%s does not offer ofs-delta and sent a delta against an object named by its hash "+
		"(REF_DELTA), which buildq does not accept", g.display)))
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

// teeReader passes every byte it reads on to w, counting them. It is an
// io.ByteReader, so the zlib reader consumes exactly one object's stream
// from it and nothing of the next.
type teeReader struct {
	r *bufio.Reader
	w *bufio.Writer
	n int64 // bytes read: the pack offset of the next byte
}

// ReadByte implements io.ByteReader.
func (t *teeReader) ReadByte() (byte, error) {
	b, err := t.r.ReadByte()
	if err != nil {
		return 0, err
	}
	t.n++
	if err := t.w.WriteByte(b); err != nil {
		return 0, transient("store the pack", err)
	}
	return b, nil
}

// Read implements io.Reader.
func (t *teeReader) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	t.n += int64(n)
	if n > 0 {
		if _, werr := t.w.Write(p[:n]); werr != nil {
			return n, transient("store the pack", werr)
		}
	}
	return n, err
}
