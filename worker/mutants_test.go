//go:build mutants

package worker

// TestMutants: mutation testing of the worker's protocol (issue 24). Each
// mutant is one deliberate defect in the code, switched on by name
// (mutant(name), build tag mutants; in any other build the switch is a
// constant false). Each is run against the unit tests named for it and,
// when they all pass, the fault simulation, in one test binary built for
// the purpose (the mutant chosen by BUILDQ_MUTANT); it is killed when
// either fails, and it survived when everything passed — which means the
// proof behind the rule it breaks is missing.
//
//	make mutants                          # every mutant, MUTANT_SEEDS seeds each
//	BUILDQ_MUTANTS=end-run-put make mutants
//
// Variables: BUILDQ_MUTANTS (comma-separated names; default all),
// BUILDQ_MUTANT_SEEDS (simulation seeds per mutant, default 120; the
// simulation stops at the first violation, so a killed mutant costs the
// seeds up to its first kill), BUILDQ_MUTANT_PARALLEL (mutants run at
// once, default 3; one that survives beside others runs again alone),
// BUILDQ_SIM_FIRST, BUILDQ_SIM_PARALLEL.

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// mutantCase is one deliberate defect: the rule it breaks, and the unit
// tests (besides the simulation) that must catch it.
type mutantCase struct {
	name  string
	rule  string
	tests []string
}

