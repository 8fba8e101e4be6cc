package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
)

func runPS(logger *slog.Logger, backend *cli.Backend, output string) int {
	node, err := backend.Open(logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
		return 1
	}
	defer node.Driver.Close()
	s := node.Taker.Take(context.Background(), true)
	switch output {
	case "json":
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(cli.NewReport(s, node.Driver.DevicePath)); err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
			return 1
		}
	default:
		writeTable(os.Stdout, cli.NewReport(s, node.Driver.DevicePath))
	}
	if !s.Healthy() {
		return 1
	}
	return 0
}

func writeTable(w io.Writer, r cli.Report) {
	for _, src := range r.Sources {
		if src.Error != "" {
			fmt.Fprintf(w, "ERROR: source %s failed: %s\n", src.Name, src.Error)
		}
	}
	if !r.HostPIDsVisible && len(r.GPUs) > 0 {
		fmt.Fprintln(w, "WARNING: the driver's PIDs are not visible in this PID namespace; nothing is called orphaned (run on the host, or with --path.procfs pointing at the host's /proc).")
	}
	for i, g := range r.GPUs {
		if i > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "GPU %d  %s  %s", g.Index, g.Name, g.UUID)
		if g.MIGInstance != "" {
			fmt.Fprintf(w, "  MIG %s", g.MIGInstance)
		}
		fmt.Fprintf(w, "  (%s)\n", g.DevicePath)
		if g.Error != "" {
			fmt.Fprintf(w, "  cannot read: %s\n", g.Error)
			continue
		}
		if g.Unsupported != "" {
			fmt.Fprintf(w, "  accounting unsupported (%s): numbers withheld\n", g.Unsupported)
			continue
		}
		fmt.Fprintf(w, "  used %s   owned by live processes %s   owned by dead PIDs %s   unattributed %s   NO LIVE OWNER %s\n",
			mib(g.UsedBytes), mib(g.OwnedLiveBytes), mib(g.OwnedDeadBytes), mib(g.UnattributedBytes), mib(g.UnownedBytes))
		if len(g.Owners) > 0 {
			var owners []string
			for _, o := range g.Owners {
				state := "alive"
				if !o.Alive {
					state = "DEAD"
				}
				owners = append(owners, fmt.Sprintf("%d %s (%s)", o.PID, mib(o.UsedBytes), state))
			}
			fmt.Fprintf(w, "  NVML lists: %s\n", strings.Join(owners, ", "))
		}
		if len(g.Suspects) == 0 {
			fmt.Fprintf(w, "  no suspect holders (%d processes hold the device)\n", len(g.HolderPIDs))
			continue
		}
		fmt.Fprintln(w, "  suspect holders:")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  PID\tPPID\tPGID\tSID\tUSER\tCOMMAND\tCONTAINER/POD\tREASON")
		for _, h := range g.Suspects {
			where := h.Container
			if h.Pod != "" {
				where = "pod " + h.Pod
			}
			if where == "" {
				where = "-"
			}
			fmt.Fprintf(tw, "  %d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\n", h.PID, h.PPID, h.PGID, h.SID, h.User, truncate(h.Command, 40), where, h.Reason)
		}
		tw.Flush()
	}
	fmt.Fprintf(w, "\n(%s, %s)\n", r.Driver, r.Taken.Format(time.RFC3339))
}

func mib(b uint64) string { return fmt.Sprintf("%d MiB", b>>20) }

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}
