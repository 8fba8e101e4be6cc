package stack

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
)

// remediatorReceiver is Alertmanager's receiver for the remediator's
// webhook (alertmanager.yml.tmpl).
const remediatorReceiver = "gpu-orphan-remediator"

// LoopConfig says which orphan a Loop follows.
type LoopConfig struct {
	// GPU is the GPU of the orphan; -1 on a real node: the first GPU with
	// more than MinBytes with no live owner.
	GPU int
	// MiB and Children: the simulated workload that makes the orphan.
	// MiB 0 starts none (on a real node someone else makes the orphan, and
	// the loop waits for it without a deadline).
	MiB, Children int
	// MinBytes is how much memory with no live owner makes the orphan:
	// MiB, or 1 GiB without a workload.
	MinBytes uint64
	// Sole: no other GPU has an orphan, so an alert or an action for one
	// is a fault (a warning event). True on a simulated node.
	Sole bool
}

// ErrDryRun is returned when the action ended as a dry run: the plan is
// recorded, nothing was signalled and the memory stays.
var ErrDryRun = errors.New("the remediator runs without --act: the plan is recorded, nothing was signalled")

// Loop follows one orphan through the stack, stage by stage: the workload
// and its parent's SIGKILL, the exporter, Prometheus, Alertmanager, the
// remediator's action, the memory back and the alert resolved. Each stage
// is an Event; what it observed stays in the Loop's fields.
type Loop struct {
	s    *Stack
	cfg  LoopConfig
	next Stage

	// Start is when the loop's clock started (Event.Start).
	Start time.Time
	// Workload is the simulated job, if the loop started one.
	Workload *Workload
	// UUID is the GPU's, once StageDetected.
	UUID string
	// Live is the exporter's account of the GPU while the workload's
	// parent lived; Orphan when StageDetected; Back at StageMemoryBack.
	Live, Orphan, Back GPUAccount
	// DriverUsed is the simulated driver's used memory at StageMemoryBack.
	DriverUsed uint64
	// Alert is GPUOrphanMemory in Prometheus; Routed in Alertmanager.
	Alert  PromAlert
	Routed AMAlert
	// Action is the remediator's action, with its events once StageFinished.
	Action Action

	warned  map[string]bool
	printed map[string]bool // signal events already told
}

// GPUAccount is one GPU as the exporter reports it.
type GPUAccount struct {
	GPU                      int
	UUID                     string
	Used, OwnedLive, Unowned float64
	Suspects                 float64
	// Holders are the suspect holders (gpu_orphan_holder_info).
	Holders []Holder
	// DeadPIDs are the dead owners NVML still lists.
	DeadPIDs []int
}

// Holder is a suspect holder.
type Holder struct {
	PID          int
	Comm, Reason string
}

// NewLoop returns a Loop for the orphan cfg describes; Run follows it.
func (s *Stack) NewLoop(cfg LoopConfig) *Loop {
	if cfg.MinBytes == 0 {
		cfg.MinBytes = 1 << 30
		if cfg.MiB > 0 {
			cfg.MinBytes = uint64(cfg.MiB) << 20
		}
	}
	next := StageWorkload
	if cfg.MiB == 0 {
		next = StageDetected
	}
	return &Loop{s: s, cfg: cfg, next: next, warned: map[string]bool{}, printed: map[string]bool{}}
}

// Next is the stage Run goes to next.
func (l *Loop) Next() Stage { return l.next }

// Run follows the loop from where it stands through stage last, and can be
// called again to go further. Each stage has a deadline (but the first
// orphan on a real node, which waits for a person). It stops early with
// ErrDryRun when the action was a dry run, and with an error when the
// action failed.
func (l *Loop) Run(ctx context.Context, last Stage) error {
	for l.next <= last && l.next <= StageResolvedReceived {
		st := l.next
		var err error
		switch st {
		case StageWorkload:
			err = l.workload(ctx)
		case StageKilled:
			err = l.kill()
		case StageDetected:
			err = l.detect(ctx)
		case StageScraped:
			err = l.scraped(ctx)
		case StagePending, StageFiring:
			err = l.alert(ctx, st)
		case StageRouted:
			err = l.routed(ctx)
		case StageReceived:
			err = l.received(ctx)
		case StagePlanned, StageSignal, StageFinished:
			err = l.act(ctx)
			st = StageFinished
		case StageMemoryBack:
			err = l.memoryBack(ctx)
		case StageResolved:
			err = l.resolved(ctx)
		case StageResolvedReceived:
			err = l.resolvedReceived(ctx)
		}
		if err != nil {
			return err
		}
		l.next = st + 1
	}
	return nil
}

