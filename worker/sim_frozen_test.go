package worker

// Frozen scenarios: every schedule that once found a defect, replayed by
// name in every run of the unit tests, so that the defect never comes back
// unseen (etcd-io/raft's rafttest keeps its finds the same way). A
// scenario is a seed of the schedule generator (sim_schedule_test.go),
// which must therefore not change what a seed draws: new kinds of fault go
// after the existing ones, and a change that moves the draws moves every
// scenario below to new seeds (find them again with make soak).
//
//	go test ./worker/ -run '^TestFrozenScenarios$'                # all of them
//	go test ./worker/ -run '^TestFrozenScenarios$/job-left-behind' -v
//
// A replay repeats the schedule, not every thread switch: a scenario is
// run BUILDQ_SIM_REPEAT times (default 1) to see a timing-dependent
// violation again.

import "testing"

// simScenario is one frozen schedule and what it found.
type simScenario struct {
	name  string
	seed  int64
	found string
}

// The defects the simulation found before this list existed were found
// under earlier schedule generators, whose seeds draw other schedules now
// (seed 21: a requeue token renewed at every park stranded a request; seed
// 160: a requeued request terminated as a duplicate on a ledger read
// error); named unit tests keep those (TestIssue24RequeuedRequest…).
var simScenarios = []simScenario{
	{"job-left-behind-63", 63, "the owner's delete of its finished Job failed under API errors, no TTL controller ran, and nothing came back to the Job (janitor.go)"},
	{"job-left-behind-80", 80, "as job-left-behind-63, with a partition"},
	{"repeated-publish-17", 17, "a decision published again after a lost ack reached core subscribers twice (BUILDQ_RESULTS now publishes what it stored, once)"},
	{"repeated-publish-37", 37, "as repeated-publish-17, with a NATS restart and a partition"},
	{"repeated-publish-86", 86, "as repeated-publish-17"},
	{"redundant-build-171", 171, "a handler whose take-over lost its run followed the record with the run's repository for its own: the new run it claimed pushed to the request's repository and indexed the claimer's, and the next request rebuilt the key (index-misplaced)"},
	{"concurrency-limit-41", 41, "a killed worker's slot aged out while its Job ran on; the next request of the tenant ran a third Job under a limit of 2 (slots kept for their request)"},
	{"concurrency-limit-323", 323, "a request canceled while its build ran gave its slot back before the cancel had deleted its Job; the next request of the tenant ran a third Job under a limit of 2 (the handler now deletes the ended run's Job and waits until it is gone)"},
	{"concurrency-limit-173", 173, "a canceled image index's platforms, whose runs the cancel ended, gave their slots back before their Jobs' deletes were through; the next request of the tenant ran a third Job under a limit of 2 (a platform whose run a cancel ended now waits until its Job is gone)"},
	{"end-ahead-taken-over-36", 36, "a handler that had taken a run over decided from its own outcome while storing the end (JobDeleted: the former holder, back from a pause, had ended the run and deleted its Job); a run taken over is ended before its decision (own.go, endAhead)"},
}

func TestFrozenScenarios(t *testing.T) {
	if testing.Short() {
		t.Skip("the frozen scenarios take a minute; not in -short")
	}
	repeat := simSetting(0, "BUILDQ_SIM_REPEAT", 1, t)
	for _, sc := range simScenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			for range repeat {
				out := runSim(t, newFrozenSchedule(sc.seed))
				if len(out.violations) > 0 {
					t.Errorf("frozen scenario %s (seed %d, which found: %s):\n%s", sc.name, sc.seed, sc.found, out.report)
					return
				}
			}
		})
	}
}
