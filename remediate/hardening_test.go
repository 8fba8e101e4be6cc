package remediate_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// This file holds the remediator's hardening tests: a burst of duplicate
// and unrelated notifications, unreachable and slow node agents behind the
// dispatcher, token guessing, a full audit store, and a broken driver. Each
// runs the real binary over loopback HTTP.

// sendResult is what one delivered notification got back.
type sendResult struct {
	code     int
	body     []byte
	attempts int
	shed     int           // attempts answered 503
	lost     int           // attempts that ended in a transport error: the agent may have applied them
	latency  time.Duration // from the first attempt to the final answer
	err      error
}

// deliver posts body as Alertmanager does: a 5xx or a transport error is
// retried with exponential backoff, any other answer is final.
func deliver(c *http.Client, baseURL, tok string, body []byte) sendResult {
	start := time.Now()
	backoff := 10 * time.Millisecond
	var r sendResult
	for r.attempts = 1; ; r.attempts++ {
		r.code, r.body, r.err = postOnce(c, baseURL, tok, body)
		if r.err == nil && r.code == http.StatusServiceUnavailable {
			r.shed++
		}
		if r.err != nil {
			r.lost++
		}
		retryable := r.err != nil || r.code/100 == 5
		if !retryable || r.attempts == 12 {
			r.latency = time.Since(start)
			return r
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, time.Second)
	}
}

// postOnce posts a webhook body once.
func postOnce(c *http.Client, baseURL, tok string, body []byte) (int, []byte, error) {
	req, _ := http.NewRequest(http.MethodPost, baseURL+"/api/v1/alerts", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// actionDetail is GET /api/v1/actions/{id}: an action and its events.
type actionDetail struct {
	remediate.Action
	Events []store.Event `json:"events"`
}

func getJSON(t *testing.T, c *http.Client, rawURL, tok string, v any) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, rawURL, nil)
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", rawURL, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK && v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("GET %s: %v\n%s", rawURL, err, b)
		}
	}
	return resp.StatusCode
}

func metricValue(t *testing.T, baseURL, name string, labels map[string]string) float64 {
	t.Helper()
	_, mfs := testenv.Scrape(t, baseURL+"/metrics")
	v, ok := testenv.Value(mfs, name, labels)
	if !ok {
		t.Fatalf("no series %s%v: %s", name, labels, testenv.Describe(mfs, name))
	}
	return v
}

// alertKey is Alertmanager's idempotency key.
type alertKey struct {
	fp       string
	startsAt time.Time
}

func (k alertKey) String() string { return k.fp }

