package testenv

import (
	"bytes"
	"io"
	"os/exec"
	"strings"
	"testing"
)

// TestFilterJobNotices: bash's notices of jobs that SIGKILL (or SIGTERM,
// which this bash does not report) ended are dropped from a script's standard error, and nothing else: the
// script's own lines, and other deaths (a crash is news).
func TestFilterJobNotices(t *testing.T) {
	script := `echo before >&2
sleep 100 & kill -KILL $!; wait
sleep 100 & kill -TERM $!; wait
sleep 100 & kill -SEGV $!; wait
sleep 100 & kill -KILL $!; sleep 0.2; echo after >&2`
	var raw bytes.Buffer
	cmd := exec.Command("bash", "-c", script)
	cmd.Stderr = &raw
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(raw.String(), "Killed"); n != 2 {
		t.Fatalf("bash wrote no notices to filter (a new bash?):\n%s", raw.String())
	}
	var out bytes.Buffer
	filterJobNotices(io.NopCloser(&raw), &out)
	got := out.String()
	if strings.Contains(got, "Killed") || strings.Contains(got, "Terminated") {
		t.Errorf("notices left:\n%s", got)
	}
	if !strings.HasPrefix(got, "before\n") || !strings.HasSuffix(got, "after\n") || !strings.Contains(got, "Segmentation fault") {
		t.Errorf("the script's lines or the crash's notice are gone:\n%s", got)
	}
}
