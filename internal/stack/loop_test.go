package stack

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeStack answers as the exporter, Prometheus, Alertmanager and the
// remediator do, from state the test's event hook moves on.
type fakeStack struct {
	mu         sync.Mutex
	unowned    float64
	promAlerts []PromAlert
	amAlerts   []AMAlert
	action     *Action
	resolved   float64
}

func (f *fakeStack) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	reply := func(v any) { _ = json.NewEncoder(w).Encode(v) } // as fmt.Fprintf below: the client reads what it gets
	switch p := r.URL.Path; {
	case p == "/metrics":
		l := `{gpu="1",uuid="GPU-1"}`
		fmt.Fprintf(w, "gpu_orphan_memory_used_bytes%s %g\ngpu_orphan_unowned_memory_bytes%s %g\n", l, f.unowned, l, f.unowned)
		if f.unowned > 0 {
			fmt.Fprintf(w, "gpu_orphan_suspect_holders%s 1\n", l)
			fmt.Fprintln(w, `gpu_orphan_holder_info{gpu="1",uuid="GPU-1",pid="11",comm="worker",reason="inherited_from_dead_owner"} 1`)
			fmt.Fprintln(w, `gpu_orphan_process_memory_bytes{gpu="1",uuid="GPU-1",pid="10",comm="trainer",alive="false"} 1`)
		}
		fmt.Fprintf(w, "gpu_orphan_remediator_notifications_total{result=\"resolved\"} %g\n", f.resolved)
	case p == "/api/v1/query":
		reply(map[string]any{"status": "success", "data": map[string]any{"resultType": "vector",
			"result": []Sample{{Metric: map[string]string{"uuid": "GPU-1"}, Value: [2]any{0, fmt.Sprint(f.unowned)}}}}})
	case p == "/api/v1/alerts":
		reply(map[string]any{"data": map[string]any{"alerts": f.promAlerts}})
	case p == "/api/v2/alerts":
		reply(f.amAlerts)
	case p == "/api/v1/actions":
		as := []Action{}
		if f.action != nil {
			as = append(as, *f.action)
		}
		reply(as)
	case strings.HasPrefix(p, "/api/v1/actions/") && f.action != nil:
		reply(f.action)
	default:
		http.NotFound(w, r)
	}
}

var alertLabels = map[string]string{"alertname": "GPUOrphanMemory", "node": "n", "gpu": "1", "uuid": "GPU-1", "severity": "warning"}

func promAlert(state string, labels map[string]string) PromAlert {
	return PromAlert{Labels: labels, State: state, ActiveAt: time.Now()}
}