// mutantCatalogue: the eleven mutants issue 24 found surviving, and the
// rules added since.
var mutantCatalogue = []mutantCase{
	{"answered-check-off", "before claiming, joining or taking over, a handler checks the ledger: a request answered elsewhere starts nothing", []string{"TestAnsweredRequestStartsNoBuild"}},
	{"answered-check-fails-open", "a ledger that cannot be read is no proof that the request is unanswered: the check fails closed", []string{"TestAnUnreadableLedgerStartsNoBuild"}},
	{"ignore-recorded-decision", "a request whose ledger holds a decision publishes that decision again, never a new one", []string{"TestLostAckNeverGivesASecondResult"}},
	{"publish-before-record", "a decision is recorded in the ledger before it is published", nil},
	{"adopt-any-run", "a take-over adopts only the Job of its own run", nil},
	{"end-run-put", "a run ends with a compare-and-swap on the revision its holder read", []string{"TestFinishingRunNeverOverwritesANewerClaim"}},
	{"ignore-concurrency", "the dispatcher holds a tenant to its concurrency limit", nil},
	{"cancel-by-name", "a cancel deletes the Job of the run it ended, by UID, never the key's Job by name", []string{"TestCancelDeletesOnlyItsRunsJob"}},
	{"publish-unmarked-at-once", "another worker's unmarked decision is published only after it stayed unchanged for two leases", []string{"TestAnotherWorkersUnmarkedDecisionIsNotPublishedAtOnce"}},
	{"no-job-cleanup", "the owner deletes its run's finished Job", nil},
	{"ended-job-of-any-decision", "a handler deletes only the Job of a run whose end is stored: the run its own walk ended, or one a decision read back from the ledger names once its record is final", []string{"TestADecisionReadBackNeverDeletesTheJobOfARunWhoseEndIsNotStored"}},
	{"ended-job-given-up", "a retried or postponed handler whose run's end is still being written after endedJobWait deletes the run's Job in the background once it is stored, not never", []string{"TestTheJobOfAnEndedRunGoesOnlyOnceItsEndIsStored", "TestALaterWhoseRunsEndIsSlowStillDeletesTheJob"}},
	{"own-cleanup-on-decision-context", "a settled decision's own cleanup runs on a context of its own, not on the decision's, which a slow end or mark may have used up", []string{"TestAnOwnCleanupAfterASlowEndHasTimeOfItsOwn"}},
	{"ended-job-without-its-end", "the Job of a run a handler ended goes only once the run's end is stored (waited for when the message is settled, for endedJobWait otherwise): until then a take-over may need it", []string{"TestTheJobOfAnEndedRunGoesOnlyOnceItsEndIsStored"}},
	{"ended-job-left-to-decision", "the handler that ended a run deletes its Job whatever becomes of its message: a decision another message of the request made first names no run to clean up", []string{"TestAHandlerWhoseDecisionLosesStillDeletesItsRunsJob"}},
	{"reconcile-any-run", "the reconciler ends a run only with that run's own Job's outcome", []string{"TestReconcilerEndsOnlyTheJobsOwnRun"}},
	{"cancel-ignores-holder", "a cancel counts the request whose handler runs the build as waiting on it, whether or not the waiter index lists it", []string{"TestAnotherTenantsCancelSparesARunItsHolderIsNotListedFor"}},
	{"platform-takes-found-tag", "a platform's build of an image index takes no image found at its tag: the index is shared, so its images are buildq's own builds", []string{"TestAPlatformOfAnIndexTakesNoImageFoundAtItsTag"}},
	{"platform-takes-found-tag-ahead", "a platform's build of an image index takes no image that a HEAD sent ahead for a one-platform request found at the same tag", []string{"TestAPlatformTakesNoPreflightSentAheadForAOnePlatformRequest"}},
	{"prepared-job-unchecked", "a Job made ahead of its run is created only for a build equal in everything it was made of: request, key, destinations, tag check", []string{"TestAPreparedJobIsCreatedOnlyForTheBuildItWasMadeFor"}},
	{"pod-skips-tag-check", "a one-image build's Pod checks its first tag before it builds (fetch-context --absent)", []string{"TestABuildPodChecksItsFirstTagBeforeItBuilds"}},
	{"failed-end-keeps-claim", "a run's end whose write failed outside endAhead lets the claim go, so the retry takes the run over at once, not after the lease lapses", []string{"TestAFailedEndWriteLetsTheClaimGo"}},
	{"refused-job-left", "a claimer that finds its run ended having built nothing deletes the run's Job the cache still shows before it looks again, not leave it to the janitor", []string{"TestAFailedEndWriteLetsTheClaimGo"}},
	{"orphan-end-leaves-job", "the reconciler that stores an orphaned run's end deletes its Job, not leave it to the janitor", []string{"TestAnOrphanedRunWhosePodIsGoneIsEnded"}},
	{"pod-gone-push-failed", "a run whose Job succeeded and whose Pod was gone before its digest was read built nothing buildq can show: every request of it looks again, the claimer answered with the image at its tag, not a failure", []string{"TestARunWhosePodIsGoneAnswersNobodyWithTheImageAtItsTag"}},
	{"pod-gone-left-standing", "the reconciler ends a succeeded Job's run whose Pod never came within the grace, not leave it standing until a request of the key comes back", []string{"TestTheReconcilerEndsASucceededJobWhosePodNeverCame", "TestAnOrphanedRunWhosePodIsGoneIsEnded"}},
	{"tag-taken-answers", "a run whose Pod found its first tag taken built nothing and answers nobody: every request of it looks again", []string{"TestATagTakenBeforeTheBuildStartsIsNeverPushedOver"}},
	{"tag-check-beside-any-backend", "a build is started beside its tag's preflight HEAD only where its Pod checks the tag itself; elsewhere the HEAD answers first", []string{"TestABuildWhosePodChecksNoTagWaitsForItsHEAD"}},
	{"tag-check-past-window", "no HEAD of a build's tag goes out once its answer could no longer stop the build (past TagCheckBeside from the build's start)", []string{"TestNoTagCheckGoesOutPastItsWindow"}},
	{"tag-check-before-create", "the HEAD of a build whose Pod checks its tag goes out once the build's Job is created, not beside the create", []string{"TestATagCheckBesideGoesOutOnceTheJobIsCreated"}},
	{"tag-check-beside-any-age", "an image found by the HEAD sent beside a build's start stops the build only if the HEAD answered within TagCheckBeside: a later answer may be the build's own push", []string{"TestATagCheckAnsweredLateStopsNothing"}},
	{"wait-gone-trusts-cache", "a Job being deleted is gone only once removed, even one the informer has not shown yet", []string{"TestWaitGoneWaitsForAJobTheCacheHasNotShown"}},
	{"tag-taken-keeps-preflight", "a tag a build Pod found taken is asked about again: no earlier HEAD's \"absent\" stands for it", []string{"TestATagTakenBeforeTheBuildStartsIsNeverPushedOver"}},
	{"preflight-ignores-found-tag", "a request's preflight answers it with an image found at its own first tag: its Job never pushes over a tag it did not build", []string{"TestPlantedTagAnswersOnlyItsPusher"}},
	{"hold-forever", "a request held at intake is admitted to the queue when its hold reaches --hold-at-intake", []string{"TestAHeldRequestIsQueuedWhenItsHoldEnds"}},
	{"hold-until-success", "a request held at intake leaves the hold as soon as its key's record stops building, whatever its state", []string{"TestAHeldRequestIsQueuedAtOnceWhenItsBuildFails"}},
	{"hold-on-lapsed-run", "a request held on a run whose record sits unchanged past its lease goes to the queue, whose handler takes the run over", []string{"TestAHeldRequestOnALapsedRunIsQueued"}},
	{"hold-ignores-mark-end", "requests held on a pending mark go to the queue once the mark's request is decided without a record of the key", []string{"TestAHeldRequestOnADecidedMarkIsQueued"}},
	{"hold-on-any-tenants-run", "a request is held on a running build only of its own tenant: another tenant's joiner is parked where that tenant's cancel sees it", []string{"TestAnotherTenantsRunHoldsNothing"}},
	{"hold-acts-on-a-lapsed-delivery", "a held request whose heartbeats lapsed for two thirds of the AckWait is left to its redelivery, neither answered nor admitted", []string{"TestAHeldRequestWhoseBeatsLapsedIsLeftToItsRedelivery"}},
	{"hold-past-queue-limit", "a tenant with a queue-length limit has nothing held at intake: its requests count against the limit in the queue", []string{"TestATenantWithAQueueLimitHasNothingHeld"}},
	{"hold-not-handed-back", "a worker that stops hands its held requests back at once (Nak), not after their AckWait", []string{"TestHeldRequestsAreHandedBackWhenTheirWorkerStops"}},
	{"hold-unbeaten", "a request held at intake is heartbeaten: held several AckWaits, it is not delivered again", []string{"TestAHeldRequestIsHeartbeatenAcrossAckWaits"}},
	{"intake-reads-every-record", "intake looks at a record its watch showed without reading it", []string{"TestAHitOnAWatchedRecordIsAnsweredAtIntakeWithoutARead"}},
	{"watched-records-kept-across-watches", "a records' watch (re)started serves none of the records an earlier one showed", []string{"TestWatchedRecordsStandOnlyWhileTheWatchThatShowedThemRuns"}},
	{"watched-records-uncapped", "the records a watch showed are kept for intake's looks up to maxWatchedRecords", []string{"TestWatchedRecordsAreBounded"}},
	{"watched-records-kept-across-reconnects", "records a watch showed before its connection broke are not served to intake's looks after it", []string{"TestWatchedRecordsAreForgottenWhenTheConnectionBreaks"}},
	{"hold-behind-anyone", "a request is held on a pending mark only when the mark's request is of its tenant and at least its priority", []string{"TestAPendingMarkOfAnotherTenantOrALowerPriorityHoldsNothing"}},
	{"intake-skips-possession", "intake answers a cache hit only for a tenant shown to hold the content", []string{"TestAHitInASharedRepositoryNeedsPossessionAtIntake"}},
	{"intake-skips-registry-check", "intake answers a cache hit only while the registry still has the image", []string{"TestDeletedImageIsRebuilt"}},
	{"intake-ignores-destinations", "intake answers a cache hit only when every destination holds the image; a copy is the queue's work", []string{"TestAHitThatNeedsACopyGoesThroughTheQueue"}},
	{"registry-check-remembered", "the registry's word that an indexed image is there answers checks for a second only", []string{"TestAnImageDeletedAfterAHitIsNoticedWithinASecond"}},
	{"intake-ignores-queue-ttl", "with a queue TTL, whether a request expired is told by the server's clock: intake answers none", []string{"TestAttack_IntakeStaleHitOnAWorkerWithASlowClockIsExpired"}},
	{"intake-waits-on-lookups", "a slow registry or store sends intake's hits to the queue instead of holding every tenant's way in", []string{"TestAttack_IntakeHitsOnASlowRegistryDoNotStallOtherTenants"}},
	{"intake-never-marks", "a hit answered at intake whose ack failed is marked published before its redelivery", []string{"TestAHitWhoseAckIsLostIsMarkedForItsRedelivery"}},
	{"queued-hits-full-path", "a plain cache hit taken from the queue is answered with one ledger write, as at intake", []string{"TestAQueuedCacheHitIsAnsweredWithOneWrite"}},
	{"queued-hit-never-marks", "a queued hit answered unmarked whose ack failed is marked published before its redelivery", []string{"TestAQueuedHitWhoseAckIsLostIsMarkedForItsRedelivery"}},
	{"ahead-end-cleans-unstored", "a run whose end could not be stored keeps its Job for whoever takes it over, though its request was answered", []string{"TestAnEndStoredAheadThatFailsLeavesTheJobForTheTakeOver"}},
	{"never-publish-first", "a finished build's result goes out before its decision is recorded", []string{"TestAFinishedBuildsResultGoesOutBeforeItsDecisionIsRecorded"}},
	{"cancel-trusts-its-mark", "a cancel says canceled only of a canceled result it saw stored", []string{"TestACancelOfARequestWhoseResultWasPublishedFirstSaysItFinished"}},
	{"publish-before-end", "a result goes out only once its run's end is stored: whoever asks again after it finds a cache hit", []string{"TestAResultComesAfterItsRunsEnd"}},
	{"canceled-holder-leaves-job", "a request canceled while its build runs gives its slot back only once the Job of the run the cancel ended is gone", []string{"TestACanceledBuildsSlotComesBackOnceItsJobIsGone"}},
	{"cancel-stops-decided-holder", "a cancel spares a run whose holder is decided succeeded while its end is on its way", []string{"TestACancelSparesARunWhoseHolderIsDecided"}},
	{"direct-redelivered", "a redelivered request goes through the queue, never straight from intake to a handler: its queued copy may exist", []string{"TestARequestTakenStraightFromIntakeAndHandedBackIsQueued"}},
	{"direct-limited", "a tenant with a concurrency or queue limit is never taken straight from intake: its slots and its count are kept by its queue's messages", []string{"TestALimitedTenantIsNeverTakenStraightFromIntake"}},
	{"workers-ackwait-lowered", "a worker started with a shorter --ack-wait does not lower buildq-workers' AckWait under requests held on it", []string{"TestAStartingWorkerDoesNotLowerTheSharedAckWait"}},
	{"no-preflight-ahead", "an idle worker sends a new build's preflight HEAD from intake, beside the queue's hop", []string{"TestAPreflightIsSentAheadFromIntake"}},
	{"preflight-after-read", "an idle worker that knows no record of the key sends the preflight HEAD beside intake's record read, not after it", []string{"TestAPreflightAheadGoesBesideIntakesRecordRead"}},
	{"preflight-beside-every-read", "no HEAD is sent beside the read for a key the worker knows built: hits cost no HEAD of their tag", []string{"TestHitsOfAKnownKeySendNoPreflightAhead"}},
	{"no-open-ahead", "an idle worker that knows no record of the key creates the request's ledger entry beside intake's record read", []string{"TestTheLedgerEntryIsOpenedBesideIntakesRecordRead"}},
	{"answered-stands-handler-create", "only the entry intake created, having registered the request with the cancel service first, stands for the check that the request is unanswered: a cancel right after a handler's own create stops its build", []string{"TestACancelRightAfterAHandlersOwnCreateStopsItsBuild"}},
	{"found-beside-end-overwrites", "a run whose tag the check beside its start found taken is ended refused only as its handler held it: an end stored from outside first (the reconciler, a cancel) stands and answers", []string{"TestARunEndedFromOutsideBeforeItsTagWasFoundTakenKeepsThatEnd"}},
	{"claim-first-stale", "a handler claims before it reads only while the entry intake created for its message is younger than lookAheadFresh; past that it reads the entry, and an answered request builds nothing", []string{"TestAStaleEntryCreateIsNoAnsweredCheck"}},
	{"no-claim-ahead", "an idle worker that knows no record of the key claims it beside the request's ledger entry's create, where the build Pod checks its tag", []string{"TestAFreshKeyIsClaimedBesideItsEntrysCreate"}},
	{"claim-ahead-never-withdrawn", "a claim intake sent that its request's handler does not take is withdrawn: the key is absent again, and its next request builds under a run of its own", []string{"TestAClaimSentAheadForADuplicateIsWithdrawn", "TestAClaimSentAheadNobodyTakesIsWithdrawn"}},
	{"open-ahead-misses-cancels", "a cancel between intake's create ahead and its handler reaches the handler: no build for a request the cancel confirmed", []string{"TestACancelBetweenTheCreateAheadAndItsHandlerStopsTheRequest"}},
	{"opened-hit-fresh-only", "a hit whose look took longer than lookAheadFresh is still decided on the entry intake opened for it", []string{"TestAHitIsDecidedOnItsOpenedEntryOfAnyAge"}},
	{"preflight-ahead-busy", "no preflight HEAD is sent from intake for a request that will wait: on a busy worker, or of a tenant with a limit", []string{"TestABusyWorkerSendsNoPreflightAhead", "TestALimitedTenantGetsNoPreflightAhead"}},
	{"heartbeat-fixed-pace", "a running request's heartbeat follows the consumer's AckWait as the worker learns it, lowered by hand or not", []string{"TestAHeartbeatFollowsALoweredAckWaitWhileItRuns"}},
	{"stale-absence", "an absence of a record seen at intake stands for a moment only: a key built since is a cache hit at intake", []string{"TestAnAbsenceSeenAtIntakeStandsForAMomentOnly"}},
	{"unpark-overwrites", "a handler unparks a request's waiter entry only at the revision it parked it at, and acks its message as parked only when the entry is known to be parked", []string{"TestAStaleUnparkNeverUndoesALaterPark"}},
	{"orphan-ends-unattested", "a worker that attests never ends a succeeded run without its attestation, not even as the reconciler", []string{"TestAReleasedRunIsNotEndedUnattestedByTheReconciler"}},
	{"cancel-unkeyed-blind", "a cancel of a request without a key yet applies only while it has none; keyed meanwhile, it is canceled as a keyed request (its build stopped)", []string{"TestAttack_CancelRacingSetSourceStopsTheBuild"}},
	{"source-ignores-cancel", "a request canceled before its git source is recorded is never keyed nor built", []string{"TestAttack_CanceledWhileFetchingWithTheNoteLostBuildsNothing"}},
	{"repack-on-redelivery", "a git source is resolved once: every later delivery builds the recorded commit", []string{"TestRedeliveryBuildsTheRecordedCommitNotTheMovedRef"}},
	{"cancel-other-tenants", "a cancel by key cancels the canceling tenant's waiting requests only", []string{"TestCancelOfASharedBuildSparesOtherTenants"}},
	{"ignore-priority", "a tenant's requests are taken high, then normal, then low", nil},
	{"ignore-shares", "a free slot goes to the tenant with the fewest requests running per weight", nil},
	{"share-foreign-failure", "a failed run of another tenant's request answers nobody else", []string{"TestClaimersCredentialFailureDoesNotFailTheJoiner"}},
	{"skip-possession", "a request is answered only for content its tenant shows it holds", []string{"TestForeignBuildNeedsPossession", "TestJoiningAForeignBuildNeedsPossession"}},
	{"reply-anywhere", "the tenant API answers only on a service import's or the tenant's own inbox's reply", []string{"TestAPIAnswersOnlyOnATenantsOwnReplies"}},
	{"log-append-blind", "a chunk is appended to a run's log only where its writer last saw it end: two capturers never store a line twice", []string{"TestBuildLogTwoCapturersStoreEachLineOnce"}},
	{"logs-before-possession", "a request id reaches another tenant's build's log only once the request waits on it (possession shown)", []string{"TestLogAttackNoForeignLogBeforePossession"}},
	{"logs-any-tenant", "a build's log is served by key only to the tenant that claimed it or waits on it", []string{"TestBuildLogsOfALocalBuild"}},
	{"index-ignores-slots", "an image index runs at most as many platform builds at once as its request holds concurrency slots", []string{"TestIndexPlatformsStayWithinTheTenantsConcurrencyLimit"}},
	{"extra-slot-free-on-live-key", "an image index's extra slot, kept, stays its request's until the request is finished, even once the request runs on a live slot again", []string{"TestAttack_KilledIndexExtraSlotIsKeptForItsRequest", "TestAttack_IndexExtraSlotIsKeptWhileItsPlatformJobRunsAfterShutdown", "TestAttack_RetriedIndexKeepsItsExtraSlotsWhileItsPlatformJobsRun"}},
	{"index-cancel-stops-shared", "a canceled image index stops only the platform builds no other request waits on", []string{"TestCanceledIndexStopsItsUnsharedPlatformBuilds"}},
	{"canceled-index-lets-shared-go", "a canceled image index's platform build that other requests wait on is finished by its handler on its slots, never let go with its Job running", []string{"TestCanceledIndexFinishesItsSharedPlatformBuildOnItsSlots"}},
	{"claimer-takes-others-cancel", "a claimer answers \"canceled\" from its own run only when its own request was canceled; a run another request's cancel stopped is built again", []string{"TestClaimerNotCanceledBuildsAgainAfterAnotherRequestsCancel"}},
}

