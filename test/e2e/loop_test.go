//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql/parser"
	"sigs.k8s.io/yaml"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/stack"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

const (
	nodeName = "e2e-node"
	// The test copy of the rules: GPUOrphanMemory fires when the memory
	// has had no live owner for more than ageThreshold seconds (120 in
	// the shipped file), held for forDuration (1m).
	ageThreshold = 3
	forDuration  = 2 * time.Second
	// The workload: 4096 MiB on GPU 1, held by two forked children.
	orphanGPU = 1
	orphanMiB = 4096
	children  = 2
	alertName = "GPUOrphanMemory"
	// summaryEnv names a file to write the stage timings to (`make e2e`
	// sets it to .run/e2e-summary.txt).
	summaryEnv = "GPU_ORPHAN_E2E_SUMMARY"
)

// TestLoop: a forked child keeps a SIGKILLed parent's GPU memory; the
// exporter reports it, Prometheus fires the project's own GPUOrphanMemory,
// Alertmanager sends it to the remediator, which kills the children and
// verifies that the memory came back; then the alert resolves. It follows
// the stages of `make run` (stack.Loop), narrated into the test's log, and
// asserts what each one saw.
func TestLoop(t *testing.T) {
	setupStart := time.Now()
	tl := &timeline{}
	var loop *stack.Loop
	hook := func(ev stack.Event) {
		switch {
		case ev.Warning:
			t.Errorf("stage %s: %s", ev.Stage, ev.Text)
		case ev.Stage == stack.StageKilled:
			tl.t0 = ev.Seen
			tl.mark("parent SIGKILLed", ev.Seen, ev.Text)
		case ev.Stage > stack.StageKilled && ev.Stage != stack.StageStopped && ev.Stage != stack.StageSignal:
			tl.mark(ev.Stage.String(), ev.Seen, ev.Text)
		}
	}
	s := startStack(t, stack.Config{NodeName: nodeName, AgeThreshold: ageThreshold, For: forDuration, LogLevel: "debug"}, hook)
	ctx := t.Context()

	checkRulesCopy(t, s.Config().RulesFile, s.RulesCopy)
	checkLoadedRule(t, s)
	if code := s.Status(ctx, "/api/v1/actions", false); code != 401 {
		t.Fatalf("GET /api/v1/actions without a token: %d, want 401", code)
	}
	if code := s.Status(ctx, "/api/v1/actions", true); code != 200 {
		t.Fatalf("GET /api/v1/actions with the token: %d, want 200", code)
	}

	// The workload, while its parent lives: its memory has a live owner.
	loop = s.NewLoop(stack.LoopConfig{GPU: orphanGPU, MiB: orphanMiB, Children: children, Sole: true})
	if err := loop.Run(ctx, stack.StageWorkload); err != nil {
		t.Fatal(err)
	}
	w := loop.Workload
	if loop.Live.Unowned >= testenv.MiB(orphanMiB) {
		t.Fatalf("memory with no live owner %.0f while the owner lives", loop.Live.Unowned)
	}
	setup := time.Since(setupStart)
	t.Logf("stack up and workload running after %.2fs (parent %d, children %v)", setup.Seconds(), w.PID, w.Children)
	t.Cleanup(func() { writeSummary(t, tl, setup) })

	// The parent's SIGKILL, then every stage up to the memory back: the
	// exporter reports the orphan with the children as its suspects,
	// Prometheus has the series, GPUOrphanMemory is pending then firing,
	// Alertmanager routes it to the remediator, whose action signals the
	// children, and the GPU's memory is back (the simulated driver and the
	// exporter say 0).
	if err := loop.Run(ctx, stack.StageMemoryBack); err != nil {
		t.Fatal(err)
	}
	if got := sorted(holderPIDs(loop.Orphan.Holders)); !slices.Equal(got, sorted(w.Children)) {
		t.Errorf("suspects %v, want the children %v", got, w.Children)
	}
	if !slices.Contains(loop.Orphan.DeadPIDs, w.PID) {
		t.Errorf("dead owners %v, want the parent %d", loop.Orphan.DeadPIDs, w.PID)
	}
	node, err := sim.Load(s.SimRoot)
	if err != nil {
		t.Fatal(err)
	}
	uuid := node.GPUs[orphanGPU].UUID
	if loop.UUID != uuid || loop.Alert.Labels["uuid"] != uuid || loop.Alert.Labels["severity"] != "warning" {
		t.Errorf("GPU %s, alert labels %v; want uuid %s", loop.UUID, loop.Alert.Labels, uuid)
	}
	act, amA := loop.Action, loop.Routed
	if act.Source != "webhook" || act.Node != nodeName || act.GPUIndex != orphanGPU {
		t.Errorf("action source %q node %q gpu %d, want webhook %s %d", act.Source, act.Node, act.GPUIndex, nodeName, orphanGPU)
	}
	if act.AlertFingerprint != amA.Fingerprint || !act.AlertStartsAt.Equal(amA.StartsAt) {
		t.Errorf("action's alert %s@%s, Alertmanager's %s@%s", act.AlertFingerprint, act.AlertStartsAt, amA.Fingerprint, amA.StartsAt)
	}
	var targets []int
	for _, tg := range act.Targets {
		targets = append(targets, tg.PID)
	}
	if !slices.Equal(sorted(targets), sorted(w.Children)) {
		t.Errorf("targets %v, want the children %v", targets, w.Children)
	}
	if me := currentUser(t); len(act.DeadOwners) != 1 || act.DeadOwners[0].PID != w.PID || !act.DeadOwners[0].Known ||
		act.DeadOwners[0].User != me || act.DeadOwners[0].Comm != "gpu-orphan-sim" {
		t.Errorf("dead owners %+v, want the parent %d, known, of user %s", act.DeadOwners, w.PID, me)
	}
	if act.FreedBytes < uint64(orphanMiB)<<20 {
		t.Errorf("freed %d bytes, want >= %d MiB", act.FreedBytes, orphanMiB)
	}
	if loop.DriverUsed != 0 || loop.Back.Used != 0 || loop.Back.Unowned != 0 {
		t.Errorf("memory back: driver used %d, exporter %+v", loop.DriverUsed, loop.Back)
	}
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("child %d is still alive", c)
		}
	}

	// The audit record: evidence before and after, and the events.
	checkAudit(t, s, act.ID, w)
	tl.mark("audit record checked", time.Now(), "before/after evidence, plan → signals → verify")

	// The alert resolves, and the remediator hears of it.
	if err := loop.Run(ctx, stack.StageResolvedReceived); err != nil {
		t.Fatal(err)
	}

	// What the remediator counted: one accepted alert, one success, and no
	// authentication failure but the test's own request without a token.
	mfs, err := stack.Scrape(ctx, s.URLs.Remediator+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"gpu_orphan_remediator_notifications_total", map[string]string{"result": "accepted"}, 1},
		{"gpu_orphan_remediator_actions_total", map[string]string{"state": "succeeded"}, 1},
		{"gpu_orphan_remediator_auth_failures_total", nil, 1},
	} {
		if v, ok := stack.Value(mfs, c.name, c.labels); !ok || v != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	if v, _ := stack.Value(mfs, "gpu_orphan_remediator_freed_bytes_total", nil); v < testenv.MiB(orphanMiB) {
		t.Errorf("gpu_orphan_remediator_freed_bytes_total %.0f, want >= %d MiB", v, orphanMiB)
	}
}

