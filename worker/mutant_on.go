//go:build mutants

package worker

import "os"

// activeMutant is the deliberate defect this test binary runs with
// (BUILDQ_MUTANT; see mutants_test.go for the catalogue).
var activeMutant = os.Getenv("BUILDQ_MUTANT")

// mutant reports whether the deliberate defect name is switched on.
func mutant(name string) bool { return activeMutant == name }
