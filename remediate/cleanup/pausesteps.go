package cleanup

// The steps of a cleanup that a test build can pause at (pausepoint.go).
const (
	// PausePlanRecorded: the plan is recorded, no signal is sent yet.
	PausePlanRecorded = "plan_recorded"
	// PauseSIGTERMSent: a target was just sent SIGTERM (and its record
	// written before it); the grace period has not begun.
	PauseSIGTERMSent = "sigterm_sent"
	// PauseSIGKILLSent: a target was just sent SIGKILL.
	PauseSIGKILLSent = "sigkill_sent"
	// PauseVerifying: the ladder is done, verification begins; the
	// targets' outcomes are not recorded yet.
	PauseVerifying = "verifying"
)
