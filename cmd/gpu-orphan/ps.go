package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/termsafe"
)

func runPS(logger *slog.Logger, backend *cli.Backend, output, exporterURL, storePath string) int {
	node, err := backend.Open(logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %s\n", esc(err.Error()))
		return 1
	}
	defer node.Driver.Close()
	// The same verdicts as the node agent's: its record of descent.
	mem := snapshot.NewLineage()
	proofSource := readAgentLineage(context.Background(), mem, node.Proc, storePath, logger)
	s := node.Taker.TakeWith(context.Background(), true, mem)
	r := NewReport(s, node.Driver.DevicePath)
	r.ProofSource = proofSource
	nameDeadOwners(context.Background(), &r, exporterURL)
	switch output {
	case "json":
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(r); err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
			return 1
		}
		// The JSON carries the count; a person reading the terminal
		// still gets the warning, on stderr.
		if r.FDScanUnreadableProcesses > 0 {
			fmt.Fprintln(os.Stderr, unreadableWarning(r.FDScanUnreadableProcesses))
		}
	default:
		writeTable(os.Stdout, r)
	}
	// An incomplete scan fails the fdscan source; the count is checked
	// as well, so that "no suspect holders" is never an exit 0 unproven.
	if !s.Healthy() || r.FDScanUnreadableProcesses > 0 {
		return 1
	}
	return 0
}

// unreadableWarning says why the holders shown may be incomplete.
func unreadableWarning(n int) string {
	return fmt.Sprintf("WARNING: the descriptors of %d processes could not be read (run as root, or with CAP_SYS_PTRACE): holders may be missing, so 'no suspect holders' is not proven.", n)
}

func writeTable(w io.Writer, r Report) {
	for _, src := range r.Sources {
		if src.Error != "" {
			fmt.Fprintf(w, "ERROR: source %s failed: %s\n", esc(src.Name), esc(src.Error))
		}
	}
	unreadable := r.FDScanUnreadableProcesses
	if unreadable > 0 {
		fmt.Fprintln(w, unreadableWarning(unreadable))
	}
	if !r.HostPIDsVisible && len(r.GPUs) > 0 {
		fmt.Fprintln(w, "WARNING: the driver's PIDs are not visible in this PID namespace; nothing is called orphaned (run on the host, or with --path.procfs pointing at the host's /proc).")
	}
	for i, g := range r.GPUs {
		if i > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "GPU %d  %s  %s", g.Index, esc(g.Name), esc(g.UUID))
		if g.MIGInstance != "" {
			fmt.Fprintf(w, "  MIG %s", esc(g.MIGInstance))
		}
		fmt.Fprintf(w, "  (%s)\n", esc(g.DevicePath))
		if g.Error != "" {
			fmt.Fprintf(w, "  cannot read: %s\n", esc(g.Error))
			continue
		}
		if g.Unsupported != "" {
			fmt.Fprintf(w, "  accounting unsupported (%s): numbers withheld\n", esc(g.Unsupported))
			continue
		}
		fmt.Fprintf(w, "  used %s   owned by live processes %s   owned by dead PIDs %s   unattributed %s   NO LIVE OWNER %s\n",
			mib(g.UsedBytes), mib(g.OwnedLiveBytes), mib(g.OwnedDeadBytes), mib(g.UnattributedBytes), mib(g.UnownedBytes))
		if len(g.Owners) > 0 {
			var owners []string
			for _, o := range g.Owners {
				owners = append(owners, fmt.Sprintf("%d %s (%s)", o.PID, mib(o.UsedBytes), esc(ownerState(o))))
			}
			fmt.Fprintf(w, "  NVML lists: %s\n", strings.Join(owners, ", "))
			for _, o := range g.Owners {
				if o.DeadOwner != nil {
					fmt.Fprintf(w, "  left by %s\n", esc(describeDeadOwner(o.PID, o.DeadOwner)))
				}
			}
		}
		if unreadable > 0 {
			fmt.Fprintf(w, "  WARNING: holders may be missing: the descriptors of %d processes could not be read.\n", unreadable)
		}
		if len(g.Suspects) == 0 {
			if unreadable > 0 {
				fmt.Fprintf(w, "  no suspect holders found, NOT PROVEN (%d readable processes hold the device)\n", len(g.HolderPIDs))
			} else {
				fmt.Fprintf(w, "  no suspect holders (%d processes hold the device)\n", len(g.HolderPIDs))
			}
			continue
		}
		fmt.Fprintln(w, "  suspect holders:")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  PID\tPPID\tPGID\tSID\tUSER\tCOMMAND\tCONTAINER/POD\tREASON\tPROOF")
		for _, h := range g.Suspects {
			where := h.Container
			if h.Pod != "" {
				where = "pod " + h.Pod
			}
			if where == "" {
				where = "-"
			}
			fmt.Fprintf(tw, "  %d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\n", h.PID, h.PPID, h.PGID, h.SID, esc(h.User), truncate(esc(h.Command), 40),
				esc(where), esc(h.Reason), esc(proofText(h)))
		}
		tw.Flush()
		if slices.ContainsFunc(g.Suspects, func(h ReportHolder) bool { return h.Reason == snapshot.ReasonUnexplained }) {
			fmt.Fprintln(w, "  unexplained holders map the GPU, but nothing the kernel records ties them to a dead owner: they are never")
			fmt.Fprintln(w, "  signalled for one. Look at them: what they run, who started them (docs/safety.md, \"When an orphan is missed\").")
			if r.ProofSource != "" {
				fmt.Fprintf(w, "  %s\n", esc(r.ProofSource))
			}
		}
	}
	if len(r.FDScanShieldedPIDs) > 0 {
		pids := "PIDs"
		if len(r.FDScanShieldedPIDs) == 1 {
			pids = "PID"
		}
		fmt.Fprintf(w, "\nnote: a security policy hides the descriptors of %s %s even from CAP_SYS_PTRACE; they were not scanned.\n",
			pids, strings.Trim(fmt.Sprint(r.FDScanShieldedPIDs), "[]"))
	}
	fmt.Fprintf(w, "\n(%s, %s)\n", esc(r.Driver), r.Taken.Format(time.RFC3339))
}

// esc escapes the control characters of a field printed to a terminal: a
// process can name itself with escape sequences that rewrite what the
// table says (its own row read "no suspect holders"). Every string that
// /proc, NVML, the exporter or an error brought in goes through it; JSON
// output is escaped by its encoder.
func esc(s string) string { return termsafe.Escape(s) }

// ownerState says whether a listed PID is its memory's live owner. A live
// process under a dead owner's PID is named, and is not the owner.
func ownerState(o ReportOwner) string {
	if !o.Alive {
		if o.ReusedBy != nil {
			return fmt.Sprintf("DEAD: PID now belongs to %d %s, which holds no descriptor of this GPU", o.ReusedBy.PID, o.ReusedBy.Comm)
		}
		return "DEAD"
	}
	state := "alive"
	if o.LeaderExited {
		state += ", main thread exited"
	}
	if o.Unverified {
		state += ", unverified: its descriptors could not be read"
	}
	return state
}

// proofText says what proves an inheritor, or why nothing does.
func proofText(h ReportHolder) string {
	switch {
	case h.Proof == "":
		return "-"
	case h.DeadOwner != 0:
		return fmt.Sprintf("%s %d", h.Proof, h.DeadOwner)
	}
	return h.Proof
}

func mib(b uint64) string { return fmt.Sprintf("%d MiB", b>>20) }

// truncate cuts s to n characters, the last an ellipsis; never inside a
// character.
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}
