package localexec

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/buildq/buildq/internal/units"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
)

// The step log (Options.Log) tells a person what the build did, one line per
// step. Instructions are echoed as written — never expanded — so build-arg
// values (often tokens) cannot reach the log; what was resolved from them
// shows only as digests and platforms. Formats:
//
//	ARG TAG=v1                                  as written (also ARGs before FROM)
//	FROM <base as written> [AS name] (sha256:<manifest>, os/arch)   registry base
//	FROM <base as written> [AS name] (stage <name|index>)           earlier stage
//	FROM scratch [AS name]
//	ENV … / LABEL … / WORKDIR … / USER … / CMD … / …   as written
//	COPY <as written>: <n> file(s), <bytes>
//	COPY --from=… <as written>: <n> file(s), <bytes> from stage <name|index>
//	COPY --from=… <as written>: <n> file(s), <bytes> from image <ref> (sha256:<manifest>)
//	ONBUILD trigger <instruction…>              a trigger inherited from the base
//	layer sha256:<digest> (<compressed size>)   after the instruction that made it
//	built image sha256:<manifest digest> for <os/arch>
//
// Instruction text is on one line, whitespace collapsed, cut at
// maxInstructionRunes. Stages are built when first needed, so the steps of
// a stage used by COPY --from come before that COPY; a stage's FROM line
// waits for its first step so that such steps do not separate the two.

// maxInstructionRunes bounds the instruction text echoed in a log line.
const maxInstructionRunes = 120

// logging reports whether anyone listens, so callers skip the work of
// preparing a line (digests, counts) when not.
func (b *builder) logging() bool { return b.opts.Log != nil }

// logf sends one line to Options.Log, made safe to store as a log line.
func (b *builder) logf(format string, args ...any) {
	if b.opts.Log == nil {
		return
	}
	b.opts.Log(oneLine(fmt.Sprintf(format, args...)))
}

// stepf logs a step of stage s, after the stage's FROM line if that is
// still pending.
func (b *builder) stepf(s *stageState, format string, args ...any) {
	if b.opts.Log == nil {
		return
	}
	b.flushFrom(s)
	b.logf(format, args...)
}

// flushFrom logs the FROM line of s if it has not been yet. The line waits
// for the stage's first step because a COPY --from builds the stage it
// copies from only when it gets there: logging FROM at once would put the
// other stage's lines between this FROM and its first step.
func (b *builder) flushFrom(s *stageState) {
	if s.pendingFrom != "" {
		line := s.pendingFrom
		s.pendingFrom = ""
		b.logf("%s", line)
	}
}

// oneLine replaces control characters (newlines above all) and Unicode
// line separators with spaces.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) || r == '\u2028' || r == '\u2029' {
			return ' '
		}
		return r
	}, s)
}

// instructionText is an instruction as written, on one line with its
// whitespace collapsed (continuations, heredoc markers) and cut short when
// very long.
func instructionText(s string) string {
	s = strings.Join(strings.Fields(oneLine(s)), " ")
	if utf8.RuneCountInString(s) <= maxInstructionRunes {
		return s
	}
	r := []rune(s)
	return string(r[:maxInstructionRunes-1]) + "…"
}

// stepText is the text of a stage command as written, marked when it is an
// ONBUILD trigger inherited from the base image.
func stepText(s *stageState, text string) string {
	t := instructionText(text)
	if s.inTrigger {
		return "ONBUILD trigger " + t
	}
	return t
}

// logMetaArgs reports the ARGs before the first FROM.
func (b *builder) logMetaArgs(metaArgs []instructions.ArgCommand) {
	if !b.logging() {
		return
	}
	for i := range metaArgs {
		b.logf("%s", instructionText(metaArgs[i].String()))
	}
}

// logFrom prepares the line for the start of a stage: its FROM as written,
// and what the base resolved to (never the expanded name, which may come
// from a build arg). It is logged with the stage's first step (flushFrom).
func (b *builder) logFrom(st instructions.Stage, s *stageState, parent *stageState, base v1.Image) {
	if !b.logging() {
		return
	}
	var sb strings.Builder
	sb.WriteString("FROM ")
	if st.Platform != "" {
		sb.WriteString("--platform=" + st.Platform + " ")
	}
	sb.WriteString(st.BaseName)
	if st.Name != "" {
		sb.WriteString(" AS " + st.Name)
	}
	text := instructionText(sb.String())
	switch {
	case parent != nil:
		s.pendingFrom = fmt.Sprintf("%s (stage %s)", text, stageLabel(parent))
	case base != nil:
		if d, err := base.Digest(); err == nil {
			s.pendingFrom = fmt.Sprintf("%s (%s, %s)", text, d, s.platform.String())
		} else {
			s.pendingFrom = fmt.Sprintf("%s (%s)", text, s.platform.String())
		}
	default:
		s.pendingFrom = text
	}
}

// stageLabel names a stage as the Dockerfile does: by name, else by index.
func stageLabel(s *stageState) string {
	if s.name != "" {
		return s.name
	}
	return fmt.Sprint(s.index)
}

// logCopy reports a COPY or ADD once its layer is assembled: what was
// written in the Dockerfile, and how many non-directory entries and bytes
// of file content the layer holds.
func (b *builder) logCopy(s *stageState, c copyParams, op *copyOp) {
	if !b.logging() {
		return
	}
	files, size := 0, int64(0)
	for _, n := range op.layer.entries {
		if n.typ == typeDir {
			continue
		}
		files++
		if n.typ == typeReg {
			size += n.size
		}
	}
	noun := "files"
	if files == 1 {
		noun = "file"
	}
	line := fmt.Sprintf("%s: %d %s, %s", stepText(s, c.original), files, noun, units.Bytes(size))
	if c.from != "" {
		line += " from " + b.fromLabel(s, c.from)
	}
	b.stepf(s, "%s", line)
}

// fromLabel describes the source of a COPY --from, which is written
// literally in the Dockerfile (fromSource refuses variables there): a stage,
// or an image with the digest it resolved to.
func (b *builder) fromLabel(s *stageState, from string) string {
	if j, ok := b.earlierStage(from, s.index); ok && b.built[j] != nil {
		return "stage " + stageLabel(b.built[j])
	}
	if img, ok := b.pulled[from+"|"+s.platform.String()]; ok {
		if d, err := img.Digest(); err == nil {
			return fmt.Sprintf("image %s (%s)", from, d)
		}
	}
	return "image " + from
}

// logLayer reports a new layer by its (compressed) digest and size.
func (b *builder) logLayer(s *stageState, l v1.Layer) {
	if !b.logging() {
		return
	}
	d, err := l.Digest()
	if err != nil {
		b.stepf(s, "layer (digest unavailable: %v)", err)
		return
	}
	size, err := l.Size()
	if err != nil {
		b.stepf(s, "layer %s", d)
		return
	}
	b.stepf(s, "layer %s (%s)", d, units.Bytes(size))
}
