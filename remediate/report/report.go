// Package report turns the audit record into who leaves orphaned GPU
// memory behind: per user, Slurm job, command, node or source (what
// triggered the cleanup), how many
// orphaned-memory events, how many GiB·hours the memory was held with no
// live owner before the cleanup, how much came back, and when it last
// happened. `gpu-orphan report` prints it; a page can show the same rows.
package report

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// By is what a report groups by.
type By string

// The keys a report can group by.
const (
	ByUser     By = "user"
	BySlurmJob By = "slurm_job"
	ByComm     By = "comm"
	ByNode     By = "node"
	// BySource groups by what started the action (Action.Source): an
	// alert (webhook), gpu-orphan clean (cli), Slurm's prolog or epilog,
	// or a dispatcher's forwarding (dispatch).
	BySource By = "source"
)

// Bys lists every grouping, the default first.
var Bys = []By{ByUser, BySlurmJob, ByComm, ByNode, BySource}

// ParseBy checks a grouping's name.
func ParseBy(s string) (By, error) {
	if slices.Contains(Bys, By(s)) {
		return By(s), nil
	}
	names := make([]string, len(Bys))
	for i, b := range Bys {
		names[i] = string(b)
	}
	return "", fmt.Errorf("cannot group by %q: want one of %s", s, strings.Join(names, ", "))
}

// Keys for dead owners that lack what the report groups by.
const (
	// Unknown: the remediator never saw the dead owner alive (it started
	// after the death, or it was `gpu-orphan clean`), or no dead owner was
	// listed.
	Unknown = remediate.UnknownUser
	// None: the owner is known and was not in a Slurm job.
	None = "none"
)

// Row is one key's share of the orphaned-memory events.
type Row struct {
	Key string `json:"key"`
	// Events is the number of actions with memory left by this key.
	Events int `json:"events"`
	// GiBHours is the memory with no live owner times how long it had none
	// when the action planned, this key's share of it.
	GiBHours float64 `json:"gib_hours"`
	// FreedBytes is the memory verified back, this key's share of it.
	FreedBytes uint64    `json:"freed_bytes"`
	Last       time.Time `json:"last"`
	// Attempts is how many actions the events took: more than Events
	// when a restart interrupted one, or the memory stayed held after it
	// and the alert's next notification tried again.
	Attempts int `json:"attempts"`
}

// Report is the rows of one grouping over a time range, sorted by
// GiB·hours, most first.
type Report struct {
	By    By        `json:"by"`
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
	// Events is the number of alerts' actions counted (Counts): the
	// attempts of one alert are one event.
	Events int `json:"events"`
	// Attempts is how many actions those events took (Row.Attempts).
	Attempts int   `json:"attempts"`
	Rows     []Row `json:"rows"`
}

// Chain is the key that the attempts of one alert share: the first
// attempt's ID.
func Chain(a remediate.Action) string {
	if a.FirstActionID != "" {
		return a.FirstActionID
	}
	return a.ID
}

// Outcome is how an action ended: for a dispatcher's action, its agent's
// outcome (empty while the agent works).
func Outcome(a remediate.Action) remediate.State {
	if a.Agent != nil {
		return a.Agent.State
	}
	return a.State
}

// Counts reports whether an action is an orphaned-memory event: memory with
// no live owner was planned on, and the plan went ahead (succeeded or
// failed) or would have, in a dry run. Skipped actions (too small, too
// young, nothing to signal), interrupted ones and a dispatcher's forwarding
// that reached no agent are not events.
func Counts(a remediate.Action) bool {
	switch Outcome(a) {
	case remediate.StateSucceeded, remediate.StateFailed, remediate.StateDryRun:
		return a.Before != nil
	}
	return false
}

// When is the time of an action's event: when it finished (on the node, for
// a dispatcher's action), or when it started while it has not.
func When(a remediate.Action) time.Time {
	switch {
	case a.Agent != nil && a.Agent.FinishedAt != nil:
		return *a.Agent.FinishedAt
	case a.FinishedAt != nil && !a.FinishedAt.IsZero():
		return *a.FinishedAt
	}
	return a.StartedAt
}

// GiBHours is the memory with no live owner when the action planned, in
// GiB, times how long it had had none, in hours.
func GiBHours(a remediate.Action) float64 {
	if a.Before == nil {
		return 0
	}
	return float64(a.Before.UnownedBytes) / (1 << 30) * a.Before.UnownedAgeSeconds / 3600
}

// Share is a key's part of one action.
type Share struct {
	Key    string
	Weight float64
}

