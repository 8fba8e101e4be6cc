package exporter

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/internal/slurm"
)

var (
	slurmDrainedDesc = nodeDesc("slurm_node_drained",
		"1 while Slurm keeps this node drained (or draining) with a reason that gpu-orphan's prolog or epilog set (it starts \"gpu-orphan: \"), "+
			"with that reason; 0 when not drained by gpu-orphan.", "reason")
	slurmReadOKDesc = nodeDesc("slurm_read_success", "1 if sinfo answered for this node at the latest read, 0 if not.")
)

// SlurmConfig is what SlurmDrain reads.
type SlurmConfig struct {
	// Sinfo is the sinfo command (slurm.Look's result), and Node this
	// node's name in Slurm.
	Sinfo, Node string
	// MaxAge is how often Run asks sinfo: it asks slurmctld, which many
	// nodes' exporters must not flood.
	MaxAge  time.Duration
	Timeout time.Duration
	Logger  *slog.Logger
}

// SlurmDrain reports whether Slurm keeps this node drained because of
// gpu-orphan (--collector.slurm-drain): GPUOrphanNodeOutOfScheduling fires
// on it, and stays until a person resumes the node. Run asks sinfo in the
// background, as the snapshot loop reads NVML: a scrape only reads its
// latest answer, and never waits for slurmctld.
type SlurmDrain struct {
	cfg  SlurmConfig
	read func(ctx context.Context) (slurm.NodeState, error)

	mu       sync.Mutex
	answered bool // an answer, or a failure, is there
	state    slurm.NodeState
	err      error
	logged   bool
}

// NewSlurmDrain returns the collector; Run feeds it.
func NewSlurmDrain(cfg SlurmConfig) *SlurmDrain {
	if cfg.MaxAge <= 0 {
		cfg.MaxAge = 30 * time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	d := &SlurmDrain{cfg: cfg}
	d.read = func(ctx context.Context) (slurm.NodeState, error) { return slurm.ReadNode(ctx, cfg.Sinfo, cfg.Node) }
	return d
}

// Run asks sinfo now, then every MaxAge, until ctx ends.
func (d *SlurmDrain) Run(ctx context.Context) {
	tick := time.NewTicker(d.cfg.MaxAge)
	defer tick.Stop()
	for {
		d.refresh(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// Describe implements prometheus.Collector.
func (d *SlurmDrain) Describe(ch chan<- *prometheus.Desc) {
	ch <- slurmDrainedDesc
	ch <- slurmReadOKDesc
}

// Collect implements prometheus.Collector, from sinfo's latest answer:
// nothing before the first; after a failed read, the failure and nothing
// of the drain, rather than 0.
func (d *SlurmDrain) Collect(ch chan<- prometheus.Metric) {
	d.mu.Lock()
	answered, state, err := d.answered, d.state, d.err
	d.mu.Unlock()
	switch {
	case !answered:
		return
	case err != nil:
		ch <- prometheus.MustNewConstMetric(slurmReadOKDesc, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(slurmReadOKDesc, prometheus.GaugeValue, 1)
	if state.ByGPUOrphan() {
		ch <- prometheus.MustNewConstMetric(slurmDrainedDesc, prometheus.GaugeValue, 1, label(state.Reason))
		return
	}
	ch <- prometheus.MustNewConstMetric(slurmDrainedDesc, prometheus.GaugeValue, 0, "")
}

// refresh asks sinfo once. A failure is logged once until sinfo answers
// again.
func (d *SlurmDrain) refresh(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
	state, err := d.read(ctx)
	cancel()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.answered, d.state, d.err = true, state, err
	switch {
	case err != nil && !d.logged:
		d.cfg.Logger.Error("Reading this node's state from Slurm failed", "node", d.cfg.Node, "err", err)
		d.logged = true
	case err == nil && d.logged:
		d.cfg.Logger.Info("Reading this node's state from Slurm works again", "node", d.cfg.Node)
		d.logged = false
	}
}