func TestLoop(t *testing.T) {
	t0 := time.Now()
	signal := func(pid int, sig string) ActionEvent {
		return ActionEvent{Kind: "signal", At: t0, Detail: json.RawMessage(fmt.Sprintf(`{"pid":%d,"signal":%q}`, pid, sig))}
	}
	finished := func(state string) Action {
		return Action{ID: "a1", GPUUUID: "GPU-1", GPUIndex: 1, State: state, Source: "webhook", Policy: "dead-owner",
			FinishedAt: &t0, Targets: []Target{{PID: 11, PGID: 10, Comm: "worker", Reason: "inherited_from_dead_owner"}},
			Events: []ActionEvent{{Kind: "plan", At: t0}}}
	}
	for _, c := range []struct {
		name string
		// onScraped sets Prometheus's alerts once the series is there.
		onScraped []PromAlert
		// action is the action once received.
		action   func() Action
		stages   []Stage
		warnings []string
		err      string
	}{{
		name:      "succeeded",
		onScraped: []PromAlert{promAlert("pending", alertLabels)},
		action: func() Action {
			a := finished(StateSucceeded)
			a.FreedBytes, a.VerifySeconds = 4104<<20, 0.1
			a.Targets[0].Outcome, a.Targets[0].Signals = "exited_after_sigterm", []string{"SIGTERM"}
			a.Events = append(a.Events, signal(11, "SIGTERM"), signal(11, "SIGCONT"), ActionEvent{Kind: "verify", At: t0})
			return a
		},
		stages: []Stage{StageDetected, StageScraped, StagePending, StageFiring, StageRouted, StageReceived, StagePlanned,
			StageSignal, StageSignal, StageFinished, StageMemoryBack, StageResolved, StageResolvedReceived},
	}, {
		name:      "dry run",
		onScraped: []PromAlert{promAlert("pending", alertLabels)},
		action:    func() Action { return finished(StateDryRun) },
		stages:    []Stage{StageDetected, StageScraped, StagePending, StageFiring, StageRouted, StageReceived, StagePlanned, StageFinished},
		err:       ErrDryRun.Error(),
	}, {
		name:      "failed",
		onScraped: []PromAlert{promAlert("pending", alertLabels)},
		action: func() Action {
			a := finished("failed")
			a.Reason, a.NextStep = "memory_not_freed", "look at the leftover"
			return a
		},
		// The failure is told as a warning.
		stages:   []Stage{StageDetected, StageScraped, StagePending, StageFiring, StageRouted, StageReceived, StagePlanned},
		warnings: []string{"failed: memory_not_freed"},
		err:      "action a1 finished failed: memory_not_freed; next step: look at the leftover",
	}, {
		name:      "firing before pending",
		onScraped: []PromAlert{promAlert("firing", alertLabels)},
		action:    func() Action { return finished(StateDryRun) },
		stages:    []Stage{StageDetected, StageScraped, StagePending, StageFiring, StageRouted, StageReceived, StagePlanned, StageFinished},
		warnings:  []string{"GPUOrphanMemory was firing before it was seen pending (for: 2s)"},
		err:       ErrDryRun.Error(),
	}, {
		name: "an alert for another GPU",
		onScraped: []PromAlert{promAlert("pending", alertLabels),
			promAlert("pending", map[string]string{"alertname": "GPUOrphanMemory", "node": "n", "gpu": "0"})},
		action:   func() Action { return finished(StateDryRun) },
		stages:   []Stage{StageDetected, StageScraped, StagePending, StageFiring, StageRouted, StageReceived, StagePlanned, StageFinished},
		warnings: []string{"GPUOrphanMemory for GPU 0, which holds nothing: map[alertname:GPUOrphanMemory gpu:0 node:n]"},
		err:      ErrDryRun.Error(),
	}} {
		t.Run(c.name, func(t *testing.T) {
			f := &fakeStack{unowned: 4104 << 20}
			srv := httptest.NewServer(f)
			defer srv.Close()
			var stages []Stage
			var warnings []string
			// The hook moves the fake on to the next stage.
			hook := func(ev Event) {
				if ev.Warning {
					warnings = append(warnings, ev.Text)
					return
				}
				stages = append(stages, ev.Stage)
				f.mu.Lock()
				defer f.mu.Unlock()
				switch ev.Stage {
				case StageScraped:
					f.promAlerts = c.onScraped
				case StagePending:
					f.promAlerts = slices.Clone(f.promAlerts)
					f.promAlerts[0].State = "firing"
				case StageFiring:
					f.amAlerts = []AMAlert{{Labels: alertLabels, Fingerprint: "fp", StartsAt: time.Now()}}
					f.amAlerts[0].Status.State = "active"
					f.amAlerts[0].Receivers = append(f.amAlerts[0].Receivers, struct {
						Name string `json:"name"`
					}{remediatorReceiver})
				case StageRouted:
					f.action = &Action{ID: "a1", GPUUUID: "GPU-1", GPUIndex: 1, State: StateQueued, Source: "webhook"}
				case StageReceived:
					a := c.action()
					f.action = &a
				case StageFinished:
					f.unowned = 0
				case StageMemoryBack:
					f.promAlerts = nil
				case StageResolved:
					f.resolved = 1
				}
			}
			s := &Stack{cfg: Config{NodeName: "n", AgeThreshold: 3, For: 2 * time.Second, OnEvent: hook},
				URLs: URLs{Exporter: srv.URL, Remediator: srv.URL, Prometheus: srv.URL, Alertmanager: srv.URL}, Token: "tok"}
			l := s.NewLoop(LoopConfig{GPU: 1, Sole: true})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			err := l.Run(ctx, StageResolvedReceived)
			if got := errString(err); got != c.err {
				t.Errorf("error %q, want %q", got, c.err)
			}
			if c.err == ErrDryRun.Error() && !errors.Is(err, ErrDryRun) {
				t.Errorf("error %v is not ErrDryRun", err)
			}
			if !slices.Equal(stages, c.stages) {
				t.Errorf("stages\n%v, want\n%v", stages, c.stages)
			}
			if !slices.Equal(warnings, c.warnings) {
				t.Errorf("warnings %q, want %q", warnings, c.warnings)
			}
			if l.UUID != "GPU-1" || l.Orphan.Unowned != 4104<<20 || !slices.Equal(l.Orphan.DeadPIDs, []int{10}) ||
				len(l.Orphan.Holders) != 1 || l.Orphan.Holders[0] != (Holder{PID: 11, Comm: "worker", Reason: "inherited_from_dead_owner"}) {
				t.Errorf("orphan %+v", l.Orphan)
			}
		})
	}
}

// TestNarrator: the lines `make run` prints.
func TestNarrator(t *testing.T) {
	var b strings.Builder
	n := &Narrator{W: &b}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	n.Event(Event{Stage: StageUp, Text: "prometheus (pid 7) http://x/-/ready"})
	n.Event(Event{Stage: StageWorkload, Text: "gpu-orphan-sim run", More: []string{"parent 1 ..."}})
	n.Event(Event{Stage: StageKilled, Start: t0, At: t0, Text: "1: the parent is dead"})
	n.Event(Event{Stage: StageMemoryBack, Start: t0, At: t0.Add(8250 * time.Millisecond), Text: "freed 4104 MiB"})
	n.Event(Event{Stage: StageReceived, Start: t0, At: t0.Add(time.Second), Text: "two actions", Warning: true})
	n.Event(Event{Stage: StageStopped, Text: "prometheus (pid 7)"})
	want := `        started prometheus (pid 7) http://x/-/ready
        workload               gpu-orphan-sim run
        parent 1 ...
+  0.0s kill -9                1: the parent is dead
+  8.2s memory back            freed 4104 MiB
+  1.0s notification received  WARNING: two actions
        stopped prometheus (pid 7)
`
	if b.String() != want {
		t.Errorf("got\n%s\nwant\n%s", b.String(), want)
	}
}
