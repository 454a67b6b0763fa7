//go:build mutants

package mutant

import "os"

// active is the deliberate defect this test binary runs with
// (BUILDQ_MUTANT; worker/mutants_test.go holds the catalogue).
var active = os.Getenv("BUILDQ_MUTANT")

// On reports whether the deliberate defect name is switched on.
func On(name string) bool { return active == name }
