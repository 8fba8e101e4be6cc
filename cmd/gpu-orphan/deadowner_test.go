package main

import (
	"strings"
	"testing"
)

func TestParseDeadOwners(t *testing.T) {
	t.Parallel()
	const scrape = `# HELP gpu_orphan_dead_owner_info A dead owner.
# TYPE gpu_orphan_dead_owner_info gauge
gpu_orphan_dead_owner_info{comm="python3",container_id="",gpu="1",pid="463",pod_uid="",slurm_job="81234",user="alice",uuid="GPU-a"} 1
gpu_orphan_dead_owner_info{comm="",container_id="",gpu="0",pid="77",pod_uid="",slurm_job="",user="",uuid="GPU-b"} 1
gpu_orphan_dead_owner_info{comm="x",gpu="0",pid="not-a-pid",uuid="GPU-b"} 1
# HELP gpu_orphan_suspect_holders Suspects.
# TYPE gpu_orphan_suspect_holders gauge
gpu_orphan_suspect_holders{gpu="1",uuid="GPU-a"} 2
`
	got, _, err := parseExporter(strings.NewReader(scrape))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("got %d dead owners, want 2: %+v", len(got), got)
	}
	if d := got[deadOwnerKey{"GPU-a", 463}]; !d.Known || d.Comm != "python3" || d.User != "alice" || d.SlurmJob != "81234" {
		t.Errorf("GPU-a 463 = %+v", d)
	}
	if d := got[deadOwnerKey{"GPU-b", 77}]; d.Known || d.Unknown != "unknown (exporter started after the owner died)" {
		t.Errorf("GPU-b 77 = %+v, want unknown", d)
	}
	if describeDeadOwner(463, &ReportDeadOwner{Known: true, Comm: "python3", User: "alice", SlurmJob: "81234"}) != "PID 463: python3, user alice, Slurm job 81234" {
		t.Error("table line")
	}
	if _, _, err := parseExporter(strings.NewReader("not { metrics")); err == nil {
		t.Error("garbage parsed")
	}
}
