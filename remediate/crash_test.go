package remediate_test

// Issue 16, §1: a crash must not strand an orphan. The real remediator is
// killed with SIGKILL at each step of a cleanup and restarted on the same
// store; Alertmanager then re-sends the alert, as it does every
// repeat_interval while the alert fires.

import (
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// pausableRemediator builds gpu-orphan-remediator with the crash tests'
// pause points (build tag gpuorphan_pausepoints, remediate/cleanup/
// pausepoint.go): with GPU_ORPHAN_PAUSE_AT=STEP, a cleanup stops for good at
// that step and writes its name to $GPU_ORPHAN_PAUSE_FILE. Release builds
// have no such tag.
func pausableRemediator(t *testing.T) string {
	t.Helper()
	root, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "gpu-orphan-remediator")
	args := []string{"build", "-tags", "gpuorphan_pausepoints"}
	if testenv.RaceEnabled {
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, "-o", out, "./cmd/gpu-orphan-remediator")...)
	cmd.Dir = root
	cmd.Env = os.Environ()
	if os.Getenv("CGO_CFLAGS") == "" {
		cmd.Env = append(cmd.Env, "CGO_CFLAGS=-O2 -g -Wno-deprecated-declarations") // as the Makefile
	}
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -tags gpuorphan_pausepoints: %v\n%s", err, b)
	}
	return out
}

// agent is a running remediator that a test may kill.
type agent struct {
	url string
	cmd *exec.Cmd
}

// startAgentBin starts bin as a node agent, as startAgent does, with env
// added to its environment.
func startAgentBin(t *testing.T, bin string, env []string, root, storePath string, extra ...string) agent {
	t.Helper()
	addr := testenv.FreeAddr(t)
	args := withDefaults(extra, "--backend=sim", "--sim.root="+root, "--store.path="+storePath,
		"--auth.token-file="+tokenFile(t), "--node.name=node-a", "--web.listen-address="+addr,
		"--collector.interval=200ms", "--remediate.min-age=500ms", "--remediate.grace=1s",
		"--remediate.verify-timeout=10s", "--log.level=debug")
	// The daemon's own environment, not the test process's: the steps run
	// in parallel, each with its pause point.
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	testenv.DaemonCmd(t, cmd)
	url := "http://" + addr
	waitReady(t, http.DefaultClient, url)
	return agent{url: url, cmd: cmd}
}

// kill9 kills the agent with SIGKILL, as `kill -9` did on the H200.
func (a agent) kill9(t *testing.T) {
	t.Helper()
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	a.cmd.Wait()
}

// actionEvents is GET /api/v1/actions/{id}: the action and its timeline.
type actionEvents struct {
	remediate.Action
	Events []store.Event `json:"events"`
}

func getAction(t *testing.T, url, id string) actionEvents {
	t.Helper()
	var a actionEvents
	if code := getJSON(t, http.DefaultClient, url+"/api/v1/actions/"+id, token, &a); code != http.StatusOK {
		t.Fatalf("GET action %s: %d", id, code)
	}
	return a
}

// signalled lists the (pid, signal) pairs that an action's record says it
// sent.
func signalled(t *testing.T, a actionEvents) map[int][]string {
	t.Helper()
	out := map[int][]string{}
	for _, e := range a.Events {
		if e.Kind != "signal" {
			continue
		}
		var d struct {
			PID    int    `json:"pid"`
			Signal string `json:"signal"`
		}
		if err := json.Unmarshal(e.Detail, &d); err != nil {
			t.Fatalf("signal event %s: %v", e.Detail, err)
		}
		out[d.PID] = append(out[d.PID], d.Signal)
	}
	return out
}

// detail decodes an event's detail.
func detail(t *testing.T, e store.Event) map[string]any {
	t.Helper()
	var d map[string]any
	if err := json.Unmarshal(e.Detail, &d); err != nil {
		t.Fatalf("event %s detail %s: %v", e.Kind, e.Detail, err)
	}
	return d
}

func eventKinds(a actionEvents) []string {
	var kinds []string
	for _, e := range a.Events {
		kinds = append(kinds, e.Kind)
	}
	return kinds
}

