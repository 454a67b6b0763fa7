//go:build !race

package worker

// raceDetector: this test binary runs under the race detector (make
// sim-race), where every step is several times slower. The fault
// simulation then checks for data races and every rule of what happens and
// in which order it may happen, but not the rules that bound how soon
// (fair order in calm stretches, a Job removed within a second of its
// run's end): make sim, without the detector, judges those.
const raceDetector = false
