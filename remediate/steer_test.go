package remediate_test

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// listenerOn is an HTTP server on ip that records every request it gets
// and answers code.
func listenerOn(t *testing.T, ip string, code int) (*httptest.Server, *recorder) {
	t.Helper()
	l, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Skipf("cannot listen on %s: %v", ip, err)
	}
	var rec recorder
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rec.add(recorded{at: time.Now(), body: body, authz: r.Method + " " + r.URL.Path + " Authorization=" + r.Header.Get("Authorization")})
		w.WriteHeader(code)
	}))
	srv.Listener.Close()
	srv.Listener = l
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &rec
}

func writeTargets(t *testing.T, path string, targets map[string]string) {
	t.Helper()
	b, _ := json.Marshal(targets)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func startDispatcher(t *testing.T, targets string, extra ...string) string {
	t.Helper()
	addr := testenv.FreeAddr(t)
	args := withDefaults(extra, "--web.listen-address="+addr,
		"--auth.token-file="+tokenFile(t), "--dispatch.token-file="+tokenFile(t), "--dispatch.targets-file="+targets,
		"--dispatch.max-nodes=10", "--dispatch.max-fraction=1", "--dispatch.window=1h",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"), "--log.level=debug")
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-dispatcher"), args...)
	u := "http://" + addr
	waitReady(t, http.DefaultClient, u)
	return u
}

// TestDispatcherNotSteerable: a real dispatcher, with the shipped kind of
// URL template, in front of one real agent. Alerts that name hosts instead
// of nodes on its allow-list (an attacker's listener on 127.0.0.3, two
// addresses where nothing listens) are recorded as rejected: the attacker
// receives no request and no token, and these failures cannot open the
// fleet breaker, so the real node's alert that follows is served. An
// agent on the list that answers 307 is a failure; the redirect's target
// receives nothing. A node added to the targets file is served without a
// restart.
func TestDispatcherNotSteerable(t *testing.T) {
	skipShort(t)
	t.Parallel()
	attacker, stolen := listenerOn(t, "127.0.0.3", http.StatusServiceUnavailable)
	_, attackerPort, _ := net.SplitHostPort(attacker.Listener.Addr().String())
	elsewhere, redirected := listenerOn(t, "127.0.0.1", http.StatusOK)
	redirector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+"/steal", http.StatusTemporaryRedirect)
	}))
	t.Cleanup(redirector.Close)

	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	agent, _ := startAgent(t, root, filepath.Join(t.TempDir(), "a.db"), "--node.name=node-h")
	w.KillParent(t)

	targets := filepath.Join(t.TempDir(), "targets.json")
	writeTargets(t, targets, map[string]string{"node-r": redirector.URL})
	dispatcher := startDispatcher(t, targets,
		"--dispatch.url-template=http://{{.Node}}:"+attackerPort, "--dispatch.max-attempts=1",
		"--limit.breaker-failures=3", "--limit.breaker-window=1h")

	startsAt := time.Now().Add(-time.Minute)
	uuid := gpuUUID(t, root, 1)
	code, body := post(t, dispatcher, token, payload(
		alert("firing", "127.0.0.3", uuid, fp(40), startsAt),
		alert("firing", "127.0.0.4", uuid, fp(41), startsAt),
		alert("firing", "127.0.0.5", uuid, fp(42), startsAt),
		alert("firing", "node-h", uuid, fp(43), startsAt), // not on the list yet
	))
	if code != http.StatusOK {
		t.Fatalf("dispatcher: %d %s", code, body)
	}
	if r := results(t, body); r["rejected"] != 4 || r["accepted"] != 0 {
		t.Errorf("dispatcher results %v, want 4 rejected", r)
	}
	time.Sleep(3 * time.Second) // long enough for a forward, retries and the breaker
	if got := stolen.get(); len(got) != 0 {
		t.Errorf("the attacker's listener on 127.0.0.3 got %d requests, first: %s", len(got), got[0].authz)
	}
	if as := actions(t, dispatcher); len(as) != 0 {
		t.Errorf("the dispatcher made %d actions of rejected alerts: %+v", len(as), as)
	}

	// An agent on the list that redirects: failed, and nothing followed.
	code, body = post(t, dispatcher, token, payload(alert("firing", "node-r", uuid, fp(44), startsAt)))
	if code != http.StatusOK || results(t, body)["accepted"] != 1 {
		t.Fatalf("node-r: %d %s", code, body)
	}
	testenv.Eventually(t, 20*time.Second, "the redirecting agent's alert to fail", func() bool {
		for _, a := range actions(t, dispatcher) {
			if a.Node == "node-r" && a.State == remediate.StateFailed {
				return true
			}
		}
		return false
	})
	if got := redirected.get(); len(got) != 0 {
		t.Errorf("the 307's target got %d requests, first: %s", len(got), got[0].authz)
	}

	// The real node, once the file names it: served, no restart, and the
	// breaker is closed.
	writeTargets(t, targets, map[string]string{"node-r": redirector.URL, "node-h": agent})
	code, body = post(t, dispatcher, token, payload(alert("firing", "node-h", uuid, fp(45), startsAt)))
	if code != http.StatusOK || results(t, body)["accepted"] != 1 {
		t.Fatalf("node-h after the reload: %d %s", code, body)
	}
	testenv.Eventually(t, 20*time.Second, "node-h's agent to plan", func() bool {
		as := actions(t, agent)
		return len(as) == 1 && as[0].State == remediate.StateDryRun && as[0].AlertFingerprint == fp(45)
	})
	_, mfs := testenv.Scrape(t, dispatcher+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); v != 0 {
		t.Error("the fleet breaker opened")
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_notifications_total", map[string]string{"result": "rejected"}); v != 4 {
		t.Errorf("notifications_total{result=rejected} = %v, want 4", v)
	}
}

