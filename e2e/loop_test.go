//go:build e2e

package e2e

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql/parser"
	"sigs.k8s.io/yaml"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

const (
	nodeName = "e2e-node"
	// The test copy of the rules: GPUOrphanMemory fires when the memory
	// has had no live owner for more than ageThreshold seconds (120 in
	// the shipped file), held for forDuration (1m).
	ageThreshold = 3
	forDuration  = "2s"
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
// verifies that the memory came back; then the alert resolves.
func TestLoop(t *testing.T) {
	promBin := tool(t, "prometheus")
	amBin := tool(t, "alertmanager", "prometheus-alertmanager")
	setupStart := time.Now()
	bin(t, "gpu-orphan-sim") // builds cmd/ once, into a dir TestMain removes

	// Registered first, so it runs after every other cleanup: nothing the
	// test started may be left running.
	var started []int
	t.Cleanup(func() {
		for _, pid := range started {
			if testenv.Alive(pid) {
				t.Errorf("process %d is still running after the test", pid)
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})

	dir := t.TempDir()
	root := testenv.SimNode(t, 2)
	node, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	uuid := node.GPUs[orphanGPU].UUID

	token := randomToken(t)
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	expAddr, remAddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
	promAddr, amAddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
	expURL, remURL := "http://"+expAddr, "http://"+remAddr
	promURL, amURL := "http://"+promAddr, "http://"+amAddr

	rulesFile := filepath.Join(dir, "gpu-orphan.rules.yml")
	shipped := shortenRules(t, rulesFile, ageThreshold, forDuration)
	checkRulesCopy(t, shipped, rulesFile)
	promConfig := filepath.Join(dir, "prometheus.yml")
	fillTemplate(t, "prometheus.yml.tmpl", promConfig, map[string]string{
		"RULES": rulesFile, "ALERTMANAGER": amAddr, "EXPORTER": expAddr, "REMEDIATOR": remAddr, "NODE": nodeName,
	})
	amConfig := filepath.Join(dir, "alertmanager.yml")
	fillTemplate(t, "alertmanager.yml.tmpl", amConfig, map[string]string{"REMEDIATOR": remAddr, "TOKEN_FILE": tokenFile})

	logs := filepath.Join(dir, "logs")
	if err := os.Mkdir(logs, 0o755); err != nil {
		t.Fatal(err)
	}
	exporter := startDaemon(t, logs, "gpu-orphan-exporter", bin(t, "gpu-orphan-exporter"),
		"--backend=sim", "--sim.root="+root, "--collector.interval=500ms",
		"--web.listen-address="+expAddr, "--log.level=debug")
	remediator := startDaemon(t, logs, "gpu-orphan-remediator", bin(t, "gpu-orphan-remediator"),
		"--role=node", "--act", "--node.name="+nodeName, "--backend=sim", "--sim.root="+root,
		"--auth.token-file="+tokenFile, "--store.path="+filepath.Join(dir, "remediator.db"),
		"--web.listen-address="+remAddr, "--collector.interval=500ms",
		"--remediate.min-age=2s", "--remediate.grace=2s", "--remediate.verify-timeout=10s", "--log.level=debug")
	alertmanager := startDaemon(t, logs, "alertmanager", amBin,
		"--config.file="+amConfig, "--storage.path="+filepath.Join(dir, "alertmanager"),
		"--web.listen-address="+amAddr, "--cluster.listen-address=", "--log.level=debug")
	prometheus := startDaemon(t, logs, "prometheus", promBin,
		"--config.file="+promConfig, "--storage.tsdb.path="+filepath.Join(dir, "prometheus"),
		"--web.listen-address="+promAddr, "--log.level=debug")
	daemons := []*daemon{exporter, remediator, alertmanager, prometheus}
	for _, d := range daemons {
		started = append(started, d.cmd.Process.Pid)
	}
	alive := func() error {
		for _, d := range daemons {
			if err := d.exited(); err != nil {
				return err
			}
		}
		return nil
	}

	for _, u := range []string{expURL + "/metrics", remURL + "/-/ready", amURL + "/-/ready", promURL + "/-/ready"} {
		waitFor(t, 30*time.Second, u+" to answer 200", alive, func() (bool, string) {
			code := statusOf(u, "")
			return code == 200, fmt.Sprintf("status %d", code)
		})
	}
	waitFor(t, 20*time.Second, "Prometheus to scrape both targets", alive, func() (bool, string) {
		s, err := promQuery(promURL, `up{node="`+nodeName+`"} == 1`)
		if err != nil {
			return false, err.Error()
		}
		var jobs []string
		for _, x := range s {
			jobs = append(jobs, x.Metric["job"])
		}
		slices.Sort(jobs)
		return slices.Equal(jobs, []string{"gpu-orphan-exporter", "gpu-orphan-remediator"}), fmt.Sprint(jobs)
	})
	checkLoadedRule(t, promURL)
	if code := statusOf(remURL+"/api/v1/actions", ""); code != 401 {
		t.Fatalf("GET /api/v1/actions without a token: %d, want 401", code)
	}
	if code := statusOf(remURL+"/api/v1/actions", token); code != 200 {
		t.Fatalf("GET /api/v1/actions with the token: %d, want 200", code)
	}

	// The workload, while its parent lives: its memory has a live owner.
	w := testenv.StartWorkload(t, root, orphanGPU, orphanMiB, children)
	started = append(started, w.PID)
	started = append(started, w.Children...)
	sel := map[string]string{"gpu": strconv.Itoa(orphanGPU)}
	waitFor(t, 10*time.Second, "the exporter to see the live workload", alive, func() (bool, string) {
		_, mfs := testenv.Scrape(t, expURL+"/metrics")
		used, _ := testenv.Value(mfs, "gpu_orphan_memory_used_bytes", sel)
		live, _ := testenv.Value(mfs, "gpu_orphan_memory_owned_live_bytes", sel)
		return used >= testenv.MiB(orphanMiB) && live >= testenv.MiB(orphanMiB), fmt.Sprintf("used %.0f, owned by live %.0f", used, live)
	})
	_, mfs := testenv.Scrape(t, expURL+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", sel); v >= testenv.MiB(orphanMiB) {
		t.Fatalf("memory with no live owner %.0f while the owner lives", v)
	}
	setup := time.Since(setupStart)
	t.Logf("stack up and workload running after %.2fs (parent %d, children %v)", setup.Seconds(), w.PID, w.Children)

	tl := &timeline{t0: time.Now()}
	t.Cleanup(func() { writeSummary(t, tl, setup) })
	w.KillParent(t)
	tl.mark(t, "parent SIGKILLed", fmt.Sprintf("pid %d; children %v hold GPU %d", w.PID, w.Children, orphanGPU))

	// 1. The exporter: the memory has no live owner, and the children are
	// the suspects.
	waitFor(t, 10*time.Second, "the exporter to report the orphan", alive, func() (bool, string) {
		_, mfs := testenv.Scrape(t, expURL+"/metrics")
		unowned, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", sel)
		suspects, _ := testenv.Value(mfs, "gpu_orphan_suspect_holders", sel)
		var pids []int
		for _, m := range testenv.Series(mfs, "gpu_orphan_holder_info", sel) {
			if testenv.Label(m, "reason") == "inherited_from_dead_owner" {
				pid, _ := strconv.Atoi(testenv.Label(m, "pid"))
				pids = append(pids, pid)
			}
		}
		slices.Sort(pids)
		return unowned >= testenv.MiB(orphanMiB) && suspects >= children && slices.Equal(pids, sorted(w.Children)),
			fmt.Sprintf("unowned %.0f, suspects %.0f, holders %v", unowned, suspects, pids)
	})
	tl.mark(t, "exporter reports the orphan", fmt.Sprintf(">= %d MiB with no live owner on GPU %d, suspects %v", orphanMiB, orphanGPU, w.Children))

	// 2. Prometheus has scraped it, with the node label.
	waitFor(t, 10*time.Second, "Prometheus to have the series", alive, func() (bool, string) {
		s, err := promQuery(promURL, fmt.Sprintf(`gpu_orphan_unowned_memory_bytes{job="gpu-orphan-exporter",node=%q,gpu="%d"}`, nodeName, orphanGPU))
		if err != nil || len(s) != 1 {
			return false, fmt.Sprint(s, errString(err))
		}
		return s[0].float() >= testenv.MiB(orphanMiB) && s[0].Metric["uuid"] == uuid, fmt.Sprint(s)
	})
	tl.mark(t, "Prometheus has the series", "gpu_orphan_unowned_memory_bytes{node="+nodeName+"} >= 4096 MiB")

	// 3. The alert: pending, then firing.
	want := map[string]string{"alertname": alertName, "node": nodeName, "gpu": strconv.Itoa(orphanGPU), "uuid": uuid, "severity": "warning"}
	alertState := func() (string, string) {
		as, err := promAlerts(promURL)
		if err != nil {
			return "", err.Error()
		}
		var seen []string
		state := ""
		for _, a := range as {
			seen = append(seen, a.Labels["alertname"]+"/"+a.Labels["gpu"]+"="+a.State)
			if a.Labels["alertname"] == alertName && a.Labels["gpu"] != strconv.Itoa(orphanGPU) {
				t.Errorf("%s for GPU %s, which holds nothing: %v", alertName, a.Labels["gpu"], a.Labels)
			}
			if matches(a.Labels, want) {
				state = a.State
			}
		}
		return state, fmt.Sprint(seen)
	}
	waitFor(t, 20*time.Second, "GPUOrphanMemory to be pending", alive, func() (bool, string) {
		s, seen := alertState()
		if s == "firing" {
			t.Fatalf("GPUOrphanMemory was firing before it was seen pending (for: %s)", forDuration)
		}
		return s == "pending", seen
	})
	tl.mark(t, "alert pending (Prometheus)", fmt.Sprintf("age > %d s", ageThreshold))
	waitFor(t, 15*time.Second, "GPUOrphanMemory to fire", alive, func() (bool, string) {
		s, seen := alertState()
		return s == "firing", seen
	})
	tl.mark(t, "alert firing (Prometheus)", "for: "+forDuration)

	// 4. Alertmanager has it, for the remediator's receiver.
	var amA amAlert
	waitFor(t, 10*time.Second, "Alertmanager to have the alert", alive, func() (bool, string) {
		as, err := amAlerts(amURL)
		if err != nil {
			return false, err.Error()
		}
		for _, a := range as {
			if matches(a.Labels, want) && a.Status.State == "active" && a.sentTo("gpu-orphan-remediator") {
				amA = a
				return true, ""
			}
		}
		return false, fmt.Sprint(as)
	})
	tl.mark(t, "Alertmanager has it", "fingerprint "+amA.Fingerprint+", receiver gpu-orphan-remediator")

	// 5. The remediator received it: an action for that GPU.
	var act remediate.Action
	findAction := func() (bool, string) {
		var as []remediate.Action
		if err := getJSON(remURL+"/api/v1/actions", token, &as); err != nil {
			return false, err.Error()
		}
		for _, a := range as {
			if a.GPUUUID != uuid {
				t.Fatalf("an action for %s, which holds nothing: %+v", a.GPUUUID, a)
			}
		}
		if len(as) > 1 {
			t.Fatalf("%d actions for one alert, want 1: %+v", len(as), as)
		}
		if len(as) == 1 {
			act = as[0]
			return true, string(act.State)
		}
		return false, "no action"
	}
	waitFor(t, 15*time.Second, "the remediator to receive the alert", alive, findAction)
	tl.mark(t, "remediator received it", fmt.Sprintf("action %s (%s, state %s)", act.ID, act.Source, act.State))
	if act.Source != "webhook" || act.Node != nodeName || act.GPUIndex != orphanGPU {
		t.Errorf("action source %q node %q gpu %d, want webhook %s %d", act.Source, act.Node, act.GPUIndex, nodeName, orphanGPU)
	}
	if act.AlertFingerprint != amA.Fingerprint || !act.AlertStartsAt.Equal(amA.StartsAt) {
		t.Errorf("action's alert %s@%s, Alertmanager's %s@%s", act.AlertFingerprint, act.AlertStartsAt, amA.Fingerprint, amA.StartsAt)
	}

	// 6. The action succeeded: the children were the targets and the
	// memory was verified back.
	waitFor(t, 25*time.Second, "the action to finish", alive, func() (bool, string) {
		findAction()
		return act.State != remediate.StateQueued && act.State != remediate.StateRunning, string(act.State) + " " + act.Reason
	})
	if act.State != remediate.StateSucceeded {
		t.Fatalf("action %s finished %s: %s (next step %q, leftover %+v)", act.ID, act.State, act.Reason, act.NextStep, act.Leftover)
	}
	var targets []int
	var outcomes []string
	for _, tg := range act.Targets {
		targets = append(targets, tg.PID)
		outcomes = append(outcomes, fmt.Sprintf("%d:%s%v", tg.PID, tg.Outcome, tg.Signals))
	}
	slices.Sort(targets)
	if !slices.Equal(targets, sorted(w.Children)) {
		t.Errorf("targets %v, want the children %v", targets, w.Children)
	}
	if act.FreedBytes < uint64(orphanMiB)<<20 {
		t.Errorf("freed %d bytes, want >= %d MiB", act.FreedBytes, orphanMiB)
	}
	tl.mark(t, "action succeeded", fmt.Sprintf("freed %d MiB, verified in %.2fs, targets %v", act.FreedBytes>>20, act.VerifySeconds, outcomes))

	// 7. The GPU's memory is back: the simulated driver and the exporter.
	drv, err := sim.NewDriver(root)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "GPU 1's memory to be back", alive, func() (bool, string) {
		rs, err := drv.Read(t.Context())
		if err != nil {
			return false, err.Error()
		}
		_, mfs := testenv.Scrape(t, expURL+"/metrics")
		used, _ := testenv.Value(mfs, "gpu_orphan_memory_used_bytes", sel)
		unowned, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", sel)
		return rs[orphanGPU].Memory.Used == 0 && used == 0 && unowned == 0,
			fmt.Sprintf("driver used %d, exporter used %.0f unowned %.0f", rs[orphanGPU].Memory.Used, used, unowned)
	})
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("child %d is still alive", c)
		}
	}
	tl.mark(t, "GPU memory back to 0", "simulated driver and exporter scrape")

	// 8. The audit record: evidence before and after, and the events.
	checkAudit(t, remURL, token, act.ID, w)
	tl.mark(t, "audit record checked", "before/after evidence, plan → signals → verify")

	// 9. The alert resolves, and the remediator hears of it.
	waitFor(t, 30*time.Second, "GPUOrphanMemory to resolve in Prometheus", alive, func() (bool, string) {
		s, seen := alertState()
		return s == "", seen
	})
	tl.mark(t, "alert resolved (Prometheus)", "")
	waitFor(t, 20*time.Second, "the remediator to receive the resolved notification", alive, func() (bool, string) {
		_, mfs := testenv.Scrape(t, remURL+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_notifications_total", map[string]string{"result": "resolved"})
		return v >= 1, fmt.Sprintf("resolved %.0f", v)
	})
	tl.mark(t, "resolved notification at the remediator", "send_resolved: true")

	// What the remediator counted: one accepted alert, one success, and no
	// authentication failure but the test's own request without a token.
	_, mfs = testenv.Scrape(t, remURL+"/metrics")
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"gpu_orphan_remediator_notifications_total", map[string]string{"result": "accepted"}, 1},
		{"gpu_orphan_remediator_actions_total", map[string]string{"state": "succeeded"}, 1},
		{"gpu_orphan_remediator_auth_failures_total", nil, 1},
	} {
		if v, ok := testenv.Value(mfs, c.name, c.labels); !ok || v != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_freed_bytes_total", nil); v < testenv.MiB(orphanMiB) {
		t.Errorf("gpu_orphan_remediator_freed_bytes_total %.0f, want >= %d MiB", v, orphanMiB)
	}
}