func (l *Loop) emit(ev Event) {
	ev.Start = l.Start
	l.s.emit(ev)
}

// warn tells of a fault once.
func (l *Loop) warn(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if !l.warned[msg] {
		l.warned[msg] = true
		l.emit(Event{Stage: l.next, Text: msg, Warning: true})
	}
}

// Account reads one GPU from the exporter.
func (s *Stack) Account(ctx context.Context, gpu int) (GPUAccount, error) {
	mfs, err := Scrape(ctx, s.URLs.Exporter+"/metrics")
	if err != nil {
		return GPUAccount{}, err
	}
	sel := map[string]string{"gpu": strconv.Itoa(gpu)}
	a := GPUAccount{GPU: gpu}
	a.Used, _ = Value(mfs, "gpu_orphan_memory_used_bytes", sel)
	a.OwnedLive, _ = Value(mfs, "gpu_orphan_memory_owned_live_bytes", sel)
	a.Unowned, _ = Value(mfs, "gpu_orphan_unowned_memory_bytes", sel)
	a.Suspects, _ = Value(mfs, "gpu_orphan_suspect_holders", sel)
	if ms := Series(mfs, "gpu_orphan_memory_used_bytes", sel); len(ms) > 0 {
		a.UUID = Label(ms[0], "uuid")
	}
	for _, m := range Series(mfs, "gpu_orphan_holder_info", sel) {
		pid, _ := strconv.Atoi(Label(m, "pid"))
		a.Holders = append(a.Holders, Holder{PID: pid, Comm: Label(m, "comm"), Reason: Label(m, "reason")})
	}
	slices.SortFunc(a.Holders, func(x, y Holder) int { return x.PID - y.PID })
	for _, m := range Series(mfs, "gpu_orphan_process_memory_bytes", map[string]string{"gpu": sel["gpu"], "alive": "false"}) {
		pid, _ := strconv.Atoi(Label(m, "pid"))
		a.DeadPIDs = append(a.DeadPIDs, pid)
	}
	slices.Sort(a.DeadPIDs)
	return a, nil
}

// firstOrphan finds the first GPU with more than min bytes with no live
// owner, or -1.
func (s *Stack) firstOrphan(ctx context.Context, min uint64) (int, error) {
	mfs, err := Scrape(ctx, s.URLs.Exporter+"/metrics")
	if err != nil {
		return -1, err
	}
	best := -1
	for _, m := range Series(mfs, "gpu_orphan_unowned_memory_bytes", nil) {
		gpu, err := strconv.Atoi(Label(m, "gpu"))
		if err == nil && m.GetGauge().GetValue() > float64(min) && (best < 0 || gpu < best) {
			best = gpu
		}
	}
	return best, nil
}

func (l *Loop) workload(ctx context.Context) error {
	c := l.cfg
	// The remediator's recorded descendants before the job: the job's
	// children add to them once the remediator has seen the job alive.
	base, err := l.s.recordedDescendants(ctx)
	if err != nil {
		return err
	}
	w, err := l.s.StartWorkload(ctx, c.GPU, c.MiB, c.Children)
	if err != nil {
		return err
	}
	l.Workload = w
	l.emit(Event{Stage: StageWorkload,
		Text: fmt.Sprintf("gpu-orphan-sim run --gpu %d --mib %d --children %d (its own session, like a scheduler's job)", c.GPU, c.MiB, c.Children),
		More: []string{fmt.Sprintf("parent %d allocated %d MiB on GPU %d and forked %s, which inherited its context",
			w.PID, c.MiB, c.GPU, joinInts(w.Children, " "))}})
	// The exporter must have seen the owner alive first: what it reports
	// after the SIGKILL is then the orphan, not a start-up blur.
	mib := float64(uint64(c.MiB) << 20)
	if err := l.s.poll(ctx, 10*time.Second, "the exporter to see the live workload", func() (bool, string) {
		a, err := l.s.Account(ctx, c.GPU)
		if err != nil {
			return false, err.Error()
		}
		l.Live = a
		return a.Used >= mib && a.OwnedLive >= mib, fmt.Sprintf("used %.0f, owned by live %.0f", a.Used, a.OwnedLive)
	}); err != nil {
		return err
	}
	// So must the remediator, whose own snapshots remember who the owner
	// was (user, command, Slurm job) and record its children's descent:
	// killed before its next snapshot, the owner would be "unknown" in
	// the action and the report, and its children unproven heirs.
	return l.s.poll(ctx, 10*time.Second, "the remediator to see the live workload", func() (bool, string) {
		n, err := l.s.recordedDescendants(ctx)
		if err != nil {
			return false, err.Error()
		}
		base = min(base, n) // descent of owners long gone is forgotten meanwhile
		return n >= base+len(w.Children), fmt.Sprintf("recorded descendants %d, %d before the workload", n, base)
	})
}