// TestDispatcherForwardsLabels: agent and dispatcher both read the GPU from
// --alert.uuid-label=gpu_uuid. The alert reaches the agent with its labels
// as received, and the agent acts. An alert the agent ignores (a GPU it
// does not have) is recorded by the dispatcher as skipped with the agent's
// reason, not as succeeded.
func TestDispatcherForwardsLabels(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	agent, _ := startAgent(t, root, filepath.Join(t.TempDir(), "a.db"), "--node.name=node-a", "--alert.uuid-label=gpu_uuid")
	w.KillParent(t)
	targets := filepath.Join(t.TempDir(), "targets.json")
	writeTargets(t, targets, map[string]string{"node-a": agent})
	dispatcher := startDispatcher(t, targets, "--alert.uuid-label=gpu_uuid")

	custom := func(uuid, fingerprint string) map[string]any {
		a := alert("firing", "node-a", "", fingerprint, time.Now().Add(-time.Minute))
		a["labels"] = map[string]string{"alertname": "GPUOrphanMemory", "node": "node-a", "gpu_uuid": uuid, "gpu": "1", "team": "ml"}
		return a
	}
	code, body := post(t, dispatcher, token, payload(
		custom(gpuUUID(t, root, 1), fp(50)),
		custom("GPU-00000000-0000-0000-0000-000000000000", fp(51)),
	))
	if code != http.StatusOK || results(t, body)["accepted"] != 2 {
		t.Fatalf("dispatcher: %d %s", code, body)
	}
	testenv.Eventually(t, 20*time.Second, "the agent to plan the alert with the custom label", func() bool {
		as := actions(t, agent)
		return len(as) == 1 && as[0].State == remediate.StateDryRun && as[0].AlertFingerprint == fp(50) && as[0].GPUUUID == gpuUUID(t, root, 1)
	})
	testenv.Eventually(t, 20*time.Second, "the dispatcher to record both answers", func() bool {
		byFP := map[string]remediate.Action{}
		for _, a := range actions(t, dispatcher) {
			byFP[a.AlertFingerprint] = a
		}
		ok, ignored := byFP[fp(50)], byFP[fp(51)]
		if ignored.State == remediate.StateSucceeded {
			t.Fatalf("the agent ignored the alert and the dispatcher recorded succeeded: %+v", ignored)
		}
		return ok.Agent != nil && ok.Agent.State == remediate.StateDryRun &&
			ignored.State == remediate.StateSkipped && ignored.Agent != nil && ignored.Agent.ActionID == ""
	})
}

// TestDispatcherReplicas: two dispatcher replicas behind one address, each
// with its own store, in front of one agent that acts. Alertmanager's
// copies of one notification land on both at once: the agent makes exactly
// one action, under the alert's own fingerprint and startsAt, and frees
// the memory once; both replicas follow that one action.
func TestDispatcherReplicas(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	agent, _ := startAgent(t, root, filepath.Join(t.TempDir(), "a.db"), "--node.name=node-a", "--act")
	w.KillParent(t)
	targets := filepath.Join(t.TempDir(), "targets.json")
	writeTargets(t, targets, map[string]string{"node-a": agent})
	replicas := []string{startDispatcher(t, targets), startDispatcher(t, targets)}

	startsAt := time.Now().Add(-time.Minute).UTC().Truncate(time.Millisecond)
	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(60), startsAt))
	var wg sync.WaitGroup
	for i, r := range replicas {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := deliver(http.DefaultClient, r, token, body)
			if r.err != nil || r.code != http.StatusOK {
				t.Errorf("replica %d: %d %v", i, r.code, r.err)
			}
		}()
	}
	wg.Wait()

	var agentAction remediate.Action
	testenv.Eventually(t, 30*time.Second, "the agent's action to finish", func() bool {
		as := actions(t, agent)
		if len(as) > 1 {
			t.Fatalf("the agent made %d actions of one alert: %+v", len(as), as)
		}
		if len(as) == 1 && as[0].State.Final() {
			agentAction = as[0]
			return true
		}
		return false
	})
	if agentAction.AlertFingerprint != fp(60) || !agentAction.AlertStartsAt.Equal(startsAt) || agentAction.State != remediate.StateSucceeded {
		t.Errorf("agent action %s: fingerprint %s startsAt %s state %s; want %s, %s, succeeded", agentAction.ID,
			agentAction.AlertFingerprint, agentAction.AlertStartsAt, agentAction.State, fp(60), startsAt)
	}
	for i, r := range replicas {
		testenv.Eventually(t, 20*time.Second, "replica "+strconv.Itoa(i)+" to follow the agent's action", func() bool {
			as := actions(t, r)
			return len(as) == 1 && as[0].Agent != nil && as[0].Agent.ActionID == agentAction.ID && as[0].Agent.State == remediate.StateSucceeded
		})
	}
	time.Sleep(time.Second)
	if as := actions(t, agent); len(as) != 1 {
		t.Errorf("the agent has %d actions, want 1", len(as))
	}
}