// TestLoadIntakeBurst: 2,500 notifications (10,000 under `make soak`:
// GPU_ORPHAN_BURST_NOTIFICATIONS) from 32 concurrent clients to one node
// agent (dry run), mixing HA copies of the same alerts, resolved alerts for
// keys that fired and for keys never seen, and alerts that are not this
// agent's work. Nothing is lost, every firing key makes exactly one action,
// and the counters add up. Each notification is a synchronous SQLite
// transaction: 10,000 took 80 s of `make test` on 2 cores, and 2,500 keep
// 32 clients contending all along.
func TestLoadIntakeBurst(t *testing.T) {
	skipShort(t)
	t.Parallel()
	notifications := 2500
	if v := os.Getenv("GPU_ORPHAN_BURST_NOTIFICATIONS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1000 {
			t.Fatalf("GPU_ORPHAN_BURST_NOTIFICATIONS=%q: want a number of at least 1000", v)
		}
		notifications = n
	}
	const (
		clients       = 32
		replicas      = 3 // an HA Alertmanager cluster: every replica sends every notification
		firingKeys    = 50
		resolvedLater = 10 // of the firing keys, the last ones resolve during the burst
		sameBatch     = 5  // keys that fire and resolve in one notification
		neverSeen     = 20 // resolved keys that never fired here
		ignoredGroups = 10 // notifications of three alerts that are not this node's work
	)
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	w := testenv.StartWorkload(t, root, 1, 2048, 1)
	storePath := filepath.Join(t.TempDir(), "r.db")
	// Info level: the debug log of 10,000 requests would only cost time.
	agentURL, _ := startAgent(t, root, storePath, "--collector.interval=1s", "--log.level=info")
	w.KillParent(t)

	startsAt := time.Now().Add(-time.Minute).UTC()
	key := func(base, i int) alertKey { return alertKey{fp(base + i), startsAt} }
	type base struct {
		phase int // 1: sent before the barrier, 2: after it
		body  []byte
	}
	var (
		bases []base
		want  = map[alertKey]string{} // the key's first result
		kind  = map[alertKey]string{}
	)
	for i := range firingKeys {
		k := key(1000, i)
		bases = append(bases, base{1, payload(alert("firing", "node-a", uuid, k.fp, startsAt))})
		want[k], kind[k] = store.ResultAccepted, "firing"
		if i >= firingKeys-resolvedLater {
			bases = append(bases, base{2, payload(alert("resolved", "node-a", uuid, k.fp, startsAt))})
			kind[k] = "resolved_later"
		}
	}
	for i := range sameBatch {
		k := key(2000, i)
		// Firing and resolved in one notification: the action is queued and
		// cancelled in the same transaction, so it can never have started.
		bases = append(bases, base{1, payload(alert("firing", "node-a", uuid, k.fp, startsAt), alert("resolved", "node-a", uuid, k.fp, startsAt))})
		want[k], kind[k] = store.ResultAccepted, "same_batch"
	}
	for i := range neverSeen {
		k := key(3000, i)
		bases = append(bases, base{1 + i%2, payload(alert("resolved", "node-a", uuid, k.fp, startsAt))})
		want[k], kind[k] = store.ResultResolved, "never_seen"
	}
	for i := range ignoredGroups {
		other, unknown, noUUID := key(4000, i), key(5000, i), key(6000, i)
		nu := alert("firing", "node-a", "", noUUID.fp, startsAt)
		delete(nu["labels"].(map[string]string), "uuid")
		bases = append(bases, base{1 + i%2, payload(
			alert("firing", "node-b", uuid, other.fp, startsAt),
			alert("firing", "node-a", "GPU-00000000-0000-0000-0000-00000000dead", unknown.fp, startsAt),
			nu)})
		want[other], want[unknown], want[noUUID] = store.ResultIgnored, store.ResultIgnored, store.ResultIgnored
		kind[other], kind[unknown], kind[noUUID] = "other_node", "unknown_uuid", "no_uuid"
	}

	// Every notification goes out once per replica; the rest of the 10,000
	// are further copies (retries, repeats), spread evenly. Phase 2 starts
	// when phase 1 is done, so that a key's resolution never overtakes its
	// first firing delivery.
	var phase [3][][]byte
	for _, b := range bases {
		for range replicas {
			phase[b.phase] = append(phase[b.phase], b.body)
		}
	}
	for i := 0; len(phase[1])+len(phase[2]) < notifications; i++ {
		b := bases[i%len(bases)]
		phase[b.phase] = append(phase[b.phase], b.body)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, p := range phase[1:] {
		rng.Shuffle(len(p), func(i, j int) { p[i], p[j] = p[j], p[i] })
	}
	alertsSent := 0
	for _, p := range phase[1:] {
		for _, body := range p {
			var m struct{ Alerts []json.RawMessage }
			if err := json.Unmarshal(body, &m); err != nil {
				t.Fatal(err)
			}
			alertsSent += len(m.Alerts)
		}
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	var results []sendResult
	var alertsIn []int // of each result's notification
	burstStart := time.Now()
	for _, p := range phase[1:] {
		out := make([]sendResult, len(p))
		var next atomic.Int64
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				for {
					i := int(next.Add(1)) - 1
					if i >= len(p) {
						return
					}
					out[i] = deliver(client, agentURL, token, p[i])
				}
			})
		}
		wg.Wait()
		results = append(results, out...)
		for _, body := range p {
			var m struct{ Alerts []json.RawMessage }
			if err := json.Unmarshal(body, &m); err != nil {
				t.Fatal(err)
			}
			alertsIn = append(alertsIn, len(m.Alerts))
		}
	}
	burst := time.Since(burstStart)

	// Every notification was answered 200, at once or after retries (of a
	// 503 or a transport error, as Alertmanager retries). A notification's
	// latency runs from its first attempt to its 200.
	latencies := make([]time.Duration, 0, len(results))
	retried, shed, failed, lost := 0, 0, 0, 0
	outcomes := map[alertKey][]store.AlertOutcome{}
	tally := map[string]int{}
	for i, r := range results {
		if r.err != nil || r.code != http.StatusOK {
			if failed++; failed <= 3 {
				t.Errorf("notification %d: final answer %d %v after %d attempts: %s", i, r.code, r.err, r.attempts, r.body)
			}
			continue
		}
		if r.attempts > 1 {
			retried++
		}
		shed += r.shed
		lost += r.lost
		latencies = append(latencies, r.latency)
		var reply intake.Reply
		if err := json.Unmarshal(r.body, &reply); err != nil {
			t.Fatalf("reply %q: %v", r.body, err)
		}
		for _, o := range reply.Alerts {
			k := alertKey{o.Fingerprint, o.StartsAt.UTC()}
			outcomes[k] = append(outcomes[k], o)
			tally[o.Result]++
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d notifications never got a 200", failed, len(results))
	}
	slices.Sort(latencies)
	pct := func(p float64) time.Duration { return latencies[int(p*float64(len(latencies)-1))] }
	line := fmt.Sprintf("LOAD intake p50=%s p99=%s throughput=%.0f/s", pct(0.50).Round(10*time.Microsecond),
		pct(0.99).Round(10*time.Microsecond), float64(len(results))/burst.Seconds())
	t.Log(line)
	t.Logf("%d notifications (%d alerts, %d distinct keys) from %d clients in %s; %d needed retries (%d answers were 503); results %v",
		len(results), alertsSent, len(want), clients, burst.Round(time.Millisecond), retried, shed, tally)
	if p := os.Getenv("GPU_ORPHAN_REPORT"); p != "" {
		if err := os.WriteFile(p, []byte(line+"\n"), 0o644); err != nil {
			t.Errorf("writing GPU_ORPHAN_REPORT: %v", err)
		}
	}

	// No key is lost, and each key's first delivery decided its fate
	// exactly once: every later copy is a duplicate of it.
	if len(outcomes) != len(want) {
		t.Errorf("replies name %d distinct keys, want %d", len(outcomes), len(want))
	}
	actionOf := map[alertKey]string{}
	for k, first := range want {
		got := outcomes[k]
		count := map[string]int{}
		for _, o := range got {
			count[o.Result]++
		}
		wantCount := map[string]int{first: 1}
		switch kind[k] {
		case "resolved_later", "same_batch":
			wantCount[store.ResultResolved] = 1
		}
		for r, n := range wantCount {
			if count[r] != n {
				t.Errorf("key %s (%s): %d %s results, want %d (%v)", k, kind[k], count[r], r, n, count)
			}
		}
		if count[store.ResultDuplicate]+len(wantCount) != len(got) || len(got) < replicas {
			t.Errorf("key %s (%s): %d deliveries, results %v", k, kind[k], len(got), count)
		}
		for _, o := range got {
			switch {
			case first == store.ResultAccepted && o.ActionID == "":
				t.Errorf("key %s: a %s result without the key's action", k, o.Result)
			case first == store.ResultAccepted && actionOf[k] != "" && o.ActionID != actionOf[k]:
				t.Errorf("key %s: results name actions %s and %s", k, actionOf[k], o.ActionID)
			case first != store.ResultAccepted && o.ActionID != "":
				t.Errorf("key %s (%s): result %s names action %s", k, kind[k], o.Result, o.ActionID)
			}
			if first == store.ResultAccepted {
				actionOf[k] = o.ActionID
			}
			if o.Result == store.ResultIgnored {
				wantReason := map[string]string{"other_node": "for another node", "unknown_uuid": "uuid names no GPU of this node", "no_uuid": "no uuid label"}[kind[k]]
				if o.Reason != wantReason {
					t.Errorf("key %s (%s): ignored because %q, want %q", k, kind[k], o.Reason, wantReason)
				}
			}
		}
	}

	// The counters add up to what was sent, result by result. An attempt
	// that ended in a transport error (the loaded agent answered too late,
	// or the connection broke) may have been applied before the retry
	// that got the reply, and counted its own results: the counts may
	// differ from the replies' by lostAlerts at most (none when no attempt
	// was lost).
	lostAlerts := 0
	for i, r := range results {
		lostAlerts += r.lost * alertsIn[i]
	}
	_, mfs := testenv.Scrape(t, agentURL+"/metrics")
	var counted float64
	for _, r := range []string{"accepted", "duplicate", "ignored", "resolved", "rejected"} {
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_notifications_total", map[string]string{"result": r})
		counted += v
		// A lost attempt counted its own result, and the retry's reply
		// may say another (duplicate, where the lost one accepted).
		if int(v) < tally[r]-lostAlerts || int(v) > tally[r]+lostAlerts {
			t.Errorf("notifications_total{result=%q} = %v, replies say %d (give or take %d alerts of attempts lost in transport)", r, v, tally[r], lostAlerts)
		}
	}
	if int(counted) < alertsSent || int(counted) > alertsSent+lostAlerts {
		t.Errorf("notifications_total adds up to %v, %d alerts were sent (and %d of attempts lost in transport)", counted, alertsSent, lostAlerts)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_requests_total", map[string]string{"code": "200"}); int(v) < len(results) || int(v) > len(results)+lost {
		t.Errorf("requests_total{code=\"200\"} = %v, want %d (and at most %d attempts lost in transport)", v, len(results), lost)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_requests_total", map[string]string{"code": "503"}); int(v) != shed {
		t.Errorf("requests_total{code=\"503\"} = %v, clients retried %d times", v, shed)
	}
	// The store counted every duplicate delivery too.
	st, err := store.Open(t.Context(), storePath)
	if err != nil {
		t.Fatal(err)
	}
	dups, err := st.Duplicates(t.Context())
	st.Close()
	if err != nil || int(dups) < tally[store.ResultDuplicate]-lostAlerts || int(dups) > tally[store.ResultDuplicate]+lostAlerts {
		t.Errorf("store counted %d duplicates (%v), replies say %d (give or take %d alerts of attempts lost in transport)", dups, err, tally[store.ResultDuplicate], lostAlerts)
	}

	// Exactly one action per distinct firing key, each finished: a dry run
	// plan of the orphan, or cancelled because the alert resolved first.
	var as []remediate.Action
	testenv.Eventually(t, 60*time.Second, "every action to finish", func() bool {
		as = actions(t, agentURL)
		return !slices.ContainsFunc(as, func(a remediate.Action) bool {
			return a.State == remediate.StateQueued || a.State == remediate.StateRunning
		})
	})
	wantActions := firingKeys + sameBatch
	if len(as) != wantActions {
		t.Errorf("%d actions, want one per firing key: %d", len(as), wantActions)
	}
	perKey := map[alertKey]int{}
	states := map[string]int{}
	for _, a := range as {
		k := alertKey{a.AlertFingerprint, a.AlertStartsAt.UTC()}
		perKey[k]++
		states[kind[k]+"/"+string(a.State)]++
		if actionOf[k] != a.ID {
			t.Errorf("action %s for key %s (%s), the intake named %q", a.ID, k, kind[k], actionOf[k])
		}
		cancelled := a.State == remediate.StateSkipped && a.Reason == store.ReasonResolvedBeforeAction
		planned := a.State == remediate.StateDryRun && len(a.Targets) == 1 && a.Targets[0].PID == w.Children[0]
		switch kind[k] {
		case "firing":
			if !planned {
				t.Errorf("key %s: %s %q targets %+v, want a dry run of the orphan", k, a.State, a.Reason, a.Targets)
			}
		case "same_batch":
			var d actionDetail
			getJSON(t, http.DefaultClient, agentURL+"/api/v1/actions/"+a.ID, token, &d)
			if !cancelled || len(d.Events) != 1 || d.Events[0].Kind != "cancel" {
				t.Errorf("key %s resolved before any action: %s %q events %+v, want skipped %s and only a cancel event", k, a.State, a.Reason, d.Events, store.ReasonResolvedBeforeAction)
			}
		case "resolved_later":
			// Either the resolution came while the action was queued (perhaps
			// back in the queue after a plan found the problem too young), or
			// the engine had claimed it for good first; the events agree.
			var d actionDetail
			getJSON(t, http.DefaultClient, agentURL+"/api/v1/actions/"+a.ID, token, &d)
			var kinds []string
			for _, e := range d.Events {
				kinds = append(kinds, e.Kind)
			}
			cancel := slices.Contains(kinds, "cancel")
			if !(cancelled && cancel) && !(planned && slices.Contains(kinds, "claim") && !cancel) {
				t.Errorf("key %s resolved during the burst: %s %q with events %v", k, a.State, a.Reason, kinds)
			}
		default:
			t.Errorf("action %s for key %s (%s), which is not work", a.ID, k, kind[k])
		}
	}
	for k, n := range perKey {
		if n != 1 {
			t.Errorf("key %s has %d actions", k, n)
		}
	}
	t.Logf("actions by key kind and state: %v", states)
	if !testenv.Alive(w.Children[0]) {
		t.Error("a dry run killed the orphan")
	}
}

