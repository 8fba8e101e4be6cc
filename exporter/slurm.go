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
	// MaxAge is how long one answer of sinfo serves scrapes: it asks
	// slurmctld, which many nodes' scrapes must not flood.
	MaxAge  time.Duration
	Timeout time.Duration
	Logger  *slog.Logger
}

// SlurmDrain reports whether Slurm keeps this node drained because of
// gpu-orphan (--collector.slurm-drain): GPUOrphanNodeOutOfScheduling fires
// on it, and stays until a person resumes the node.
type SlurmDrain struct {
	cfg  SlurmConfig
	read func(ctx context.Context) (slurm.NodeState, error)

	mu     sync.Mutex
	at     time.Time
	state  slurm.NodeState
	err    error
	logged bool
}

// NewSlurmDrain returns the collector.
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

// Describe implements prometheus.Collector.
func (d *SlurmDrain) Describe(ch chan<- *prometheus.Desc) {
	ch <- slurmDrainedDesc
	ch <- slurmReadOKDesc
}

// Collect implements prometheus.Collector. Without an answer from sinfo it
// reports the read as failed and says nothing of the drain, rather than 0.
func (d *SlurmDrain) Collect(ch chan<- prometheus.Metric) {
	state, err := d.latest()
	if err != nil {
		ch <- prometheus.MustNewConstMetric(slurmReadOKDesc, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(slurmReadOKDesc, prometheus.GaugeValue, 1)
	if state.ByGPUOrphan() {
		ch <- prometheus.MustNewConstMetric(slurmDrainedDesc, prometheus.GaugeValue, 1, state.Reason)
		return
	}
	ch <- prometheus.MustNewConstMetric(slurmDrainedDesc, prometheus.GaugeValue, 0, "")
}

// latest is sinfo's answer, at most MaxAge old. A failure is logged once
// until sinfo answers again.
func (d *SlurmDrain) latest() (slurm.NodeState, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.at.IsZero() && time.Since(d.at) < d.cfg.MaxAge {
		return d.state, d.err
	}
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.Timeout)
	defer cancel()
	d.state, d.err = d.read(ctx)
	d.at = time.Now()
	switch {
	case d.err != nil && !d.logged:
		d.cfg.Logger.Error("Reading this node's state from Slurm failed", "node", d.cfg.Node, "err", d.err)
		d.logged = true
	case d.err == nil && d.logged:
		d.cfg.Logger.Info("Reading this node's state from Slurm works again", "node", d.cfg.Node)
		d.logged = false
	}
	return d.state, d.err
}
