package stack

import (
	"fmt"
	"time"
)

// Cooldown is the remediator's pause on a GPU after an action that sent
// signals: the stack starts it with --limit.cooldown set to this (the
// remediator's default), so that the hints and the remediator agree.
// internal/ imports nothing of remediate/ (cmd's TestImportsRunDown).
var Cooldown = 10 * time.Minute

// NextOrphan says where another orphan on the simulated node is cleaned
// soonest, from the remediator's actions: the lowest-numbered of the gpus
// GPUs that no cooldown holds at now (ready is now), or else the GPU whose
// cooldown ends first, and when (ready is later than now).
func NextOrphan(gpus int, actions []Action, cooldown time.Duration, now time.Time) (gpu int, ready time.Time) {
	gpu = -1
	for i, u := range cooldowns(gpus, actions, cooldown, now) {
		if !u.After(now) {
			return i, now
		}
		if gpu < 0 || u.Before(ready) {
			gpu, ready = i, u
		}
	}
	return gpu, ready
}

// cooldowns is, for each of gpus GPUs, when its cooldown ends (zero if it
// never began). A cooldown runs for cooldown from the end of an action on
// the GPU that signalled a process; a running action holds its GPU for as
// long from now. A queued action (one that a cooldown holds back) changes
// nothing: it runs when the cooldown ends, and cleans what the GPU's
// orphans hold by then.
func cooldowns(gpus int, actions []Action, cooldown time.Duration, now time.Time) []time.Time {
	until := make([]time.Time, gpus)
	for _, a := range actions {
		if a.GPUIndex < 0 || a.GPUIndex >= gpus {
			continue
		}
		var end time.Time
		switch {
		case a.FinishedAt == nil && a.State == StateRunning:
			end = now.Add(cooldown)
		case a.FinishedAt != nil && signalled(a):
			end = a.FinishedAt.Add(cooldown)
		default:
			continue
		}
		if end.After(until[a.GPUIndex]) {
			until[a.GPUIndex] = end
		}
	}
	return until
}

func signalled(a Action) bool {
	for _, t := range a.Targets {
		if len(t.Signals) > 0 {
			return true
		}
	}
	return false
}

// OrphanHint is what `make run` tells a person who wants another orphan
// once the loop is done: a GPU that the remediator cleans at once, or, when
// each GPU of the simulated node is cooling down, that an orphan now waits,
// why, and until when. sim runs the simulated node (gpu-orphan-sim
// --root root). The first line introduces the command on the second.
func OrphanHint(sim, root string, gpus int, actions []Action, cooldown time.Duration, now time.Time) []string {
	gpu, ready := NextOrphan(gpus, actions, cooldown, now)
	if gpu < 0 {
		return nil
	}
	cmd := fmt.Sprintf("  %s run --root %s --gpu %d --mib 2048 --children 2 & sleep 1; kill -9 $!", sim, root, gpu)
	var cooling []string
	for i, u := range cooldowns(gpus, actions, cooldown, now) {
		if u.After(now) {
			cooling = append(cooling, fmt.Sprintf("GPU %d until %s", i, u.Format(time.TimeOnly)))
		}
	}
	if !ready.After(now) {
		intro := fmt.Sprintf("Another orphan, on GPU %d, which the remediator cleans at once", gpu)
		if len(cooling) > 0 {
			intro += fmt.Sprintf(" (its %s cooldown after a cleanup holds %s)", minutes(cooldown), join(cooling))
		}
		return []string{intro + "; from another terminal:", cmd}
	}
	wait := ready.Sub(now).Round(time.Second)
	return []string{
		fmt.Sprintf("Every GPU is in the remediator's %s cooldown after a cleanup (%s): an orphan now is detected and alerted on at once, "+
			"and cleaned when its GPU's cooldown ends; soonest on GPU %d, at %s (in %s). From another terminal:",
			minutes(cooldown), join(cooling), gpu, ready.Format(time.TimeOnly), wait),
		cmd,
	}
}

func join(s []string) string {
	out := ""
	for i, x := range s {
		switch {
		case i == 0:
		case i == len(s)-1:
			out += " and "
		default:
			out += ", "
		}
		out += x
	}
	return out
}

// minutes writes 10m rather than 10m0s.
func minutes(d time.Duration) string {
	if d > 0 && d%time.Minute == 0 {
		return fmt.Sprintf("%dm", d/time.Minute)
	}
	return d.String()
}