// recordedDescendants is the remediator's
// gpu_orphan_remediator_recorded_descendants: the processes it saw
// descending from a live owner while holding its GPU.
func (s *Stack) recordedDescendants(ctx context.Context) (int, error) {
	mfs, err := Scrape(ctx, s.URLs.Remediator+"/metrics")
	if err != nil {
		return 0, err
	}
	v, ok := Value(mfs, "gpu_orphan_remediator_recorded_descendants", nil)
	if !ok {
		return 0, errors.New("the remediator has no gpu_orphan_remediator_recorded_descendants")
	}
	return int(v), nil
}

func (l *Loop) kill() error {
	w := l.Workload
	l.Start = time.Now()
	if err := w.KillParent(); err != nil {
		return err
	}
	l.emit(Event{Stage: StageKilled, At: l.Start, Text: fmt.Sprintf("%d: the parent is dead; its children %s still hold its GPU memory",
		w.PID, joinInts(w.Children, " "))})
	return nil
}

func (l *Loop) detect(ctx context.Context) error {
	timeout := 10 * time.Second
	if l.Workload == nil {
		timeout = 0 // someone makes the orphan, whenever
	}
	var want []int
	if l.Workload != nil {
		want = sorted(l.Workload.Children)
	}
	err := l.s.poll(ctx, timeout, "the exporter to report the orphan", func() (bool, string) {
		if l.cfg.GPU < 0 {
			g, err := l.s.firstOrphan(ctx, l.cfg.MinBytes)
			if err != nil || g < 0 {
				return false, errString(err)
			}
			l.cfg.GPU = g
		}
		a, err := l.s.Account(ctx, l.cfg.GPU)
		if err != nil {
			return false, err.Error()
		}
		l.Orphan = a
		var inherited []int
		for _, h := range a.Holders {
			if h.Reason == "inherited_from_dead_owner" {
				inherited = append(inherited, h.PID)
			}
		}
		ok := a.Unowned >= float64(l.cfg.MinBytes)
		if want != nil { // the simulated job's children must be the suspects
			ok = ok && a.Suspects >= float64(len(want)) && slices.Equal(inherited, want)
		}
		return ok, fmt.Sprintf("unowned %.0f, suspects %.0f, holders %v", a.Unowned, a.Suspects, inherited)
	})
	if err != nil {
		return err
	}
	a := l.Orphan
	l.UUID = a.UUID
	if l.Start.IsZero() {
		l.Start = time.Now() // a real node: the clock starts here
	}
	dead := "?"
	if len(a.DeadPIDs) > 0 {
		dead = joinInts(a.DeadPIDs, " ")
	}
	var holders []string
	for _, h := range a.Holders {
		holders = append(holders, fmt.Sprintf("%d (%s, %s)", h.PID, h.Comm, h.Reason))
	}
	if holders == nil {
		holders = []string{"none yet"}
	}
	l.emit(Event{Stage: StageDetected,
		Text: fmt.Sprintf("exporter: GPU %d has %d MiB with no live owner; NVML still names dead PID %s", a.GPU, mib(a.Unowned), dead),
		More: []string{"suspect holders: " + strings.Join(holders, ", ")}})
	return nil
}

