// Package exporter turns the latest snapshot into Prometheus metrics. It
// never touches NVML or /proc itself: scrapes read what the background loop
// last recorded, so scrape time does not grow with the number of processes.
package exporter

import (
	"log/slog"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/termsafe"
)

const namespace = "gpu_orphan"

var gpuLabels = []string{"gpu", "uuid"}

func gpuDesc(name, help string, extra ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, append(append([]string{}, gpuLabels...), extra...), nil)
}

func nodeDesc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, labels, nil)
}

var (
	gpuInfoDesc = gpuDesc("gpu_info", "GPU identity as NVML reports it; value 1.", "name", "minor", "mig_instance")
	readOKDesc  = gpuDesc("gpu_read_success", "1 if NVML answered for this GPU in the latest snapshot, 0 if not.")
	supportDesc = gpuDesc("gpu_accounting_supported", "1 if this GPU's ownership can be accounted; 0 with the reason (mig, memory_info_v2, foreign_pid_namespace, read_error) if the numbers are withheld rather than published wrong.", "reason")

	totalDesc    = gpuDesc("memory_total_bytes", "Total GPU memory (NVML memory info v2).")
	usedDesc     = gpuDesc("memory_used_bytes", "Used GPU memory (NVML memory info v2; excludes the driver's reservation).")
	reservedDesc = gpuDesc("memory_reserved_bytes", "GPU memory reserved by the driver (NVML memory info v2).")
	freeDesc     = gpuDesc("memory_free_bytes", "Free GPU memory (NVML memory info v2).")

	ownedLiveDesc    = gpuDesc("memory_owned_live_bytes", "GPU memory NVML charges to processes that are alive.")
	ownedDeadDesc    = gpuDesc("memory_owned_dead_bytes", "GPU memory NVML charges to PIDs that are gone or zombies.")
	unattributedDesc = gpuDesc("memory_unattributed_bytes", "Used GPU memory NVML charges to no process (about 8 MiB per live context).")
	unownedDesc      = gpuDesc("unowned_memory_bytes", "GPU memory with no live owner: used minus memory owned by live processes.")
	ageDesc          = gpuDesc("unowned_memory_age_seconds", "How long the GPU's memory with no live owner has stayed above the orphan threshold; 0 when below.")
	suspectsDesc     = gpuDesc("suspect_holders", "Number of live processes holding the GPU that are suspects (see gpu_orphan_holder_info).")

	processDesc = gpuDesc("process_memory_bytes", "GPU memory NVML charges to one listed PID, and whether that PID is alive.", "pid", "comm", "alive")
	holderDesc  = gpuDesc("holder_info", "A live process holding the GPU's device node that is a suspect, with the reason and what proves it (or, for unexplained_holder, why nothing does); value 1.",
		"pid", "pgid", "sid", "ppid", "comm", "user", "container_id", "pod_uid", "reason", "proof")

	deadOwnerDesc = gpuDesc("dead_owner_info", "A PID that NVML lists as an owner on the GPU but that is dead, with who it was while it lived (empty when this exporter never saw it alive: it started after the owner died); value 1.",
		"pid", "comm", "user", "slurm_job", "pod_uid", "container_id")

	pidsVisibleDesc = nodeDesc("host_pids_visible", "1 if NVML's PIDs are in this exporter's PID namespace, 0 if not (then no memory is called orphaned).")
	sourceOKDesc    = nodeDesc("source_success", "1 if the source succeeded in the latest snapshot.", "source")
	sourceDurDesc   = nodeDesc("source_duration_seconds", "How long the source took in the latest snapshot.", "source")
	takenDesc       = nodeDesc("snapshot_timestamp_seconds", "When the latest snapshot was taken.")
	snapAgeDesc     = nodeDesc("snapshot_age_seconds", "Age of the latest snapshot at scrape time.")
	thresholdDesc   = nodeDesc("orphan_threshold_bytes", "Memory with no live owner above which a GPU's age clock runs.")
	unreadableDesc  = nodeDesc("fdscan_unreadable_processes", "Processes whose descriptors could not be read in the latest snapshot (not root, no CAP_SYS_PTRACE); when not 0, holders may be missing and the fdscan source fails.")
)

// Source is where the collector finds the latest snapshot; a
// *snapshot.Loop in production.
type Source interface {
	Latest() *snapshot.Snapshot
	OrphanBytes() uint64
}

// Collector exposes the latest snapshot of a Source.
type Collector struct {
	loop   Source
	logger *slog.Logger
	now    func() time.Time
}