// attempts are the actions of one alert, first attempt first.
func attempts(t *testing.T, url, fingerprint string) []remediate.Action {
	t.Helper()
	var out []remediate.Action
	for _, a := range actions(t, url) {
		if a.AlertFingerprint == fingerprint {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(x, y remediate.Action) int { return x.Attempt - y.Attempt })
	return out
}

// TestCrashAtEveryStep: workers that ignore SIGTERM hold a dead trainer's
// memory (the H200's case); the remediator is killed with SIGKILL at each
// step of its cleanup and restarted on the same store. The interrupted
// action is taken up again at start-up as attempt 2, from a fresh
// snapshot; Alertmanager's re-sent notification is then a duplicate. In
// every case the memory comes back, nothing but the workers is signalled,
// and the record links the attempts and shows every signal. (The old code
// marked the action interrupted, "it will not be repeated", answered the
// re-sent notification duplicate, and the memory stayed held.)
func TestCrashAtEveryStep(t *testing.T) {
	skipShort(t)
	pausable := pausableRemediator(t)
	plain := testenv.Bin(t, "gpu-orphan-remediator")
	for i, step := range []string{cleanup.PausePlanRecorded, cleanup.PauseSIGTERMSent, "grace", cleanup.PauseSIGKILLSent, cleanup.PauseVerifying} {
		t.Run(step, func(t *testing.T) {
			t.Parallel()
			root := testenv.SimNode(t, 2)
			uuid := gpuUUID(t, root, 1)
			orphan := testenv.StartWorkload(t, root, 1, 2662, 2, "--ignore-sigterm")
			bystander := testenv.StartWorkload(t, root, 1, 1024, 1) // a healthy job on the same GPU
			storePath := filepath.Join(t.TempDir(), "r.db")
			pauseFile := filepath.Join(t.TempDir(), "paused")
			env := []string{"GPU_ORPHAN_PAUSE_AT=" + step, "GPU_ORPHAN_PAUSE_FILE=" + pauseFile}
			if step == "grace" {
				env = []string{"GPU_ORPHAN_PAUSE_AT="} // no pause point: the long grace is the step
			}
			// Up to SIGTERM's steps, a grace of 30 s holds the first run
			// between SIGTERM and SIGKILL.
			grace := "--remediate.grace=30s"
			if step == cleanup.PauseSIGKILLSent || step == cleanup.PauseVerifying {
				grace = "--remediate.grace=1s"
			}
			first := startAgentBin(t, pausable, env, root, storePath, "--act", grace)
			orphan.KillParent(t)
			fingerprint := fp(300 + i)
			startsAt := time.Now().Add(-time.Minute)
			body := payload(alert("firing", "node-a", uuid, fingerprint, startsAt))
			if code, resp := post(t, first.url, token, body); code != http.StatusOK || results(t, resp)["accepted"] != 1 {
				t.Fatalf("post: %d %s", code, resp)
			}
			var id string
			testenv.Eventually(t, 20*time.Second, "the cleanup to reach "+step, func() bool {
				as := attempts(t, first.url, fingerprint)
				if len(as) != 1 || as[0].State != remediate.StateRunning {
					return false
				}
				id = as[0].ID
				if step == "grace" {
					// SIGCONT follows SIGTERM, and each is recorded before it is
					// sent: with both SIGCONTs recorded, both SIGTERMs went out.
					sigs := signalled(t, getAction(t, first.url, id))
					return slices.Contains(sigs[orphan.Children[0]], "SIGCONT") && slices.Contains(sigs[orphan.Children[1]], "SIGCONT")
				}
				_, err := os.Stat(pauseFile)
				return err == nil
			})
			before := getAction(t, first.url, id)
			sent := signalled(t, before)
			t.Logf("killed at %s; the record then: events %v, signals %v", step, eventKinds(before), sent)
			first.kill9(t)

			switch step {
			case cleanup.PausePlanRecorded:
				if len(sent) != 0 {
					t.Errorf("signals recorded before the first was due: %v", sent)
				}
				wantAlive(t, "a worker (nothing sent yet)", orphan.Children...)
			case cleanup.PauseSIGTERMSent, "grace":
				wantAlive(t, "a worker that ignores SIGTERM", orphan.Children...)
			case cleanup.PauseVerifying:
				wantDead(t, "a worker killed before verification", orphan.Children...)
			}

			// The restart, with the release build.
			second := startAgentBin(t, plain, []string{"GPU_ORPHAN_PAUSE_AT="}, root, storePath, "--act")
			var as []remediate.Action
			testenv.Eventually(t, 30*time.Second, "attempt 2 to finish", func() bool {
				as = attempts(t, second.url, fingerprint)
				return len(as) == 2 && as[1].State.Final()
			})
			one, two := as[0], as[1]
			t.Logf("attempt 1: %s %q; attempt 2: %s %q, targets %v", one.State, one.Reason, two.State, two.Reason, targetPIDs(two))
			if one.State != remediate.StateInterrupted || one.Attempt != 1 || one.RetryOf != "" {
				t.Errorf("attempt 1: %s attempt %d retry_of %q, want interrupted, 1, none", one.State, one.Attempt, one.RetryOf)
			}
			if two.Attempt != 2 || two.RetryOf != one.ID || two.FirstActionID != one.ID {
				t.Errorf("attempt 2: attempt %d retry_of %q first_action_id %q, want 2 and %s", two.Attempt, two.RetryOf, two.FirstActionID, one.ID)
			}
			switch two.State {
			case remediate.StateSucceeded:
				if len(two.Leftover) > 0 {
					t.Errorf("attempt 2 left %+v", two.Leftover)
				}
			case remediate.StateSkipped:
				// The first run's SIGKILL had done it: the fresh snapshot finds
				// nothing to clean.
				if step != cleanup.PauseSIGKILLSent && step != cleanup.PauseVerifying {
					t.Errorf("attempt 2 skipped (%s) after a crash at %s", two.Reason, step)
				}
			default:
				t.Errorf("attempt 2: %s %s", two.State, two.Reason)
			}

			// Alertmanager re-sends the alert: the memory is back, so a
			// duplicate.
			code, resp := post(t, second.url, token, body)
			if code != http.StatusOK || results(t, resp)["duplicate"] != 1 {
				t.Errorf("re-sent notification: %d %s, want a duplicate", code, resp)
			}
			if n := len(attempts(t, second.url, fingerprint)); n != 2 {
				t.Errorf("%d actions after the re-sent notification, want 2", n)
			}
			wantUsedMiB(t, root, 1, 1024+8)
			wantDead(t, "a worker", orphan.Children...)
			wantAlive(t, "the healthy job on the same GPU", bystander.PID, bystander.Children[0])

			// The whole story, and nobody signalled but the workers.
			r1, r2 := getAction(t, second.url, one.ID), getAction(t, second.url, two.ID)
			k1, k2 := eventKinds(r1), eventKinds(r2)
			t.Logf("attempt 1 events %v; attempt 2 events %v", k1, k2)
			if i := slices.Index(k1, "interrupted"); i < 0 || detail(t, r1.Events[i])["resumed_by"] != two.ID {
				t.Errorf("attempt 1's events %v do not say it was interrupted and taken up by %s", k1, two.ID)
			}
			if len(k2) == 0 || k2[0] != "retry" || detail(t, r2.Events[0])["cause"] != store.RetryRestart {
				t.Errorf("attempt 2's events %v do not begin with its cause", k2)
			}
			if !slices.Contains(k1, "plan") || (two.State == remediate.StateSucceeded && !slices.Contains(k2, "verify")) {
				t.Errorf("missing plan or verification: %v, %v", k1, k2)
			}
			for _, rec := range []actionEvents{r1, r2} {
				for pid := range signalled(t, rec) {
					if !slices.Contains(orphan.Children, pid) {
						t.Errorf("action %s (attempt %d) signalled %d, not a worker %v", rec.ID, rec.Attempt, pid, orphan.Children)
					}
				}
				for _, tg := range rec.Targets {
					if !slices.Contains(orphan.Children, tg.PID) {
						t.Errorf("action %s targeted %d, not a worker", rec.ID, tg.PID)
					}
				}
			}
			// Every SIGKILL a worker got is on the record: the first run's
			// before it was sent (the crash after sending it cannot lose
			// it), or the second run's.
			if step == cleanup.PauseSIGKILLSent || step == cleanup.PauseVerifying {
				all := signalled(t, r1)
				for pid, s := range signalled(t, r2) {
					all[pid] = append(all[pid], s...)
				}
				for _, c := range orphan.Children {
					if !slices.Contains(all[c], "SIGKILL") {
						t.Errorf("worker %d died of SIGKILL that no record shows: %v", c, all[c])
					}
				}
			}
		})
	}
}

// TestRetryAfterOthersRemain: an action that killed its targets while a
// younger orphan's workers, excluded as dead_owner_too_young, kept memory
// on the GPU ends "succeeded: other holders remain". Alertmanager's next
// notification of the same alert (same fingerprint and startsAt), once
// the cooldown has passed, is attempt 2, which cleans the rest; a copy
// before the cooldown, and one after the memory came back, are
// duplicates. (The old code answered every copy duplicate, and the young
// orphan's memory stayed held for as long as the alert fired.)
func TestRetryAfterOthersRemain(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	const minAge, cooldown = 4 * time.Second, 3 * time.Second
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act",
		"--remediate.min-age="+minAge.String(), "--limit.cooldown="+cooldown.String())
	old := testenv.StartWorkload(t, root, 1, 1024, 1)
	young := testenv.StartWorkload(t, root, 1, 2048, 1)
	old.KillParent(t)
	// What is awaited here is time itself: the old orphan older than
	// min-age, then the cooldown (Alertmanager's repeat_interval is longer).
	time.Sleep(minAge + 200*time.Millisecond)
	young.KillParent(t)
	youngDied := time.Now()

	fingerprint := fp(320)
	body := payload(alert("firing", "node-a", uuid, fingerprint, time.Now().Add(-time.Minute)))
	if code, resp := post(t, url, token, body); code != http.StatusOK || results(t, resp)["accepted"] != 1 {
		t.Fatalf("post: %d %s", code, resp)
	}
	var one remediate.Action
	testenv.Eventually(t, 30*time.Second, "attempt 1 to finish", func() bool {
		as := attempts(t, url, fingerprint)
		one = as[0]
		return one.State.Final()
	})
	if time.Since(youngDied) >= minAge {
		t.Skipf("attempt 1 came %s after the young orphan's death, beyond min-age: the machine is too slow for this test", time.Since(youngDied))
	}
	if one.State != remediate.StateSucceeded || !strings.HasPrefix(one.Reason, cleanup.OthersRemain) {
		t.Fatalf("attempt 1: %s %q, want succeeded with other holders remaining", one.State, one.Reason)
	}
	wantTargets(t, one, old.Children...)
	if excludedAs(one, young.Children[0]) != "dead_owner_too_young" {
		t.Errorf("attempt 1 did not exclude the young orphan's worker as dead_owner_too_young: %+v", one.Excluded)
	}
	if !one.MemoryHeld() {
		t.Errorf("attempt 1 %+v does not count as leaving memory held", one)
	}
	// At once: inside the cooldown, a duplicate.
	if code, resp := post(t, url, token, body); code != http.StatusOK || results(t, resp)["duplicate"] != 1 {
		t.Fatalf("copy inside the cooldown: %d %s, want a duplicate", code, resp)
	}
	wantAlive(t, "the young orphan's worker", young.Children...)

	time.Sleep(time.Until(one.FinishedAt.Add(cooldown + 100*time.Millisecond)))
	code, resp := post(t, url, token, body)
	if code != http.StatusOK || results(t, resp)["accepted"] != 1 {
		t.Fatalf("copy after the cooldown: %d %s, want accepted (attempt 2)", code, resp)
	}
	var two remediate.Action
	testenv.Eventually(t, 30*time.Second, "attempt 2 to finish", func() bool {
		as := attempts(t, url, fingerprint)
		if len(as) != 2 {
			return false
		}
		two = as[1]
		return two.State.Final()
	})
	if two.State != remediate.StateSucceeded || len(two.Leftover) != 0 || two.Attempt != 2 || two.RetryOf != one.ID || two.FirstActionID != one.ID {
		t.Fatalf("attempt 2: %s %q attempt %d retry_of %q first %q leftovers %+v", two.State, two.Reason, two.Attempt, two.RetryOf, two.FirstActionID, two.Leftover)
	}
	wantTargets(t, two, young.Children...)
	wantDead(t, "the young orphan's worker", young.Children...)
	wantUsedMiB(t, root, 1, 0)
	ev := getAction(t, url, two.ID)
	if k := eventKinds(ev); len(k) == 0 || k[0] != "retry" || detail(t, ev.Events[0])["cause"] != store.RetryNotification {
		t.Errorf("attempt 2's events %v do not begin with its cause", k)
	}
	// The memory is back: later copies are duplicates.
	time.Sleep(time.Until(two.FinishedAt.Add(cooldown + 100*time.Millisecond)))
	if code, resp := post(t, url, token, body); code != http.StatusOK || results(t, resp)["duplicate"] != 1 {
		t.Fatalf("copy after the memory came back: %d %s, want a duplicate", code, resp)
	}
	if n := len(attempts(t, url, fingerprint)); n != 2 {
		t.Fatalf("%d actions, want 2", n)
	}
}
