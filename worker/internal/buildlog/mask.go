package buildlog

import (
	"bytes"
	"strings"
)

// Secret build argument values are masked before a line is stored.

// maskValues are the strings to mask for secret values: each non-empty
// value, and each line (of 4 bytes or more) of a value that holds
// several, since an executor prints such a value a line at a time.
func maskValues(secrets []string) []string {
	seen := map[string]bool{}
	var out []string
	add := func(v string) {
		if v != "" && !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	for _, v := range secrets {
		if !strings.ContainsAny(v, "\r\n") {
			add(v)
			continue
		}
		for _, line := range strings.FieldsFunc(v, func(r rune) bool { return r == '\n' || r == '\r' }) {
			if len(line) >= 4 {
				add(line)
			}
		}
	}
	return out
}

func (w *Writer) mask(text []byte) []byte { return maskBytes(text, w.opts.Mask) }

// Mask masks secret values in text as a writer does.
func Mask(text []byte, secrets []string) []byte { return maskBytes(text, maskValues(secrets)) }

// maskBytes replaces every byte of text that any of masks covers with
// "***", one per run of covered bytes: overlapping and nested secrets are
// masked whole, whatever their order.
func maskBytes(text []byte, masks []string) []byte {
	if len(masks) == 0 {
		return text
	}
	var covered []bool
	for _, m := range masks {
		for from := 0; from < len(text); {
			i := bytes.Index(text[from:], []byte(m))
			if i < 0 {
				break
			}
			if covered == nil {
				covered = make([]bool, len(text))
			}
			for j := from + i; j < from+i+len(m); j++ {
				covered[j] = true
			}
			from += i + 1
		}
	}
	if covered == nil {
		return text
	}
	out := make([]byte, 0, len(text))
	for i := 0; i < len(text); i++ {
		if !covered[i] {
			out = append(out, text[i])
			continue
		}
		out = append(out, "***"...)
		for i+1 < len(text) && covered[i+1] {
			i++
		}
	}
	return out
}