func (l *Loop) scraped(ctx context.Context) error {
	q := fmt.Sprintf(`gpu_orphan_unowned_memory_bytes{job="gpu-orphan-exporter",node=%q,gpu="%d"}`, l.s.cfg.NodeName, l.cfg.GPU)
	var v float64
	err := l.s.poll(ctx, 10*time.Second, "Prometheus to have the series", func() (bool, string) {
		ss, err := l.s.Query(ctx, q)
		if err != nil || len(ss) != 1 {
			return false, fmt.Sprint(ss, errString(err))
		}
		v = ss[0].Float()
		return v >= float64(l.cfg.MinBytes) && ss[0].Metric["uuid"] == l.UUID, fmt.Sprint(ss)
	})
	if err != nil {
		return err
	}
	l.emit(Event{Stage: StageScraped, Text: fmt.Sprintf("Prometheus: %s = %d MiB", q, mib(v))})
	return nil
}

// alertLabels are the labels GPUOrphanMemory must carry.
func (l *Loop) alertLabels() map[string]string {
	return map[string]string{"alertname": alertName, "node": l.s.cfg.NodeName, "gpu": strconv.Itoa(l.cfg.GPU),
		"uuid": l.UUID, "severity": "warning"}
}

// alert waits for GPUOrphanMemory to be pending, or firing.
func (l *Loop) alert(ctx context.Context, st Stage) error {
	want, state, timeout := l.alertLabels(), "pending", 20*time.Second
	if st == StageFiring {
		state, timeout = "firing", 15*time.Second
	}
	err := l.s.poll(ctx, timeout, alertName+" to be "+state, func() (bool, string) {
		as, err := l.s.PromAlerts(ctx)
		if err != nil {
			return false, err.Error()
		}
		var seen []string
		found := PromAlert{}
		for _, a := range as {
			seen = append(seen, a.Labels["alertname"]+"/"+a.Labels["gpu"]+"="+a.State)
			if l.cfg.Sole && a.Labels["alertname"] == alertName && a.Labels["gpu"] != want["gpu"] {
				l.warn("%s for GPU %s, which holds nothing: %v", alertName, a.Labels["gpu"], a.Labels)
			}
			if matches(a.Labels, want) {
				found = a
			}
		}
		if st == StagePending && found.State == "firing" {
			l.warn("%s was firing before it was seen pending (for: %s)", alertName, promDuration(l.s.cfg.For))
			l.Alert = found
			return true, ""
		}
		if found.State == state {
			l.Alert = found
		}
		return found.State == state, fmt.Sprint(seen)
	})
	if err != nil {
		return err
	}
	labels := fmt.Sprintf("%s{node=%q,gpu=%q}", alertName, want["node"], want["gpu"])
	if st == StagePending {
		l.emit(Event{Stage: StagePending, At: l.Alert.ActiveAt, Text: fmt.Sprintf("Prometheus: %s (age > %ds; fires after %s)",
			labels, l.s.cfg.AgeThreshold, promDuration(l.s.cfg.For))})
	} else {
		l.emit(Event{Stage: StageFiring, Text: "Prometheus: " + labels + " fires, and goes to Alertmanager"})
	}
	return nil
}

func (l *Loop) routed(ctx context.Context) error {
	want := l.alertLabels()
	err := l.s.poll(ctx, 10*time.Second, "Alertmanager to have the alert", func() (bool, string) {
		as, err := l.s.AMAlerts(ctx)
		if err != nil {
			return false, err.Error()
		}
		for _, a := range as {
			if matches(a.Labels, want) && a.Status.State == "active" && a.SentTo(remediatorReceiver) {
				l.Routed = a
				return true, ""
			}
		}
		return false, fmt.Sprint(as)
	})
	if err != nil {
		return err
	}
	var rs []string
	for _, r := range l.Routed.Receivers {
		rs = append(rs, r.Name)
	}
	l.emit(Event{Stage: StageRouted, Text: fmt.Sprintf("Alertmanager routes it (fingerprint %s) to: %s", l.Routed.Fingerprint, strings.Join(rs, ", "))})
	return nil
}

