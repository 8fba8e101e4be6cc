package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// defaultExporterURL is the node's own gpu-orphan-exporter, at its default
// --web.listen-address.
const defaultExporterURL = "http://127.0.0.1:10835/metrics"

// ReportDeadOwner is who a dead owner was, as the node's exporter saw it
// alive (gpu_orphan_dead_owner_info). ps itself starts after the death, so
// it asks the exporter, which remembers owners while they live.
type ReportDeadOwner struct {
	Known       bool   `json:"known"`
	Comm        string `json:"comm,omitempty"`
	User        string `json:"user,omitempty"`
	SlurmJob    string `json:"slurm_job,omitempty"`
	PodUID      string `json:"pod_uid,omitempty"`
	ContainerID string `json:"container_id,omitempty"`
	// Unknown says why not, when !Known.
	Unknown string `json:"unknown,omitempty"`
}

// deadOwnerKey is a dead owner as the metric labels it.
type deadOwnerKey struct {
	uuid string
	pid  uint32
}

// askTimeout bounds the question to the exporter.
const askTimeout = 3 * time.Second

// askExporter reads gpu_orphan_dead_owner_info and the holders' verdicts
// from the exporter at url. An error is one plain sentence for the table:
// why the exporter could not be asked, its cause in a few words, and what
// to do.
func askExporter(ctx context.Context, url string) (map[deadOwnerKey]ReportDeadOwner, map[deadOwnerKey]exporterVerdict, error) {
	ctx, cancel := context.WithTimeout(ctx, askTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err == nil && req.URL.Scheme != "http" && req.URL.Scheme != "https" {
		err = errors.New("it needs http:// or https://")
	}
	if err != nil {
		return nil, nil, fmt.Errorf("--exporter.url %q is not a URL (%s); give gpu-orphan-exporter's, such as %s", url, briefCause(err), defaultExporterURL)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, nil, fmt.Errorf("no exporter answers at %s (%s); start gpu-orphan-exporter, or pass --exporter.url", url, briefCause(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, nil, fmt.Errorf("%s answered %s, not metrics; pass gpu-orphan-exporter's metrics URL as --exporter.url", url, resp.Status)
	}
	owners, holders, err := parseExporter(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, nil, fmt.Errorf("%s serves no Prometheus metrics (%s); pass gpu-orphan-exporter's metrics URL as --exporter.url", url, briefCause(err))
	}
	return owners, holders, nil
}

// briefCause is err's root cause in a few words ("connection refused",
// "no such host"), without the layers that Go's HTTP client wraps around
// it (Get "URL": dial tcp ADDR: connect: ...).
func briefCause(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Sprintf("no answer within %s", askTimeout)
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return dns.Err + ": " + dns.Name
	}
	for {
		inner := errors.Unwrap(err)
		if inner == nil {
			return err.Error()
		}
		err = inner
	}
}

// exporterVerdict is what the exporter says of one suspect holder.
type exporterVerdict struct {
	reason, proof, pgid, ppid string
}

// parseHolders reads gpu_orphan_holder_info: the exporter's verdict on
// each suspect, by GPU and PID.
func parseHolders(mfs map[string]*dto.MetricFamily) map[deadOwnerKey]exporterVerdict {
	out := map[deadOwnerKey]exporterVerdict{}
	for _, m := range mfs["gpu_orphan_holder_info"].GetMetric() {
		l := labels(m)
		pid, err := strconv.ParseUint(l["pid"], 10, 32)
		if err != nil {
			continue
		}
		out[deadOwnerKey{l["uuid"], uint32(pid)}] = exporterVerdict{reason: l["reason"], proof: l["proof"], pgid: l["pgid"], ppid: l["ppid"]}
	}
	return out
}

// parseExporter reads the dead owners and the holders' verdicts.
func parseExporter(r io.Reader) (map[deadOwnerKey]ReportDeadOwner, map[deadOwnerKey]exporterVerdict, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(r)
	if err != nil {
		return nil, nil, fmt.Errorf("parsing the exporter's metrics: %w", err)
	}
	holders := parseHolders(mfs)
	out := map[deadOwnerKey]ReportDeadOwner{}
	mf := mfs["gpu_orphan_dead_owner_info"]
	if mf == nil {
		return out, holders, nil
	}
	for _, m := range mf.GetMetric() {
		l := labels(m)
		pid, err := strconv.ParseUint(l["pid"], 10, 32)
		if err != nil {
			continue
		}
		d := ReportDeadOwner{Comm: l["comm"], User: l["user"], SlurmJob: l["slurm_job"], PodUID: l["pod_uid"], ContainerID: l["container_id"]}
		d.Known = d.Comm != "" || d.User != ""
		if !d.Known {
			d.Unknown = "unknown (exporter started after the owner died)"
		}
		out[deadOwnerKey{l["uuid"], uint32(pid)}] = d
	}
	return out, holders, nil
}

func labels(m *dto.Metric) map[string]string {
	l := map[string]string{}
	for _, p := range m.GetLabel() {
		l[p.GetName()] = p.GetValue()
	}
	return l
}

// nameDeadOwners fills each dead owner of r with who it was, from the
// exporter at url; when it cannot be asked, each says why.
func nameDeadOwners(ctx context.Context, r *Report, url string) {
	var known map[deadOwnerKey]ReportDeadOwner
	var verdicts map[deadOwnerKey]exporterVerdict
	var askErr error
	if url != "" {
		known, verdicts, askErr = askExporter(ctx, url)
	}
	adoptVerdicts(r, verdicts)
	for i := range r.GPUs {
		g := &r.GPUs[i]
		for j := range g.Owners {
			o := &g.Owners[j]
			if o.Alive {
				continue
			}
			d, ok := known[deadOwnerKey{g.UUID, o.PID}]
			switch {
			case url == "":
				d = ReportDeadOwner{Unknown: "unknown (--exporter.url is empty)"}
			case askErr != nil:
				d = ReportDeadOwner{Unknown: "unknown: " + askErr.Error()}
			case !ok:
				d = ReportDeadOwner{Unknown: "unknown (the exporter does not list it yet)"}
			}
			o.DeadOwner = &d
		}
	}
}

// describeDeadOwner is one line for the table.
func describeDeadOwner(pid uint32, d *ReportDeadOwner) string {
	if d == nil {
		return ""
	}
	if !d.Known {
		return fmt.Sprintf("PID %d: %s", pid, d.Unknown)
	}
	return remediate.DeadOwner{PID: pid, Known: true, Comm: d.Comm, User: d.User, SlurmJob: d.SlurmJob,
		PodUID: d.PodUID, ContainerID: d.ContainerID}.Who()
}

// adoptVerdicts gives a holder that this command could not prove an
// inheritor the exporter's verdict, when the exporter, which followed the
// node's forks, proved it one: the same GPU, PID, group and parent. It is
// marked as the exporter's; ps shows it, and nothing acts on it.
func adoptVerdicts(r *Report, verdicts map[deadOwnerKey]exporterVerdict) {
	for i := range r.GPUs {
		g := &r.GPUs[i]
		for j := range g.Suspects {
			h := &g.Suspects[j]
			v, ok := verdicts[deadOwnerKey{g.UUID, uint32(h.PID)}]
			if !ok || h.Reason != snapshot.ReasonUnexplained || v.reason != snapshot.ReasonInheritedFromDeadOwner ||
				v.pgid != strconv.Itoa(h.PGID) || v.ppid != strconv.Itoa(h.PPID) {
				continue
			}
			h.Reason, h.Proof = v.reason, v.proof+" (exporter)"
		}
	}
}
