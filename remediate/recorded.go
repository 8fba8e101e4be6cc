package remediate

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// RecordedCount is how many finished actions of one source ended in one
// state.
type RecordedCount struct {
	Source string
	State  State
	Count  int
}

// RecordedCounter counts the finished actions of an audit store
// (store.Store.CountFinished).
type RecordedCounter interface {
	CountFinished(ctx context.Context) ([]RecordedCount, error)
}

const recordedHelp = "Finished actions in the audit store, by source (webhook, cli, prolog, epilog, dispatch) and final state, whichever process recorded them: " +
	"the Slurm hooks and gpu-orphan clean that share the store count too. Read from the store at scrape time."

var (
	recordedActionsDesc = prometheus.NewDesc("gpu_orphan_remediator_recorded_actions_total", recordedHelp, []string{"source", "state"}, nil)
	recordedSuccessDesc = prometheus.NewDesc("gpu_orphan_remediator_recorded_actions_success",
		"1 if the audit store's actions could be counted for this scrape; 0 if not (logged), and recorded_actions_total is then absent.",
		nil, nil)
)

// RecordedCollector exposes the finished actions of the audit store by
// source and state. The prolog, the epilog and `gpu-orphan clean` are
// short-lived processes that share the node agent's store: their actions
// reach Prometheus only through it. The counts are read at scrape time
// with one GROUP BY, and kept for MinInterval, so that frequent or
// concurrent scrapes do not each query the store.
type RecordedCollector struct {
	src RecordedCounter
	// zero are the sources whose succeeded and failed series are exposed
	// at 0 before the store has any, so that increase() sees the first.
	zero   []string
	logger *slog.Logger
	// MinInterval is how long a count is reused; Timeout bounds a query.
	MinInterval, Timeout time.Duration
	now                  func() time.Time

	mu     sync.Mutex
	at     time.Time
	counts []RecordedCount
	err    error
}

// NewRecordedCollector counts src's finished actions; zero are the
// sources this process's store is expected to hold (Sources' node ones on
// a node agent, SourceDispatch on a dispatcher).
func NewRecordedCollector(src RecordedCounter, zero []string, logger *slog.Logger) *RecordedCollector {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &RecordedCollector{src: src, zero: zero, logger: logger, MinInterval: 5 * time.Second, Timeout: 5 * time.Second, now: time.Now}
}

// Describe implements prometheus.Collector.
func (c *RecordedCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- recordedActionsDesc
	ch <- recordedSuccessDesc
}

// Collect implements prometheus.Collector.
func (c *RecordedCollector) Collect(ch chan<- prometheus.Metric) {
	counts, err := c.read()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(recordedSuccessDesc, prometheus.GaugeValue, 0)
		return
	}
	type key struct {
		source string
		state  State
	}
	values := map[key]int{}
	for _, s := range c.zero {
		values[key{s, StateSucceeded}] = 0
		values[key{s, StateFailed}] = 0
	}
	for _, rc := range counts {
		source := rc.Source
		if source == "" {
			source = "unknown" // a row written with no source
		}
		values[key{source, rc.State}] += rc.Count
	}
	for k, v := range values {
		ch <- prometheus.MustNewConstMetric(recordedActionsDesc, prometheus.CounterValue, float64(v), k.source, string(k.state))
	}
	ch <- prometheus.MustNewConstMetric(recordedSuccessDesc, prometheus.GaugeValue, 1)
}

// read returns the counts, from the store when the last read is older than
// MinInterval. A failure is logged once per read and kept as long as a
// count would be.
func (c *RecordedCollector) read() ([]RecordedCount, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if !c.at.IsZero() && now.Sub(c.at) < c.MinInterval && now.Sub(c.at) >= 0 {
		return c.counts, c.err
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.Timeout)
	defer cancel()
	c.counts, c.err = c.src.CountFinished(ctx)
	c.at = now
	if c.err != nil {
		c.logger.Error("Counting the recorded actions for /metrics", "err", c.err)
	}
	return c.counts, c.err
}
