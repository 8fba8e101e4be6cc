package stack

import (
	"os"
	"strings"
	"testing"
	"time"
)

// TestShortenRules: the copy of the shipped rules differs in two lines of
// GPUOrphanMemory only, after its header.
func TestShortenRules(t *testing.T) {
	src, err := os.ReadFile("../../alerts/gpu-orphan.rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	out, err := ShortenRules(src, 3, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	want := strings.Split(strings.TrimSuffix(string(src), "\n"), "\n")
	const header = 4
	if !strings.HasPrefix(got[0], "# GENERATED TEST COPY") || !strings.HasSuffix(got[header-1], "Edit the shipped file.") {
		t.Fatalf("want a header of %d comment lines:\n%s", header, strings.Join(got[:header+1], "\n"))
	}
	got = got[header:]
	if len(got) != len(want) {
		t.Fatalf("%d lines, want %d", len(got), len(want))
	}
	var changed []string
	for i := range want {
		if got[i] != want[i] {
			changed = append(changed, strings.TrimSpace(want[i])+" => "+strings.TrimSpace(got[i]))
		}
	}
	if len(changed) != 2 ||
		!strings.Contains(changed[0], "gpu_orphan_unowned_memory_age_seconds > 3") ||
		!strings.HasPrefix(strings.SplitN(changed[1], " => ", 2)[1], "for: 2s  # shortened from 1m; the age threshold above from > 120") {
		t.Errorf("changed lines:\n%s", strings.Join(changed, "\n"))
	}
}

func TestShortenRulesFails(t *testing.T) {
	for name, src := range map[string]string{
		"no rule":  "groups:\n  - name: x\n    rules:\n      - alert: Other\n        expr: gpu_orphan_unowned_memory_age_seconds > 120\n        for: 1m\n",
		"no for":   "groups:\n  - name: x\n    rules:\n      - alert: GPUOrphanMemory\n        expr: gpu_orphan_unowned_memory_age_seconds > 120\n",
		"two ages": "groups:\n  - name: x\n    rules:\n      - alert: GPUOrphanMemory\n        expr: gpu_orphan_unowned_memory_age_seconds > 120 or gpu_orphan_unowned_memory_age_seconds > 5\n        for: 1m\n",
	} {
		if out, err := ShortenRules([]byte(src), 3, 2*time.Second); err == nil {
			t.Errorf("%s: no error:\n%s", name, out)
		}
	}
	// A later rule's `for:` is not GPUOrphanMemory's.
	src := "      - alert: GPUOrphanMemory\n        expr: gpu_orphan_unowned_memory_age_seconds > 120\n" +
		"      - alert: GPUOrphanMemoryCritical\n        expr: gpu_orphan_unowned_memory_age_seconds > 600\n        for: 5m\n"
	if out, err := ShortenRules([]byte(src), 3, 2*time.Second); err == nil {
		t.Errorf("another rule's for: was taken:\n%s", out)
	}
}
