package buildlog

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// capEvent is what a capturer hands a writer: a line printed by pod's
// kaniko container at ts, or (newAttempt) the move to pod, a new attempt.
type capEvent struct {
	pod        string
	attempt    int
	newAttempt bool
	ts         time.Time
	text       string
}

func (e capEvent) apply(ctx context.Context, w *Writer) error {
	if e.newAttempt {
		return w.Attempt(ctx, e.pod, e.attempt, "the pod was deleted")
	}
	return w.Line(ctx, e.pod, "kaniko", e.attempt, e.ts, []byte(e.text))
}

// followFrom is what a log follower resumed at from hands over (the rule
// of internal/kube's LogFollower): nothing of the pods before from.Pod,
// nor from.Pod's own new attempt; of from.Pod's lines, none before
// from.Time and not the first from.Count at exactly from.Time.
func followFrom(events []capEvent, from Position) []capEvent {
	if from.Pod == "" {
		return events
	}
	i := 0
	for i < len(events) && events[i].pod != from.Pod {
		i++
	}
	skipping, left := !from.Time.IsZero(), from.Count
	var out []capEvent
	for _, e := range events[i:] {
		if e.pod == from.Pod && e.newAttempt {
			continue
		}
		if skipping && e.pod == from.Pod {
			if e.ts.Before(from.Time) {
				continue
			}
			if e.ts.Equal(from.Time) && left > 0 {
				left--
				continue
			}
			skipping = false
		}
		out = append(out, e)
	}
	return out
}

// capScript is a build's output: filler short lines (shifting where the
// chunks fill up, before the first lines and before the new attempt),
// lines sharing a timestamp, lines longer than a chunk
// (stored in pieces), and a second attempt in another pod.
func capScript(filler int) []capEvent {
	var ev []capEvent
	ts := t0
	line := func(pod string, attempt int, text string) {
		ev = append(ev, capEvent{pod: pod, attempt: attempt, ts: ts, text: text})
	}
	for i := range filler {
		ts = ts.Add(time.Millisecond)
		line("p1", 1, fmt.Sprintf("filler %d", i))
	}
	for i := range 30 {
		if i%4 != 0 { // lines 4k+1..4k+3 share a time with 4k
			ts = ts.Add(time.Millisecond)
		}
		text := fmt.Sprintf("p1 line %02d %s", i, strings.Repeat("x", 90))
		if i == 12 || i == 21 {
			text = fmt.Sprintf("p1 long %02d %s", i, strings.Repeat(string(rune('a'+i%26)), 2500))
		}
		line("p1", 1, text)
	}
	for i := range filler {
		ts = ts.Add(time.Millisecond)
		line("p1", 1, fmt.Sprintf("p1 filler %d %s", i, strings.Repeat("f", 20)))
	}
	ev = append(ev, capEvent{pod: "p2", attempt: 2, newAttempt: true})
	for i := range 30 {
		ts = ts.Add(time.Millisecond)
		text := fmt.Sprintf("p2 line %02d %s", i, strings.Repeat("y", 100))
		if i == 7 {
			text = fmt.Sprintf("p2 long %02d %s", i, strings.Repeat("z", 3000))
		}
		line("p2", 2, text)
	}
	return ev
}