// findAction looks for the action for the loop's GPU.
func (l *Loop) findAction(ctx context.Context) (bool, string) {
	as, err := l.s.Actions(ctx)
	if err != nil {
		return false, err.Error()
	}
	var ours []Action
	for _, a := range as {
		switch {
		case a.GPUUUID == l.UUID:
			ours = append(ours, a)
		case l.cfg.Sole:
			l.warn("an action for GPU %s, which holds nothing: %s %s", a.GPUUUID, a.ID, a.State)
		}
	}
	if len(ours) > 1 {
		l.warn("%d actions for one alert, want 1", len(ours))
	}
	if len(ours) == 0 {
		return false, "no action"
	}
	l.Action = ours[len(ours)-1] // the oldest: the one the alert made
	return true, l.Action.State
}

func (l *Loop) received(ctx context.Context) error {
	if err := l.s.poll(ctx, 15*time.Second, "the remediator to receive the alert", func() (bool, string) {
		return l.findAction(ctx)
	}); err != nil {
		return err
	}
	a := l.Action
	l.emit(Event{Stage: StageReceived, At: a.StartedAt,
		Text: fmt.Sprintf("remediator: the webhook delivered the alert; action %s (%s)", a.ID, a.Source),
		More: []string{fmt.Sprintf(`details: curl -sH "Authorization: Bearer $(cat %s)" %s/api/v1/actions/%s`, l.s.TokenFile, l.s.URLs.Remediator, a.ID)}})
	return nil
}

// act follows the action to its end: the plan, each signal, the outcome.
func (l *Loop) act(ctx context.Context) error {
	planned := l.next > StagePlanned
	err := l.s.poll(ctx, 25*time.Second, "the action to finish", func() (bool, string) {
		a, err := l.s.Action(ctx, l.Action.ID)
		if err != nil {
			return false, err.Error()
		}
		l.Action = a
		if !planned && len(a.Targets) > 0 {
			planned = true
			var more []string
			for _, o := range a.DeadOwners {
				more = append(more, "left by "+o.Who())
			}
			for _, t := range a.Targets {
				group := ""
				if t.WholeGroup {
					group = fmt.Sprintf(", with its whole process group %d", t.PGID)
				}
				more = append(more, fmt.Sprintf("kill %d (%s): %s%s", t.PID, t.Comm, t.Reason, group))
			}
			l.emit(Event{Stage: StagePlanned, At: eventAt(a, "plan"), Text: fmt.Sprintf("policy %s, from a fresh snapshot:", a.Policy), More: more})
		}
		for _, e := range a.Events {
			if e.Kind != "signal" {
				continue
			}
			var d struct {
				PID    int    `json:"pid"`
				Signal string `json:"signal"`
			}
			if err := json.Unmarshal(e.Detail, &d); err != nil {
				continue // not a signal's detail: nothing to narrate
			}
			key := fmt.Sprintf("%d %s %s", d.PID, d.Signal, e.At)
			if !l.printed[key] {
				l.printed[key] = true
				l.emit(Event{Stage: StageSignal, At: e.At, Text: fmt.Sprintf("%s → %d", d.Signal, d.PID)})
			}
		}
		return a.State != StateQueued && a.State != StateRunning, a.State + " " + string(a.Reason)
	})
	if err != nil {
		return err
	}
	a := l.Action
	var outcomes []string
	for _, t := range a.Targets {
		if t.Outcome != "" {
			outcomes = append(outcomes, fmt.Sprintf("%d: %s (%s)", t.PID, t.Outcome, strings.Join(t.Signals, ", ")))
		}
	}
	at := time.Time{}
	if a.FinishedAt != nil {
		at = *a.FinishedAt
	}
	switch a.State {
	case StateSucceeded:
		l.emit(Event{Stage: StageFinished, At: at, Text: fmt.Sprintf("succeeded: freed %d MiB, verified %.2f s after the first signal",
			a.FreedBytes>>20, a.VerifySeconds), More: outcomes})
		return nil
	case StateDryRun:
		l.emit(Event{Stage: StageFinished, At: at, Text: "dry run: the plan is recorded, nothing was signalled; the memory stays"})
		return ErrDryRun
	}
	l.emit(Event{Stage: StageFinished, At: at, Warning: true, Text: fmt.Sprintf("%s: %s", a.State, a.Reason), More: outcomes})
	err = fmt.Errorf("action %s finished %s: %s", a.ID, a.State, a.Reason)
	if a.NextStep != "" {
		err = fmt.Errorf("%w; next step: %s", err, a.NextStep)
	}
	for _, lo := range a.Leftover {
		err = fmt.Errorf("%w; left: %d %s %s", err, lo.PID, lo.Kind, lo.Detail)
	}
	return err
}

