package stack

import "time"

// Stage is a step of the stack's life or of the loop, in the order the
// loop goes through them.
type Stage int

const (
	// StageUp: a daemon started and answers.
	StageUp Stage = iota
	// StageWorkload: the simulated job runs; the exporter sees its live owner.
	StageWorkload
	// StageKilled: the job's parent was killed with SIGKILL; its children keep
	// its GPU memory. The loop's clock starts here (on a real node, at
	// StageDetected).
	StageKilled
	// StageDetected: the exporter reports the memory with no live owner and
	// its suspect holders.
	StageDetected
	// StageScraped: Prometheus has the series.
	StageScraped
	// StagePending and StageFiring: GPUOrphanMemory in Prometheus.
	StagePending
	StageFiring
	// StageRouted: Alertmanager has the alert, for the remediator's receiver.
	StageRouted
	// StageReceived: the remediator recorded an action for the alert.
	StageReceived
	// StagePlanned: the action's plan, from a fresh snapshot.
	StagePlanned
	// StageSignal: one signal sent to a target (one event each).
	StageSignal
	// StageFinished: the action ended (succeeded, dry run, failed, ...).
	StageFinished
	// StageMemoryBack: the GPU's memory is back, seen by the exporter.
	StageMemoryBack
	// StageResolved: the alert resolved in Prometheus.
	StageResolved
	// StageResolvedReceived: the remediator heard of the resolution.
	StageResolvedReceived
	// StageStopped: a daemon or workload was stopped.
	StageStopped
)

var stageNames = [...]string{
	StageUp:               "up",
	StageWorkload:         "workload",
	StageKilled:           "kill -9",
	StageDetected:         "detected",
	StageScraped:          "scraped",
	StagePending:          "alert pending",
	StageFiring:           "alert firing",
	StageRouted:           "alert routed",
	StageReceived:         "notification received",
	StagePlanned:          "plan",
	StageSignal:           "signal",
	StageFinished:         "action finished",
	StageMemoryBack:       "memory back",
	StageResolved:         "alert resolved",
	StageResolvedReceived: "resolved received",
	StageStopped:          "stopped",
}

func (s Stage) String() string {
	if s < 0 || int(s) >= len(stageNames) {
		return "stage?"
	}
	return stageNames[s]
}

// Event is one thing that happened, for a person (Narrator) or a test.
type Event struct {
	Stage Stage
	// At is when it happened: by its source's own clock where it has one
	// (the alert's activeAt, the remediator's records), else Seen.
	At time.Time
	// Seen is when the stack saw it.
	Seen time.Time
	// Start is when the loop's clock started (zero before): the parent's
	// SIGKILL, or on a real node when the orphan was first seen.
	Start time.Time
	// Text says what happened, in one line; More adds detail lines.
	Text string
	More []string
	// Warning marks what should not happen: a test fails on it.
	Warning bool
}