// checkAudit reads one action with its events and checks its evidence.
func checkAudit(t *testing.T, s *stack.Stack, id string, w *stack.Workload) {
	t.Helper()
	a, err := s.Action(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	b, a2 := a.Before, a.After
	if b == nil || a2 == nil {
		t.Fatalf("action %s lacks evidence: before %+v, after %+v", id, b, a2)
	}
	mib := uint64(orphanMiB) << 20
	if b.UsedBytes < mib || b.UnownedBytes < mib || b.UnownedAgeSeconds < 2 {
		t.Errorf("before: used %d, unowned %d, age %.1fs; want >= %d MiB and >= min-age 2s", b.UsedBytes, b.UnownedBytes, b.UnownedAgeSeconds, orphanMiB)
	}
	if !slices.Contains(b.DeadOwnerPIDs, uint32(w.PID)) {
		t.Errorf("before: dead owners %v, want the killed parent %d", b.DeadOwnerPIDs, w.PID)
	}
	for _, c := range w.Children {
		if !slices.Contains(b.HolderPIDs, c) {
			t.Errorf("before: holders %v, want the child %d", b.HolderPIDs, c)
		}
	}
	if a2.UsedBytes != 0 || a2.UnownedBytes != 0 || len(a2.HolderPIDs) != 0 || !a2.At.After(b.At) {
		t.Errorf("after: %+v (before at %s); want nothing used or held", a2, b.At)
	}
	if a.FinishedAt == nil || a.VerifySeconds <= 0 {
		t.Errorf("finished_at %v, verify_seconds %v", a.FinishedAt, a.VerifySeconds)
	}

	var kinds []string
	signalled := map[int][]string{}
	for _, e := range a.Events {
		kinds = append(kinds, e.Kind)
		if e.Kind == "signal" {
			var d struct {
				PID    int    `json:"pid"`
				Signal string `json:"signal"`
			}
			if err := json.Unmarshal(e.Detail, &d); err != nil {
				t.Fatalf("action %s: signal event %s: %v", a.ID, e.Detail, err)
			}
			signalled[d.PID] = append(signalled[d.PID], d.Signal)
		}
	}
	plan, verify := slices.Index(kinds, "plan"), slices.Index(kinds, "verify")
	firstSignal := slices.Index(kinds, "signal")
	if plan < 0 || firstSignal < plan || verify < firstSignal || verify != len(kinds)-1 {
		t.Errorf("events %v, want plan, then signals, then verify last", kinds)
	}
	for _, c := range w.Children {
		if sig := signalled[c]; len(sig) == 0 || sig[0] != "SIGTERM" {
			t.Errorf("child %d got signals %v, want SIGTERM first", c, sig)
		}
	}
	t.Logf("audit: before used %d MiB unowned %d MiB age %.1fs dead owners %v holders %v; after used %d MiB; events %v",
		b.UsedBytes>>20, b.UnownedBytes>>20, b.UnownedAgeSeconds, b.DeadOwnerPIDs, b.HolderPIDs, a2.UsedBytes>>20, kinds)
}

// rulesFile is the part of Prometheus's rule file format the check needs.
type rulesFile struct {
	Groups []struct {
		Name  string           `json:"name"`
		Rules []map[string]any `json:"rules"`
	} `json:"groups"`
}

// checkRulesCopy: the test copy differs from the shipped rules only in
// GPUOrphanMemory's `for` and the number its age is compared with.
func checkRulesCopy(t *testing.T, shippedPath, copyPath string) {
	t.Helper()
	load := func(p string) rulesFile {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var f rulesFile
		if err := yaml.UnmarshalStrict(b, &f); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		return f
	}
	shipped, test := load(shippedPath), load(copyPath)
	found := false
	for i, g := range shipped.Groups {
		for j, r := range g.Rules {
			c := test.Groups[i].Rules[j]
			if r["alert"] != alertName {
				if fmt.Sprint(r) != fmt.Sprint(c) {
					t.Fatalf("the test copy changed rule %v: %v", r["alert"], c)
				}
				continue
			}
			found = true
			if c["for"] != "2s" { // forDuration, as Prometheus writes it
				t.Fatalf("test copy: for %v, want %s", c["for"], forDuration)
			}
			want, err := parser.NewParser(parser.Options{}).ParseExpr(r["expr"].(string))
			if err != nil {
				t.Fatal(err)
			}
			replaced := 0
			parser.Inspect(want, func(n parser.Node, _ []parser.Node) error {
				if be, ok := n.(*parser.BinaryExpr); ok && be.Op == parser.GTR {
					if vs, ok := be.LHS.(*parser.VectorSelector); ok && vs.Name == "gpu_orphan_unowned_memory_age_seconds" {
						be.RHS.(*parser.NumberLiteral).Val = ageThreshold
						replaced++
					}
				}
				return nil
			})
			got, err := parser.NewParser(parser.Options{}).ParseExpr(c["expr"].(string))
			if err != nil {
				t.Fatal(err)
			}
			if replaced != 1 || got.String() != want.String() {
				t.Fatalf("test copy's expression\n%s\nis not the shipped one with the age threshold at %d:\n%s", got, ageThreshold, want)
			}
			delete(r, "for")
			delete(r, "expr")
			delete(c, "for")
			delete(c, "expr")
			if fmt.Sprint(r) != fmt.Sprint(c) {
				t.Fatalf("the test copy changed more of %s: %v", alertName, c)
			}
		}
	}
	if !found {
		t.Fatalf("no %s in %s", alertName, shippedPath)
	}
}

// checkLoadedRule: Prometheus evaluates the test copy's GPUOrphanMemory.
func checkLoadedRule(t *testing.T, s *stack.Stack) {
	t.Helper()
	rule, err := s.Rule(t.Context(), alertName)
	if err != nil {
		t.Fatal(err)
	}
	if rule.For != forDuration.Seconds() || !strings.Contains(rule.Query, fmt.Sprintf("gpu_orphan_unowned_memory_age_seconds > %d", ageThreshold)) {
		t.Fatalf("Prometheus loaded %s with for %vs and query %q", alertName, rule.For, rule.Query)
	}
	t.Logf("Prometheus evaluates %s from %s: %s (for %vs)", alertName, rule.File, rule.Query, rule.For)
}

func writeSummary(t *testing.T, tl *timeline, setup time.Duration) {
	status := "PASS"
	if t.Failed() {
		status = "FAIL"
	}
	text := fmt.Sprintf("gpu-orphan e2e (%s): the whole loop, %s\nstack start-up and workload: %.2fs\n%s",
		t.Name(), status, setup.Seconds(), tl.table())
	t.Logf("summary:\n%s", text)
	if p := os.Getenv(summaryEnv); p != "" {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
			if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
				t.Logf("writing %s: %v", p, err)
			}
		}
	}
	if p := os.Getenv("GITHUB_STEP_SUMMARY"); p != "" {
		if f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644); err == nil {
			fmt.Fprintf(f, "### gpu-orphan e2e: the whole loop (%s)\n\nStack start-up and workload: %.2fs\n\n%s\n", status, setup.Seconds(), tl.markdown())
			f.Close()
		}
	}
}

func sorted(s []int) []int {
	c := slices.Clone(s)
	slices.Sort(c)
	return c
}

func holderPIDs(hs []stack.Holder) []int {
	var pids []int
	for _, h := range hs {
		pids = append(pids, h.PID)
	}
	return pids
}
