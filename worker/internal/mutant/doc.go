// Package mutant holds the switches of the worker's mutation tests: each
// names a deliberate defect (a protocol rule broken on purpose) that only
// a binary built with the tag mutants can switch on, with BUILDQ_MUTANT.
// In every other build On is a constant false the compiler removes.
package mutant
