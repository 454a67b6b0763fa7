//go:build !mutants

package mutant

// On reports whether the deliberate defect name is switched on: never,
// outside a build with the tag mutants.
func On(string) bool { return false }
