//go:build !mutants

package worker

// mutant reports whether the deliberate defect name is switched on. In
// every build but the mutation tests' (`make mutants`, build tag mutants)
// it is false, and the compiler drops the code it guards.
func mutant(string) bool { return false }