// mutantsKilledByTiming are the mutants only the simulation's timing
// judgments kill (fair share, priority, a finished Job's removal): judged
// in calm seconds only, they would survive beside other mutants, so they
// run alone.
var mutantsKilledByTiming = []string{"ignore-priority", "ignore-shares", "no-job-cleanup"}

func TestMutants(t *testing.T) {
	names := strings.Split(os.Getenv("BUILDQ_MUTANTS"), ",")
	if names[0] == "" {
		names = nil
	}
	seeds := os.Getenv("BUILDQ_MUTANT_SEEDS")
	if seeds == "" {
		seeds = "120"
	}
	src := mutantSwitches(t)
	// One test binary for every mutant: each picks its own at run time.
	bin := filepath.Join(t.TempDir(), "worker-mutants.test")
	if out, err := exec.Command("go", "test", "-c", "-tags", "mutants", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build the mutants' test binary: %v\n%s", err, out)
	}
	var picked []mutantCase
	for _, m := range mutantCatalogue {
		if names != nil && !slices.Contains(names, m.name) {
			continue
		}
		if !src[m.name] {
			t.Errorf("mutant %s: no mutant.On(%q) switch in the worker's code", m.name, m.name)
			continue
		}
		picked = append(picked, m)
	}
	// Several mutants at once: most of them wait on their tests' timers,
	// and one at a time leaves most of the machine idle. Those that only
	// the simulation's timing judgments kill run alone, after the others:
	// the judgments leave out the seconds a loaded machine made late
	// (sim_stalls_test.go). And a mutant that survives beside the others
	// is run again alone before it is called survived: a rule the suite
	// proves on a calm machine stays proven, and only one that survives
	// alone too is reported.
	parallel := 3
	if v, err := strconv.Atoi(os.Getenv("BUILDQ_MUTANT_PARALLEL")); err == nil && v >= 1 {
		parallel = v
	}
	lines := make([]string, len(picked))
	killed := make([]bool, len(picked))
	runAll := func(idx []int, n int, again bool) {
		sem := make(chan struct{}, n)
		var wg sync.WaitGroup
		for _, i := range idx {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				lines[i], killed[i] = runMutant(bin, seeds, picked[i], again)
				if !killed[i] && !again && n > 1 {
					t.Log(lines[i] + " (beside others: it runs again alone below)")
					return
				}
				t.Log(lines[i])
			}()
		}
		wg.Wait()
	}
	var together, alone []int
	for i, m := range picked {
		if parallel > 1 && slices.Contains(mutantsKilledByTiming, m.name) {
			alone = append(alone, i)
		} else {
			together = append(together, i)
		}
	}
	runAll(together, parallel, false)
	runAll(alone, 1, false)
	if parallel > 1 {
		var again []int
		for _, i := range together {
			if !killed[i] {
				again = append(again, i)
			}
		}
		runAll(again, 1, true)
	}
	var survived []string
	for i, m := range picked {
		if !killed[i] {
			survived = append(survived, m.name)
		}
	}
	t.Logf("mutants:\n%s", strings.Join(lines, "\n"))
	if len(survived) > 0 {
		// Named again last: a log kept only from its end still says which.
		t.Errorf("%d mutant(s) survived: the rules they break are not proven: %s", len(survived), strings.Join(survived, ", "))
	}
}