// Split divides an action among the keys of its dead owners, by the memory
// NVML charged each (equally when it charged none). By node or source, the
// action is its node's or its source's. An epilog's action is its job's by
// user and by Slurm job (JobOwns). Any other action without dead owners is
// Unknown's.
func Split(a remediate.Action, by By) []Share {
	switch by {
	case ByNode:
		return []Share{{a.Node, 1}}
	case BySource:
		if a.Source == "" {
			return []Share{{Unknown, 1}}
		}
		return []Share{{a.Source, 1}}
	case ByUser:
		if j := JobOwns(a); j != nil {
			return []Share{{j.UserLabel(), 1}}
		}
	case BySlurmJob:
		if j := JobOwns(a); j != nil {
			return []Share{{j.SlurmJob, 1}}
		}
	}
	var total float64
	for _, o := range a.DeadOwners {
		total += float64(o.UsedBytes)
	}
	weights := map[string]float64{}
	for _, o := range a.DeadOwners {
		w := 1 / float64(len(a.DeadOwners))
		if total > 0 {
			w = float64(o.UsedBytes) / total
		}
		weights[Key(o, by)] += w
	}
	if len(weights) == 0 {
		return []Share{{Unknown, 1}}
	}
	out := make([]Share, 0, len(weights))
	for k, w := range weights {
		out = append(out, Share{k, w})
	}
	slices.SortFunc(out, func(x, y Share) int { return strings.Compare(x.Key, y.Key) })
	return out
}

// JobOwns returns the job that an action's memory is charged to instead of
// its dead owners, or nil. That is the epilog's job only. The epilog
// cleans its own job's leftovers: it signals nothing outside the job
// (remediate/jobend), so whatever it freed was the job's, whichever dead
// PIDs NVML listed on the GPU, and those often unknown (no remediator saw
// them alive). The prolog is the other way round: its job has not started,
// and what it cleans is someone else's orphan, left before. Its key is the
// dead owners, as for an alert's cleanup (unknown without them, as for a
// driver-level leak); charging the prolog's job would blame the job that
// the orphan was in the way of.
func JobOwns(a remediate.Action) *remediate.JobRef {
	if a.Source == remediate.SourceEpilog && a.Job != nil && a.Job.SlurmJob != "" {
		return a.Job
	}
	return nil
}

// Key is a dead owner's key under a grouping other than ByNode and
// BySource.
func Key(o remediate.DeadOwner, by By) string {
	if !o.Known {
		return Unknown
	}
	switch by {
	case ByUser:
		return o.UserLabel()
	case BySlurmJob:
		if o.SlurmJob == "" {
			return None
		}
		return o.SlurmJob
	case ByComm:
		if o.Comm == "" {
			return Unknown
		}
		return o.Comm
	}
	return Unknown
}

// Build groups the actions that Counts by `by`. The attempts of one alert
// (Chain) are one event: its memory with no live owner counted once, at the
// longest age an attempt saw, the memory each freed added up, its shares
// those of its last counted attempt. since and until only label the
// report: the caller chose the actions.
func Build(actions []remediate.Action, by By, since, until time.Time) Report {
	r := Report{By: by, Since: since, Until: until, Rows: []Row{}}
	type event struct {
		last     remediate.Action // the latest counted attempt
		gibHours float64
		freed    uint64
		when     time.Time
		attempts int
	}
	tries := map[string]int{}
	for _, a := range actions {
		tries[Chain(a)]++
	}
	events := map[string]*event{}
	var order []string
	for _, a := range actions {
		if !Counts(a) {
			continue
		}
		key := Chain(a)
		e := events[key]
		if e == nil {
			e = &event{last: a, attempts: tries[key]}
			events[key] = e
			order = append(order, key)
		}
		if a.Attempt >= e.last.Attempt {
			e.last = a
		}
		e.gibHours = max(e.gibHours, GiBHours(a))
		e.freed += a.FreedBytes
		if w := When(a); w.After(e.when) {
			e.when = w
		}
	}
	rows := map[string]*Row{}
	for _, key := range order {
		e := events[key]
		r.Events++
		r.Attempts += e.attempts
		shares := Split(e.last, by)
		freed := splitBytes(e.freed, shares)
		for i, s := range shares {
			row := rows[s.Key]
			if row == nil {
				row = &Row{Key: s.Key}
				rows[s.Key] = row
			}
			row.Events++
			row.Attempts += e.attempts
			row.GiBHours += e.gibHours * s.Weight
			row.FreedBytes += freed[i]
			if e.when.After(row.Last) {
				row.Last = e.when
			}
		}
	}
	for _, row := range rows {
		r.Rows = append(r.Rows, *row)
	}
	slices.SortFunc(r.Rows, func(x, y Row) int {
		switch {
		case x.GiBHours != y.GiBHours:
			if x.GiBHours > y.GiBHours {
				return -1
			}
			return 1
		case x.Events != y.Events:
			return y.Events - x.Events
		}
		return strings.Compare(x.Key, y.Key)
	})
	return r
}

// splitBytes divides n by the shares' weights in whole bytes that add up to
// n: the rounding remainder goes to the largest share.
func splitBytes(n uint64, shares []Share) []uint64 {
	out := make([]uint64, len(shares))
	switch len(shares) {
	case 0:
		return out
	case 1:
		out[0] = n
		return out
	}
	var sum uint64
	largest := 0
	for i, s := range shares {
		out[i] = uint64(math.Floor(float64(n) * s.Weight))
		sum += out[i]
		if s.Weight > shares[largest].Weight {
			largest = i
		}
	}
	if sum > n { // float rounding near 2^64
		clear(out)
		out[largest] = n
		return out
	}
	out[largest] += n - sum
	return out
}
