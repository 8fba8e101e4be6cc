package forks

import "github.com/prometheus/client_golang/prometheus"

var (
	upDesc = prometheus.NewDesc("gpu_orphan_process_events_up",
		"1 when the kernel's process events feed the fork record (descent at fork is proven); 0 when they are unavailable, and inheritors of a dead owner are reported but never signalled.", nil, nil)
	lostDesc = prometheus.NewDesc("gpu_orphan_process_events_lost_total",
		"Times the kernel dropped process events (the socket's buffer overflowed), each followed by a resync of the fork record from /proc.", nil, nil)
	appliedDesc = prometheus.NewDesc("gpu_orphan_process_events_applied_timestamp_seconds",
		"When the kernel sent the last process event that the fork record applied (Unix time): every fork, exec and exit before it is in the record. Not exported before the first event.", nil, nil)
	processesDesc = prometheus.NewDesc("gpu_orphan_fork_record_processes",
		"Processes in the fork record: the live ones, and the dead that a live one descends from.", nil, nil)
)

// Collector exports a record's status. rec may be nil when the events are
// unavailable.
type Collector struct {
	Record *Record
	Status *Status
}

func (c Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- upDesc
	ch <- lostDesc
	ch <- appliedDesc
	ch <- processesDesc
}

func (c Collector) Collect(ch chan<- prometheus.Metric) {
	up := 0.0
	if c.Status.Up() {
		up = 1
	}
	ch <- prometheus.MustNewConstMetric(upDesc, prometheus.GaugeValue, up)
	ch <- prometheus.MustNewConstMetric(lostDesc, prometheus.CounterValue, float64(c.Status.Lost()))
	if at := c.Status.Applied(); !at.IsZero() && c.Status.Up() {
		ch <- prometheus.MustNewConstMetric(appliedDesc, prometheus.GaugeValue, float64(at.UnixNano())/1e9)
	}
	n := 0
	if c.Record != nil && c.Status.Up() {
		n = c.Record.Counts().Entries
	}
	ch <- prometheus.MustNewConstMetric(processesDesc, prometheus.GaugeValue, float64(n))
}