// runMutant runs m against its named tests and then, when they all pass,
// the fault simulation; killed reports whether either failed. again marks
// a second run, alone.
func runMutant(bin, seeds string, m mutantCase, again bool) (line string, killed bool) {
	began := time.Now()
	var out bytes.Buffer
	run := func(pattern string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, "-test.count=1", "-test.timeout=20m", "-test.v", "-test.run", pattern)
		cmd.Env = append(os.Environ(), "BUILDQ_MUTANT="+m.name, "BUILDQ_SIM_SEEDS="+seeds, "BUILDQ_SIM_STOP=1", "BUILDQ_MUTANTS=")
		cmd.Stdout, cmd.Stderr = &out, &out
		return cmd.Run()
	}
	// The named tests first: they are quick, and a mutant they kill
	// needs no simulation.
	var err error
	if len(m.tests) > 0 {
		err = run("^(" + strings.Join(m.tests, "|") + ")$")
	}
	if err == nil {
		err = run("^TestFaultSimulation$")
	}
	took := time.Since(began).Round(time.Second)
	alone := ""
	if again {
		alone = " (alone, after surviving beside others)"
	}
	if err == nil {
		return fmt.Sprintf("SURVIVED %-26s %6s  %s%s", m.name, took, m.rule, alone), false
	}
	return fmt.Sprintf("killed   %-26s %6s  by %s%s", m.name, took, mutantKillers(out.String()), alone), true
}