// recorder is a node agent stand-in, or a proxy in front of one, that
// remembers the webhook requests it got.
type recorder struct {
	mu   sync.Mutex
	reqs []recorded
}

type recorded struct {
	at     time.Time
	end    time.Time
	body   []byte
	authz  string
	cutOff bool // the caller gave up before the answer
}

func (r *recorder) add(x recorded) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reqs = append(r.reqs, x)
	return len(r.reqs) - 1
}

func (r *recorder) get() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.reqs)
}

func (r *recorder) set(i int, f func(*recorded)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.reqs[i])
}

// forwardedAlert decodes the one alert of a dispatcher's forward.
func forwardedAlert(t *testing.T, body []byte) alertKey {
	t.Helper()
	m, err := intake.ParseMessage(body)
	if err != nil || len(m.Alerts) != 1 {
		t.Fatalf("forwarded payload %s: %v", body, err)
	}
	return alertKey{m.Alerts[0].Fingerprint, m.Alerts[0].StartsAt.UTC()}
}

// TestDispatcherUnreachableAndSlowAgents: one node's agent is down (a
// closed port), another answers its first request only after 3 s, beyond
// --dispatch.timeout. The healthy node's alert goes through without waiting
// for either; the slow node's alert is retried and delivered; the
// unreachable node's alert is retried, then recorded as failed, never
// dropped.
func TestDispatcherUnreachableAndSlowAgents(t *testing.T) {
	skipShort(t)
	t.Parallel()
	// The healthy node: a real agent, behind a proxy that notes arrivals.
	rootH := testenv.SimNode(t, 2)
	agentH, _ := startAgent(t, rootH, filepath.Join(t.TempDir(), "h.db"), "--node.name=node-h")
	target, _ := url.Parse(agentH)
	var healthy recorder
	proxy := httputil.NewSingleHostReverseProxy(target)
	healthySrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		// Deliveries only: the dispatcher also asks for the agent's result.
		if r.Method == http.MethodPost {
			healthy.add(recorded{at: time.Now(), body: body, authz: r.Header.Get("Authorization")})
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(healthySrv.Close)

	// The slow node: its first answer comes after 3 s.
	var slow recorder
	slowSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		i := slow.add(recorded{at: time.Now(), body: body, authz: r.Header.Get("Authorization")})
		if i == 0 {
			select {
			case <-time.After(3 * time.Second):
			case <-r.Context().Done():
				slow.set(i, func(x *recorded) { x.cutOff = true })
			}
		}
		slow.set(i, func(x *recorded) { x.end = time.Now() })
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"received":1,"results":{"accepted":1}}`)
	}))
	t.Cleanup(slowSrv.Close)

	// The unreachable node: a port nobody listens on.
	unreachable := "http://" + testenv.FreeAddr(t)

	targets := filepath.Join(t.TempDir(), "targets.json")
	b, _ := json.Marshal(map[string]string{"node-h": healthySrv.URL, "node-s": slowSrv.URL, "node-u": unreachable})
	if err := os.WriteFile(targets, b, 0o600); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.listen-address="+addr,
		"--auth.token-file="+tokenFile(t), "--dispatch.token-file="+tokenFile(t), "--dispatch.targets-file="+targets,
		"--dispatch.max-nodes=10", "--dispatch.max-fraction=1", "--dispatch.window=1h",
		"--dispatch.timeout=2s", "--dispatch.max-attempts=3",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"), "--log.level=debug")
	dispatcher := "http://" + addr
	waitReady(t, http.DefaultClient, dispatcher)

	// One notification; the healthy node's alert comes last, so that a
	// dispatcher working one alert at a time would reach it last.
	startsAt := time.Now().Add(-time.Minute).UTC()
	fps := map[string]string{"node-s": fp(20), "node-u": fp(21), "node-h": fp(22)}
	code, body := post(t, dispatcher, token, payload(
		alert("firing", "node-s", gpuUUID(t, rootH, 1), fps["node-s"], startsAt),
		alert("firing", "node-u", gpuUUID(t, rootH, 1), fps["node-u"], startsAt),
		alert("firing", "node-h", gpuUUID(t, rootH, 1), fps["node-h"], startsAt),
	))
	if code != http.StatusOK || results(t, body)["accepted"] != 3 {
		t.Fatalf("dispatcher: %d %s", code, body)
	}

	// Follow the dispatcher's own records until every alert's fate is final.
	history := map[string][]seen{}
	healthyDoneFirst := false
	final := func(s remediate.State) bool { return s != remediate.StateQueued && s != remediate.StateRunning }
	testenv.Eventually(t, 60*time.Second, "every forward to finish", func() bool {
		as := actions(t, dispatcher)
		byNode := map[string]remediate.Action{}
		for _, a := range as {
			byNode[a.Node] = a
		}
		for node := range fps {
			a, ok := byNode[node]
			if !ok {
				t.Fatalf("the dispatcher's record of %s's alert is gone: %+v", node, as)
			}
			h := history[node]
			if len(h) == 0 || h[len(h)-1] != (seen{a.State, a.Reason}) {
				history[node] = append(h, seen{a.State, a.Reason})
			}
		}
		if byNode["node-h"].State == remediate.StateSucceeded && !final(byNode["node-u"].State) && !final(byNode["node-s"].State) {
			healthyDoneFirst = true
		}
		return final(byNode["node-h"].State) && final(byNode["node-u"].State) && final(byNode["node-s"].State)
	})
	for node, h := range history {
		t.Logf("%s: %+v", node, h)
	}

	// The healthy node: delivered once, while the slow one's first request
	// was still waiting, and recorded by its agent.
	hs := healthy.get()
	if len(hs) != 1 || forwardedAlert(t, hs[0].body) != (alertKey{fps["node-h"], startsAt}) || !strings.HasPrefix(hs[0].authz, intake.FleetScheme+" ") || strings.Contains(hs[0].authz, token) {
		t.Fatalf("healthy agent got %d requests: %+v", len(hs), hs)
	}
	ss := slow.get()
	if len(ss) != 2 {
		t.Fatalf("slow agent got %d requests, want a timed-out one and a retry", len(ss))
	}
	if !hs[0].at.Before(ss[0].end) {
		t.Errorf("the healthy node's alert arrived at %s, after the slow node's first request ended at %s: forwarding is serialised",
			hs[0].at.Format(time.StampMilli), ss[0].end.Format(time.StampMilli))
	}
	if !healthyDoneFirst {
		t.Error("never saw the healthy node's forward succeeded while the other two were still pending")
	}
	if h := history["node-h"]; h[len(h)-1].state != remediate.StateSucceeded {
		t.Errorf("healthy node's record: %+v", h)
	}
	if as := actions(t, agentH); len(as) != 1 || as[0].AlertFingerprint != fps["node-h"] || !as[0].AlertStartsAt.Equal(startsAt) {
		t.Errorf("healthy agent's actions: %+v", as)
	}

	// The slow node: cut off by the timeout, retried with the same key,
	// then delivered.
	if !ss[0].cutOff {
		t.Error("the slow agent's first request was not cut off by --dispatch.timeout")
	}
	for _, s := range ss {
		if forwardedAlert(t, s.body) != (alertKey{fps["node-s"], startsAt}) {
			t.Errorf("a retry changed the alert's key: %s", s.body)
		}
	}
	checkHistory(t, "node-s", history["node-s"], "Client.Timeout", remediate.StateSucceeded)

	// The unreachable node: retried, then failed, and never dropped.
	checkHistory(t, "node-u", history["node-u"], "connection refused", remediate.StateFailed)
	if h := history["node-u"]; !strings.Contains(h[len(h)-1].reason, "unreachable") {
		t.Errorf("node-u's failure does not say why: %q", h[len(h)-1].reason)
	}
	// Each attempt is a claim of the action in the dispatcher's audit trail:
	// the slow node's took two, the unreachable node's the three allowed.
	wantClaims := map[string]int{"node-h": 1, "node-s": 2, "node-u": 3}
	for _, a := range actions(t, dispatcher) {
		var d actionDetail
		getJSON(t, http.DefaultClient, dispatcher+"/api/v1/actions/"+a.ID, token, &d)
		claims := 0
		for _, e := range d.Events {
			if e.Kind == "claim" {
				claims++
			}
		}
		if claims != wantClaims[a.Node] {
			t.Errorf("%s's alert was attempted %d times, want %d", a.Node, claims, wantClaims[a.Node])
		}
	}
	// The engine records an action's end before it counts it: poll.
	testenv.Eventually(t, 5*time.Second, "actions_total to count 1 failed and 2 succeeded forwards", func() bool {
		return metricValue(t, dispatcher, "gpu_orphan_remediator_actions_total", map[string]string{"state": "failed"}) == 1 &&
			metricValue(t, dispatcher, "gpu_orphan_remediator_actions_total", map[string]string{"state": "succeeded"}) == 2
	})
}

// seen is one state of an action's record, as a poll saw it.
type seen struct {
	state  remediate.State
	reason string
}

// checkHistory: a record went through a retry whose reason names why, and
// ended in the final state.
func checkHistory(t *testing.T, node string, h []seen, why string, final remediate.State) {
	t.Helper()
	retried := slices.ContainsFunc(h, func(s seen) bool {
		return s.state == remediate.StateQueued && strings.HasPrefix(s.reason, "retrying: ") && strings.Contains(s.reason, why)
	})
	if !retried {
		t.Errorf("%s: never saw a queued record with a retry reason naming %q: %+v", node, why, h)
	}
	if h[len(h)-1].state != final {
		t.Errorf("%s: ended %+v, want %s", node, h[len(h)-1], final)
	}
}

func waitReady(t *testing.T, c *http.Client, baseURL string) {
	t.Helper()
	testenv.Eventually(t, 15*time.Second, baseURL+" to be ready", func() bool {
		resp, err := c.Get(baseURL + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// clientFrom is an HTTP client whose connections come from the loopback
// address ip, a source of its own for the remediator's failure limit.
func clientFrom(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext}}
}

func postFrom(t *testing.T, c *http.Client, baseURL, tok string, body []byte) int {
	t.Helper()
	r := deliver(c, baseURL, tok, body)
	if r.err != nil {
		t.Fatalf("post: %v", r.err)
	}
	return r.code
}

// failureBudget is what a client can know of one source's failure budget
// on the remediator: burst failures at the first one, which the server
// counted no earlier than start, and one more for each period since. A
// 401 beyond that is one the blocking rule should have answered 429; on a
// slow machine the budget refills between requests, which this allows for
// instead of assuming the requests come quickly.
type failureBudget struct {
	start    time.Time
	burst    int
	period   time.Duration
	failures int // 401s so far
}

// most is the most failures the budget allows by at.
func (b *failureBudget) most(at time.Time) int {
	return b.burst + int(at.Sub(b.start)/b.period)
}

// guess posts a wrong token from c and checks a 401 against the budget.
func (b *failureBudget) guess(t *testing.T, c *http.Client, baseURL, tok string, body []byte) int {
	t.Helper()
	code := postFrom(t, c, baseURL, tok, body)
	at := time.Now()
	switch code {
	case http.StatusUnauthorized:
		b.failures++
		if most := b.most(at); b.failures > most {
			t.Errorf("wrong token %q: 401 number %d %s after the first guess; the budget allows %d by then (a burst of %d, one more per %s)",
				tok, b.failures, at.Sub(b.start).Round(time.Millisecond), most, b.burst, b.period)
		}
	case http.StatusTooManyRequests:
	default:
		t.Errorf("wrong token %q: %d, want 401 or 429", tok, code)
	}
	return code
}

// TestAuthTokenGuessing: 50 wrong tokens from one source. The first few get
// 401 and count as failures; once the source's failure budget (a burst of
// 5, refilled at --auth.failures-per-minute) is spent, it gets 429, which
// Alertmanager does not retry. A correct token is always accepted, also
// from a blocked source: on Kubernetes every request may come from one SNAT
// address, and a 429 to Alertmanager would lose the remediation. The block
// lifts for wrong tokens as the budget refills.
//
// The budget refills by the wall clock of another process, so no answer is
// expected at a given time: every 401 is checked against the most failures
// the budget can have allowed by the time it came (failureBudget). A
// remediator that never blocks fails that check within the first 50
// guesses, however slow the machine.
func TestAuthTokenGuessing(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	// 30 per minute: the budget regains one failure every 2 s.
	agentURL, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--auth.failures-per-minute=30")
	guesser, other := clientFrom("127.0.0.3"), clientFrom("127.0.0.1")
	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(30), time.Now().Add(-time.Minute)))

	b := &failureBudget{start: time.Now(), burst: 5, period: 2 * time.Second}
	var codes []int
	for i := range 50 {
		codes = append(codes, b.guess(t, guesser, agentURL, fmt.Sprintf("wrong-token-%02d-0123456789", i), body))
	}
	elapsed := time.Since(b.start)
	count := map[int]int{}
	for _, c := range codes {
		count[c]++
	}
	t.Logf("50 wrong tokens in %s: %d x 401, %d x 429", elapsed.Round(time.Millisecond), count[401], count[429])
	if slices.ContainsFunc(codes[:b.burst], func(c int) bool { return c != http.StatusUnauthorized }) || count[http.StatusTooManyRequests] == 0 {
		t.Fatalf("50 wrong tokens in %s: %v; want %d 401s, then 429s (and a 401 each time the budget regained a failure)", elapsed.Round(time.Millisecond), codes, b.burst)
	}

	// Meanwhile: the blocked source's correct token is accepted, and does
	// not refill its budget: its next wrong token is still blocked, unless
	// the slow machine took a whole period to get there.
	if code := postFrom(t, guesser, agentURL, token, body); code != http.StatusOK {
		t.Errorf("blocked source, correct token: %d, want 200", code)
	}
	if code := b.guess(t, guesser, agentURL, "wrong-token-still-0123456789", body); code != http.StatusTooManyRequests && b.failures <= b.most(time.Now()) {
		t.Logf("blocked source, wrong token: %d after %s: the budget refilled meanwhile", code, time.Since(b.start).Round(time.Millisecond))
	}
	if code := postFrom(t, other, agentURL, token, body); code != http.StatusOK {
		t.Errorf("other source, correct token: %d, want 200", code)
	}
	// Only token checks that failed are auth failures; the 429s are counted
	// by code.
	failures, blocked := b.failures, len(codes)+1-b.failures
	if v := metricValue(t, agentURL, "gpu_orphan_remediator_auth_failures_total", nil); int(v) != failures {
		t.Errorf("auth_failures_total = %v, want the %d 401s", v, failures)
	}
	if v := metricValue(t, agentURL, "gpu_orphan_remediator_requests_total", map[string]string{"code": "401"}); int(v) != failures {
		t.Errorf("requests_total{code=\"401\"} = %v, want %d", v, failures)
	}
	if v := metricValue(t, agentURL, "gpu_orphan_remediator_requests_total", map[string]string{"code": "429"}); int(v) != blocked {
		t.Errorf("requests_total{code=\"429\"} = %v, want %d", v, blocked)
	}
	// Wrong tokens stay blocked until the budget refills; then they are
	// checked again, and block again as soon as the regained budget is spent.
	var recovered time.Time
	testenv.Eventually(t, 20*time.Second, "the blocked source's wrong token to be checked again", func() bool {
		if b.guess(t, guesser, agentURL, "wrong-token-probe-0123456789", body) == http.StatusUnauthorized {
			recovered = time.Now()
			return true
		}
		return false
	})
	t.Logf("the block lifted %s after the first guess", recovered.Sub(b.start).Round(100*time.Millisecond))
	var again []int
	for len(again) < 50 && !slices.Contains(again, http.StatusTooManyRequests) {
		again = append(again, b.guess(t, guesser, agentURL, "wrong-token-again-0123456789", body))
	}
	if n := len(again); again[n-1] != http.StatusTooManyRequests {
		t.Errorf("wrong tokens after the block: %v, want 401s, then 429", again)
	}
}

// mountTmpfs mounts a tmpfs of size at dir, or skips the test.
func mountTmpfs(t *testing.T, dir, size string) {
	t.Helper()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size+",mode=0700", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs (needs root or CAP_SYS_ADMIN), so the full store cannot be simulated: %v: %s", err, bytes.TrimSpace(out))
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, out)
			_ = exec.Command("umount", "-l", dir).Run() // the last resort; the test has failed already
		}
	})
}

// fill writes ballast into path until only leave bytes are free on its
// file system (or none, when leave is 0).
func fill(t *testing.T, path string, leave uint64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 4096)
	for {
		var st syscall.Statfs_t
		if err := syscall.Statfs(filepath.Dir(path), &st); err != nil {
			t.Fatal(err)
		}
		free := st.Bavail * uint64(st.Bsize)
		if free <= leave {
			return
		}
		if _, err := f.Write(chunk[:min(uint64(len(chunk)), free-leave)]); err != nil {
			if errors.Is(err, syscall.ENOSPC) {
				return
			}
			t.Fatal(err)
		}
	}
}

func statusOf(t *testing.T, baseURL string) map[string]any {
	t.Helper()
	var s map[string]any
	if code := getJSON(t, http.DefaultClient, baseURL+"/api/v1/status", token, &s); code != http.StatusOK {
		t.Fatalf("GET status: %d", code)
	}
	return s
}

func readyCode(t *testing.T, baseURL string) (int, string) {
	t.Helper()
	resp, err := http.Get(baseURL + "/-/ready")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestStoreFull: the audit store on a 2 MiB tmpfs that fills up. First
// below the store's reserve (less than 1 MiB free), then completely: the
// remediator says it is not ready, reports the store's error, refuses
// webhooks with 503 (which Alertmanager retries) and starts no action. Once
// the space is back, it recovers by itself.
func TestStoreFull(t *testing.T) {
	skipShort(t)
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root: the full store cannot be simulated")
	}
	dir := filepath.Join(t.TempDir(), "store")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	mountTmpfs(t, dir, "2m")
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	w := testenv.StartWorkload(t, root, 1, 2048, 1)
	agentURL, _ := startAgent(t, root, filepath.Join(dir, "r.db"))
	w.KillParent(t)
	startsAt := time.Now().Add(-time.Minute)

	ballast := filepath.Join(dir, "ballast")
	for i, stage := range []struct {
		name  string
		leave uint64
	}{{"below the reserve", 256 << 10}, {"completely full", 0}} {
		fill(t, ballast, stage.leave)
		testenv.Eventually(t, 15*time.Second, "store_up to drop to 0 ("+stage.name+")", func() bool {
			return metricValue(t, agentURL, "gpu_orphan_remediator_store_up", nil) == 0
		})
		if code, body := readyCode(t, agentURL); code != http.StatusServiceUnavailable || !strings.Contains(body, "audit store") {
			t.Errorf("%s: /-/ready %d %q, want 503 naming the audit store", stage.name, code, body)
		}
		if s := statusOf(t, agentURL); s["store_error"] == nil || !strings.Contains(fmt.Sprint(s["store_error"]), "room") && !strings.Contains(fmt.Sprint(s["store_error"]), "full") {
			t.Errorf("%s: status %v, want a store_error about space", stage.name, s)
		}
		for j := range 3 {
			code, body := post(t, agentURL, token, payload(alert("firing", "node-a", uuid, fp(40+3*i+j), startsAt)))
			if code != http.StatusServiceUnavailable {
				t.Errorf("%s: webhook %d %s, want 503", stage.name, code, body)
			}
		}
		if as := actions(t, agentURL); len(as) != 0 {
			t.Errorf("%s: %d actions started: %+v", stage.name, len(as), as)
		}
	}
	if v := metricValue(t, agentURL, "gpu_orphan_remediator_requests_total", map[string]string{"code": "503"}); v != 6 {
		t.Errorf("requests_total{code=\"503\"} = %v, want 6", v)
	}
	if v := metricValue(t, agentURL, "gpu_orphan_remediator_notifications_total", map[string]string{"result": "accepted"}); v != 0 {
		t.Errorf("notifications_total{result=\"accepted\"} = %v while the store was full", v)
	}

	if err := os.Remove(ballast); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 15*time.Second, "store_up to return to 1", func() bool {
		return metricValue(t, agentURL, "gpu_orphan_remediator_store_up", nil) == 1
	})
	if code, body := readyCode(t, agentURL); code != http.StatusOK {
		t.Errorf("after the space came back: /-/ready %d %q", code, body)
	}
	if s := statusOf(t, agentURL); s["store_error"] != nil {
		t.Errorf("after the space came back: status %v", s)
	}
	// Alertmanager's retry of a refused notification is now accepted.
	code, body := post(t, agentURL, token, payload(alert("firing", "node-a", uuid, fp(40), startsAt)))
	if code != http.StatusOK || results(t, body)["accepted"] != 1 {
		t.Fatalf("after the space came back: %d %s", code, body)
	}
	if a := finished(t, agentURL, 20*time.Second); a.State != remediate.StateDryRun || a.AlertFingerprint != fp(40) {
		t.Errorf("after the space came back: %+v", a)
	}
}

// TestUnhealthySnapshotNeverSignals: while the driver fails (the simulated
// NVML says "GPU is lost"), an alert for a GPU with an orphan signals
// nothing. Once the driver answers again, a new alert cleans up (--act).
func TestUnhealthySnapshotNeverSignals(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	w := testenv.StartWorkload(t, root, 1, 2048, 2)
	agentURL, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	w.KillParent(t)
	startsAt := time.Now().Add(-time.Minute)
	signals := func() float64 {
		return metricValue(t, agentURL, "gpu_orphan_remediator_signals_total", map[string]string{"signal": "SIGTERM"}) +
			metricValue(t, agentURL, "gpu_orphan_remediator_signals_total", map[string]string{"signal": "SIGKILL"})
	}

	// The whole driver fails. The alert is recorded (the GPU was listed
	// before), and its action waits: never acted on a failing snapshot.
	if err := sim.WriteFaults(root, sim.Faults{Error: "GPU is lost", GPU: sim.AllGPUs}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 15*time.Second, "the agent to see the failed driver", func() bool {
		code, _ := readyCode(t, agentURL)
		return code == http.StatusServiceUnavailable
	})
	code, body := post(t, agentURL, token, payload(alert("firing", "node-a", uuid, fp(50), startsAt)))
	if code != http.StatusOK || results(t, body)["accepted"] != 1 {
		t.Fatalf("post while the driver fails: %d %s", code, body)
	}
	waiting := func(fingerprint, reason string) {
		t.Helper()
		testenv.Eventually(t, 20*time.Second, "the action to wait on "+reason, func() bool {
			for _, a := range actions(t, agentURL) {
				if a.AlertFingerprint == fingerprint {
					return a.State == remediate.StateQueued && strings.HasPrefix(a.Reason, "waiting: "+reason)
				}
			}
			return false
		})
	}
	waiting(fp(50), "snapshot_unhealthy")

	// Only GPU 1 fails: a new alert's action waits too.
	if err := sim.WriteFaults(root, sim.Faults{Error: "GPU is lost", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 15*time.Second, "the agent to list GPU 1 again", func() bool {
		code, _ := readyCode(t, agentURL)
		return code == http.StatusOK
	})
	code, body = post(t, agentURL, token, payload(alert("firing", "node-a", uuid, fp(51), startsAt)))
	if code != http.StatusOK || results(t, body)["accepted"] != 1 {
		t.Fatalf("post while GPU 1 fails: %d %s", code, body)
	}
	waiting(fp(51), "gpu_read_failed")
	if s := signals(); s != 0 {
		t.Fatalf("%v signals sent while the driver failed", s)
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Fatalf("orphan holder %d died while the driver failed", c)
		}
	}

	// The driver recovers: the waiting work acts on a healthy snapshot, once.
	if err := sim.ClearFaults(root); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "both actions to finish", func() bool {
		n := 0
		for _, a := range actions(t, agentURL) {
			if a.State != remediate.StateQueued && a.State != remediate.StateRunning {
				n++
			}
		}
		return n == 2
	})
	succeeded := 0
	for _, a := range actions(t, agentURL) {
		switch a.State {
		case remediate.StateSucceeded:
			succeeded++
			if len(a.Targets) != 2 {
				t.Errorf("targets %+v", a.Targets)
			}
		case remediate.StateSkipped: // the other found nothing left to do
		default:
			t.Errorf("action %s: %s %q", a.AlertFingerprint, a.State, a.Reason)
		}
	}
	if succeeded != 1 {
		t.Errorf("%d actions succeeded, want exactly one", succeeded)
	}
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("orphan holder %d survived the cleanup", c)
		}
	}
	if got := usedMiB(t, root, 1); got != 0 {
		t.Errorf("GPU 1 uses %d MiB after the cleanup", got)
	}
	if s := signals(); s < 2 {
		t.Errorf("%v signals counted, want at least a SIGTERM per holder", s)
	}
}