// checkAudit reads one action with its events and checks its evidence.
func checkAudit(t *testing.T, remURL, token, id string, w *testenv.Workload) {
	t.Helper()
	var a struct {
		remediate.Action
		Events []struct {
			Kind   string          `json:"kind"`
			At     time.Time       `json:"at"`
			Detail json.RawMessage `json:"detail"`
		} `json:"events"`
	}
	if err := getJSON(remURL+"/api/v1/actions/"+id, token, &a); err != nil {
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
			json.Unmarshal(e.Detail, &d)
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
			if c["for"] != forDuration {
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
func checkLoadedRule(t *testing.T, promURL string) {
	t.Helper()
	var r struct {
		Data struct {
			Groups []struct {
				File  string `json:"file"`
				Rules []struct {
					Name     string  `json:"name"`
					Query    string  `json:"query"`
					Duration float64 `json:"duration"`
					Health   string  `json:"health"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := getJSON(promURL+"/api/v1/rules", "", &r); err != nil {
		t.Fatal(err)
	}
	d, _ := time.ParseDuration(forDuration)
	n := 0
	for _, g := range r.Data.Groups {
		for _, rule := range g.Rules {
			n++
			if rule.Name == alertName {
				if rule.Duration != d.Seconds() || !strings.Contains(rule.Query, fmt.Sprintf("gpu_orphan_unowned_memory_age_seconds > %d", ageThreshold)) {
					t.Fatalf("Prometheus loaded %s with for %vs and query %q", alertName, rule.Duration, rule.Query)
				}
				t.Logf("Prometheus evaluates %s from %s: %s (for %vs)", alertName, g.File, rule.Query, rule.Duration)
				return
			}
		}
	}
	t.Fatalf("Prometheus has no %s rule (%d rules)", alertName, n)
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

func randomToken(t *testing.T) string {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
