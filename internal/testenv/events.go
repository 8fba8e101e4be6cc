package testenv

import (
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// The daemons each test started that may follow the kernel's process
// events, by their base URL: a trainer killed before a daemon applied its
// workers' fork events cannot be compared with any more (the record checks
// each fork against the parent's files as it applies it), and its workers
// stay unproven, on the safe side. On a loaded machine the daemons apply
// events late; a test that kills a trainer waits for them first, so that
// what it tests is the death, not the daemons' lag.
var (
	followersMu sync.Mutex
	followers   = map[testing.TB]*following{}
)

// following are a test's daemons, and the time up to which they were
// last seen to have applied the events.
type following struct {
	urls    []string
	applied time.Time
}

// FollowsEvents registers a daemon of t, by its base URL, whose fork record
// a kill waits for (WaitEventsApplied).
func FollowsEvents(t testing.TB, baseURL string) {
	followersMu.Lock()
	defer followersMu.Unlock()
	f, ok := followers[t]
	if !ok {
		f = &following{}
		followers[t] = f
		t.Cleanup(func() {
			followersMu.Lock()
			defer followersMu.Unlock()
			delete(followers, t)
		})
	}
	f.urls = append(f.urls, strings.TrimSuffix(baseURL, "/"))
	f.applied = time.Time{} // a new daemon has applied nothing yet
}

// followsEventsFromArgs registers a daemon started with
// --web.listen-address=ADDR.
func followsEventsFromArgs(t testing.TB, args []string) {
	for _, a := range args {
		if addr, ok := strings.CutPrefix(a, "--web.listen-address="); ok && !strings.Contains(addr, ",") {
			FollowsEvents(t, "http://"+addr)
		}
	}
}

// WaitEventsApplied waits until each daemon of t that follows the process
// events has applied every event the kernel sent before since (a
// workload's ready line, for instance): a marker process is started now,
// and each daemon's gpu_orphan_process_events_applied_timestamp_seconds
// must reach now. It returns at once when the daemons were already seen
// past since, so that trainers killed one after another die close
// together. A daemon that is not reachable, or does not follow the
// events, is not waited for.
func WaitEventsApplied(t testing.TB, since time.Time) {
	t.Helper()
	followersMu.Lock()
	f := followers[t]
	var urls []string
	if f != nil && f.applied.Before(since) {
		urls = slices.Clone(f.urls)
	}
	followersMu.Unlock()
	if len(urls) == 0 {
		return
	}
	now := time.Now()
	if err := exec.Command("true").Run(); err != nil {
		t.Fatalf("the marker process: %v", err)
	}
	for _, url := range urls {
		Eventually(t, 10*time.Second, url+"'s fork record to apply the process events up to now", func() bool {
			applied, follows := eventsApplied(url + "/metrics")
			return !follows || !applied.Before(now)
		})
	}
	followersMu.Lock()
	if len(f.urls) == len(urls) && f.applied.Before(now) {
		f.applied = now
	}
	followersMu.Unlock()
}

// eventsApplied scrapes url for when its fork record applied its last
// event; follows is false when the daemon cannot be scraped or does not
// follow the events.
func eventsApplied(url string) (applied time.Time, follows bool) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return time.Time{}, false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return time.Time{}, false
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		return time.Time{}, false
	}
	if up, _ := Value(mfs, "gpu_orphan_process_events_up", nil); up != 1 {
		return time.Time{}, false
	}
	v, ok := Value(mfs, "gpu_orphan_process_events_applied_timestamp_seconds", nil)
	if !ok {
		return time.Time{}, true
	}
	return time.Unix(0, int64(v*1e9)), true
}
