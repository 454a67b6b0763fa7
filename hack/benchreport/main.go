// Command benchreport renders the end-to-end benchmark results (one
// internal/benchfmt JSON file per figure, written by make bench-e2e and
// make bench-scale) into docs/benchmarks.md and the latency-against-load
// plot docs/benchmarks.svg.
//
//	go run ./hack/benchreport -in docs/benchmarks -md docs/benchmarks.md -svg docs/benchmarks.svg
//
// The page depends only on the results: the same files give the same
// bytes.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/buildq/buildq/internal/benchfmt"
)

func main() {
	err := run(os.Args[1:], os.Stderr)
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage): // the flag package has said what is wrong
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

// errUsage is a command line that does not parse.
var errUsage = errors.New("usage")

// run is the whole program; stderr receives warnings and the usage text.
func run(args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("benchreport", flag.ContinueOnError)
	fs.SetOutput(stderr)
	in := fs.String("in", "docs/benchmarks", "directory holding the results, one <id>.json per figure")
	mdPath := fs.String("md", "docs/benchmarks.md", "markdown page to write")
	svgPath := fs.String("svg", "docs/benchmarks.svg", "plot to write (not written when no result has a series)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (flags: -in, -md, -svg)", fs.Args())
	}

	st, err := os.Stat(*in)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("results directory %s does not exist: run make bench-e2e (and make bench-scale) first, or point -in at the results", *in)
	}
	if err != nil {
		return fmt.Errorf("results directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("results directory %s is not a directory", *in)
	}
	results, err := benchfmt.Read(*in)
	if err != nil {
		return fmt.Errorf("reading results: %w", err)
	}
	if len(results) == 0 {
		fmt.Fprintf(stderr, "benchreport: no results (*.json) in %s; every figure is reported as not measured\n", *in)
	}

	svg, skipped, err := plotSVG(results)
	if err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	for _, s := range skipped {
		fmt.Fprintf(stderr, "benchreport: %s: not plotted: it has no points\n", s)
	}
	svgLink := ""
	if svg == nil {
		fmt.Fprintf(stderr, "benchreport: no result has a series to plot; %s not written\n", *svgPath)
	} else {
		if err := writeFile(*svgPath, svg); err != nil {
			return err
		}
		if rel, err := filepath.Rel(filepath.Dir(*mdPath), *svgPath); err == nil {
			svgLink = filepath.ToSlash(rel)
		} else {
			svgLink = filepath.ToSlash(*svgPath)
		}
	}

	return writeFile(*mdPath, renderMarkdown(results, svgLink))
}

func writeFile(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}