// memoryBack waits until the exporter sees the memory back: on a simulated
// node, the GPU used by nothing (and the simulated driver agrees); on a
// real one, less than MinBytes with no live owner.
func (l *Loop) memoryBack(ctx context.Context) error {
	var drv *sim.Driver
	if l.s.SimRoot != "" {
		var err error
		if drv, err = sim.NewDriver(l.s.SimRoot); err != nil {
			return err
		}
	}
	err := l.s.poll(ctx, 15*time.Second, fmt.Sprintf("GPU %d's memory to be back", l.cfg.GPU), func() (bool, string) {
		a, err := l.s.Account(ctx, l.cfg.GPU)
		if err != nil {
			return false, err.Error()
		}
		l.Back = a
		if drv == nil {
			return a.Unowned < float64(l.cfg.MinBytes), fmt.Sprintf("exporter unowned %.0f", a.Unowned)
		}
		rs, err := drv.Read(ctx)
		if err != nil {
			return false, err.Error()
		}
		l.DriverUsed = rs[l.cfg.GPU].Memory.Used
		return l.DriverUsed == 0 && a.Used == 0 && a.Unowned == 0,
			fmt.Sprintf("driver used %d, exporter used %.0f unowned %.0f", l.DriverUsed, a.Used, a.Unowned)
	})
	if err != nil {
		return err
	}
	a := l.Action
	before, after := uint64(0), uint64(0)
	if a.Before != nil {
		before = a.Before.UsedBytes
	}
	if a.After != nil {
		after = a.After.UsedBytes
	}
	l.emit(Event{Stage: StageMemoryBack, At: eventAt(a, "verify"),
		Text: fmt.Sprintf("freed %d MiB, verified %.2f s after the first signal (%d → %d MiB used; exporter now: %d MiB)",
			a.FreedBytes>>20, a.VerifySeconds, before>>20, after>>20, mib(l.Back.Used))})
	return nil
}

func (l *Loop) resolved(ctx context.Context) error {
	want := l.alertLabels()
	err := l.s.poll(ctx, 30*time.Second, alertName+" to resolve in Prometheus", func() (bool, string) {
		as, err := l.s.PromAlerts(ctx)
		if err != nil {
			return false, err.Error()
		}
		for _, a := range as {
			if matches(a.Labels, want) {
				return false, a.State
			}
		}
		return true, ""
	})
	if err != nil {
		return err
	}
	l.emit(Event{Stage: StageResolved, Text: "Prometheus: " + alertName + " is no longer active; Alertmanager sends the resolution"})
	return nil
}

func (l *Loop) resolvedReceived(ctx context.Context) error {
	var v float64
	err := l.s.poll(ctx, 20*time.Second, "the remediator to receive the resolved notification", func() (bool, string) {
		mfs, err := Scrape(ctx, l.s.URLs.Remediator+"/metrics")
		if err != nil {
			return false, err.Error()
		}
		v, _ = Value(mfs, "gpu_orphan_remediator_notifications_total", map[string]string{"result": "resolved"})
		return v >= 1, fmt.Sprintf("resolved %.0f", v)
	})
	if err != nil {
		return err
	}
	l.emit(Event{Stage: StageResolvedReceived, Text: "remediator: the resolved notification arrived (send_resolved: true)"})
	return nil
}

// eventAt is when the action's first event of kind happened.
func eventAt(a Action, kind string) time.Time {
	for _, e := range a.Events {
		if e.Kind == kind {
			return e.At
		}
	}
	return time.Time{}
}

// matches reports whether labels include every pair of want.
func matches(labels, want map[string]string) bool {
	for k, v := range want {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func mib(b float64) int64 { return int64(b) >> 20 }

func sorted(s []int) []int {
	c := slices.Clone(s)
	slices.Sort(c)
	return c
}

func joinInts(s []int, sep string) string {
	var b strings.Builder
	for i, v := range s {
		if i > 0 {
			b.WriteString(sep)
		}
		b.WriteString(strconv.Itoa(v))
	}
	return b.String()
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
