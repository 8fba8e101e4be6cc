package main

import (
	"context"
	"fmt"
	"io"
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

// deadOwners reads gpu_orphan_dead_owner_info from the exporter at url. An
// error says the exporter could not be asked.
func deadOwners(ctx context.Context, url string) (map[deadOwnerKey]ReportDeadOwner, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s answered %s", url, resp.Status)
	}
	return parseDeadOwners(io.LimitReader(resp.Body, 64<<20))
}

func parseDeadOwners(r io.Reader) (map[deadOwnerKey]ReportDeadOwner, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("parsing the exporter's metrics: %w", err)
	}
	out := map[deadOwnerKey]ReportDeadOwner{}
	mf := mfs["gpu_orphan_dead_owner_info"]
	if mf == nil {
		return out, nil
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
	return out, nil
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
	var askErr error
	if url != "" {
		known, askErr = deadOwners(ctx, url)
	}
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
				d = ReportDeadOwner{Unknown: fmt.Sprintf("unknown (no exporter to ask: %v)", askErr)}
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