// NewCollector returns a Collector reading loop.
func NewCollector(loop Source, logger *slog.Logger) *Collector {
	return &Collector{loop: loop, logger: logger, now: time.Now}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{gpuInfoDesc, readOKDesc, supportDesc, totalDesc, usedDesc, reservedDesc, freeDesc,
		ownedLiveDesc, ownedDeadDesc, unattributedDesc, unownedDesc, ageDesc, suspectsDesc, processDesc, holderDesc,
		deadOwnerDesc, pidsVisibleDesc, sourceOKDesc, sourceDurDesc, takenDesc, snapAgeDesc, thresholdDesc, unreadableDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.loop.Latest()
	if s == nil {
		return
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(thresholdDesc, float64(c.loop.OrphanBytes()))
	gauge(takenDesc, float64(s.Taken.UnixNano())/1e9)
	gauge(snapAgeDesc, c.now().Sub(s.Taken).Seconds())
	for _, src := range s.Sources {
		gauge(sourceOKDesc, boolFloat(src.Err == nil), src.Name)
		gauge(sourceDurDesc, src.Duration.Seconds(), src.Name)
	}
	if len(s.Sources) > 1 {
		gauge(pidsVisibleDesc, boolFloat(s.HostPIDsVisible))
	}
	// Always present, so that an alert on it needs no absent().
	gauge(unreadableDesc, float64(s.FDScanDenied))
	for _, g := range s.GPUs {
		c.collectGPU(ch, g, s.Taken)
	}
}

func (c *Collector) collectGPU(ch chan<- prometheus.Metric, g snapshot.GPU, taken time.Time) {
	id := []string{strconv.Itoa(g.Device.Index), g.Device.UUID}
	gauge := func(d *prometheus.Desc, v float64, extra ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append(append([]string{}, id...), extra...)...)
	}
	gauge(gpuInfoDesc, 1, g.Device.Name, strconv.Itoa(g.Device.Minor), g.Device.MIGInstance)
	gauge(readOKDesc, boolFloat(g.Err == nil))
	reason := g.Unsupported
	if g.Err != nil {
		reason = "read_error"
	}
	gauge(supportDesc, boolFloat(reason == ""), reason)
	if g.Err != nil {
		return
	}
	// Memory figures are NVML's own and stay true in a foreign PID
	// namespace; under MIG or without v2 they would mislead.
	if g.Unsupported == "" || g.Unsupported == snapshot.UnsupportedForeignPIDNamespace {
		gauge(totalDesc, float64(g.Memory.Total))
		gauge(usedDesc, float64(g.Memory.Used))
		gauge(reservedDesc, float64(g.Memory.Reserved))
		gauge(freeDesc, float64(g.Memory.Free))
	}
	if !g.Accountable() {
		return
	}
	gauge(ownedLiveDesc, float64(g.OwnedLiveBytes))
	gauge(ownedDeadDesc, float64(g.OwnedDeadBytes))
	gauge(unattributedDesc, float64(g.UnattributedBytes))
	gauge(unownedDesc, float64(g.UnownedBytes))
	age := 0.0
	if !g.UnownedSince.IsZero() {
		age = taken.Sub(g.UnownedSince).Seconds()
	}
	gauge(ageDesc, age)
	gauge(suspectsDesc, float64(len(g.Suspects)))
	for _, o := range g.Owners {
		comm := ""
		if o.Process != nil {
			comm = o.Process.Comm
		}
		gauge(processDesc, float64(o.UsedBytes), strconv.Itoa(int(o.PID)), label(comm), strconv.FormatBool(o.Alive))
		if !o.Alive {
			var who snapshot.Identity
			if o.Identity != nil {
				who = *o.Identity
			}
			gauge(deadOwnerDesc, 1, strconv.Itoa(int(o.PID)), label(who.Comm), label(who.User), label(who.SlurmJob), label(who.PodUID), label(who.ContainerID))
		}
	}
	for _, h := range g.Suspects {
		gauge(holderDesc, 1, strconv.Itoa(h.PID), strconv.Itoa(h.PGID), strconv.Itoa(h.SID), strconv.Itoa(h.PPID),
			label(h.Comm), label(h.User), label(h.Container), label(h.Pod), h.Reason, label(h.Proof))
	}
}

// label is a label value that a process chose (its comm, the names in its
// cgroup, a proof that quotes them): its control characters are written
// as escapes (\x1b, \n), as `gpu-orphan ps` prints them, so that whoever
// reads /metrics in a terminal (curl, promtool) sees them for what they
// are, and a query or a dashboard shows one line.
func label(s string) string { return termsafe.Escape(s) }

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