var (
	failedTestRe = regexp.MustCompile(`(?m)^\s*--- FAIL: (\S+)`)
	violationRe  = regexp.MustCompile(`(?m)^\s+\[([a-z-]+)\]`)
)

// mutantKillers summarizes what failed: the tests, and the simulation's
// violation classes.
func mutantKillers(out string) string {
	var tests, classes []string
	for _, m := range failedTestRe.FindAllStringSubmatch(out, -1) {
		if !strings.Contains(m[1], "/") && !slices.Contains(tests, m[1]) {
			tests = append(tests, m[1])
		}
	}
	for _, m := range violationRe.FindAllStringSubmatch(out, -1) {
		if !slices.Contains(classes, m[1]) {
			classes = append(classes, m[1])
		}
	}
	s := strings.Join(tests, ", ")
	if len(classes) > 0 {
		s += " (violations: " + strings.Join(classes, ", ") + ")"
	}
	if s == "" {
		lines := strings.Split(strings.TrimSpace(out), "\n")
		s = "a failed build or run: " + lines[len(lines)-1]
	}
	return s
}

// mutantSwitches lists the names the worker's code switches on.
func mutantSwitches(t *testing.T) map[string]bool {
	var files []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".go") {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`mutant\.On\("([a-z-]+)"\)`)
	found := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			found[m[1]] = true
		}
	}
	return found
}