// Every chunk stored says where the capture stands after its own last
// line: a line that does not fit the chunk (whole, or the rest of a long
// line stored in pieces, or the attempt line of a new pod, or the cap's
// marker) is not counted as stored before it is. The rule is proved by
// its use: a writer that dies right after any chunk was stored, with
// lines still buffered, is taken over by another that resumes where the
// stored log stands, as a capturer does after a crash or a Resync; the
// log it ends holds every line once, exactly what one writer alone
// stores.
func TestWriterChunkPositionNamesItsLastLine(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	clock := func() time.Time { return t0 }
	for _, limits := range []struct {
		name string
		cap  int64
	}{{"uncapped", 0}, {"capped", 7000}} {
		for filler := range 9 {
			events := capScript(filler)
			opts := Options{ChunkBytes: 1024, FlushEvery: time.Hour, Cap: limits.cap, Now: clock}

			// One writer alone.
			run := fmt.Sprintf("%s-%d-alone", limits.name, filler)
			alone := 0
			o := opts
			o.Stored = func(int) { alone++ }
			w, err := Open(ctx, js, testKey, run, o)
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range events {
				if err := e.apply(ctx, w); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.End(ctx, "succeeded", ""); err != nil {
				t.Fatal(err)
			}
			data, _, err := r.ReadAll(ctx, testKey, run)
			if err != nil {
				t.Fatal(err)
			}
			want := texts(t, data)

			// The same output, its writer dying right after chunk k.
			for k := 1; k < alone; k++ {
				run := fmt.Sprintf("%s-%d-%d", limits.name, filler, k)
				stored := 0
				o := opts
				o.Stored = func(int) { stored++ }
				w, err := Open(ctx, js, testKey, run, o)
				if err != nil {
					t.Fatal(err)
				}
				for _, e := range events {
					if err := e.apply(ctx, w); err != nil {
						t.Fatal(err)
					}
					if stored >= k {
						break
					}
				}
				// w is gone, with what it buffered; its successor resumes
				// at the stored position.
				w2, err := Open(ctx, js, testKey, run, opts)
				if err != nil {
					t.Fatal(err)
				}
				from := w2.Position()
				for _, e := range followFrom(events, from) {
					if err := e.apply(ctx, w2); err != nil {
						t.Fatal(err)
					}
				}
				if err := w2.End(ctx, "succeeded", ""); err != nil {
					t.Fatal(err)
				}
				data, _, err := r.ReadAll(ctx, testKey, run)
				if err != nil {
					t.Fatal(err)
				}
				if got := texts(t, data); strings.Join(got, "\n") != strings.Join(want, "\n") {
					t.Errorf("%s, %d filler lines: taken over after chunk %d at %+v: %s", limits.name, filler, k, from, firstDiff(got, want))
					break // one report per output
				}
			}
		}
	}
}

// firstDiff says where two logs' lines part.
func firstDiff(got, want []string) string {
	short := func(s string) string {
		if len(s) > 40 {
			return s[:40] + fmt.Sprintf("…(%d bytes)", len(s))
		}
		return s
	}
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return fmt.Sprintf("line %d is %q, want %q (%d lines, want %d)", i, short(got[i]), short(want[i]), len(got), len(want))
		}
	}
	return fmt.Sprintf("%d lines, want %d", len(got), len(want))
}

// The stored part of a long line is skipped only when the resumed capture
// hands that very line over again: another line (its pod was lost) is
// stored whole.
func TestWriterPartOfALineIsSkippedOnlyForThatLine(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	opts := Options{ChunkBytes: 1024, FlushEvery: time.Hour, Now: func() time.Time { return t0 }}
	w, err := Open(ctx, js, testKey, "r1", opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Line(ctx, "p1", "kaniko", 1, t0, []byte("first")); err != nil { // stored at once
		t.Fatal(err)
	}
	long := strings.Repeat("L", 3000)
	if err := w.Line(ctx, "p1", "kaniko", 1, t0.Add(time.Second), []byte(long)); err != nil {
		t.Fatal(err)
	}
	// Its first pieces are stored, the last one buffered: w dies here.
	w2, err := Open(ctx, js, testKey, "r1", opts)
	if err != nil {
		t.Fatal(err)
	}
	if p := w2.Position(); p.Pod != "p1" || !p.Time.Equal(t0.Add(time.Second)) || p.Count != 0 {
		t.Fatalf("position %+v: want just before the long line (its time, count 0)", p)
	}
	if err := w2.Line(ctx, "p2", "kaniko", 2, t0.Add(2*time.Second), []byte("other")); err != nil {
		t.Fatal(err)
	}
	if err := w2.End(ctx, "succeeded", ""); err != nil {
		t.Fatal(err)
	}
	data, _, err := r.ReadAll(ctx, testKey, "r1")
	if err != nil {
		t.Fatal(err)
	}
	got := texts(t, data)
	if n := len(got); n < 3 || got[n-2] != "kaniko other" || got[n-1] != "buildq build succeeded" {
		t.Fatalf("lines %q", got)
	}
}
