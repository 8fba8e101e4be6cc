package main

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func TestDispatcherArgs(t *testing.T) {
	for _, tc := range []struct {
		args, want []string
		ok         bool
	}{
		{[]string{"--backend=sim"}, []string{"--backend=sim"}, false},
		{[]string{"--role=node", "--act"}, []string{"--role=node", "--act"}, false},
		{[]string{"--role=dispatcher", "--dispatch.window=1h"}, []string{"--dispatch.window=1h"}, true},
		{[]string{"--store.path=/d.db", "--role", "dispatcher", "--log.level=debug"}, []string{"--store.path=/d.db", "--log.level=debug"}, true},
		{[]string{"--act", "--", "--role=dispatcher"}, []string{"--act", "--", "--role=dispatcher"}, false},
	} {
		got, ok := dispatcherArgs(tc.args)
		if ok != tc.ok || !slices.Equal(got, tc.want) {
			t.Errorf("dispatcherArgs(%q) = %q, %t; want %q, %t", tc.args, got, ok, tc.want, tc.ok)
		}
	}
}

// TestDeprecatedRoleDispatcher: gpu-orphan-remediator --role=dispatcher,
// for one release, says it is deprecated and becomes gpu-orphan-dispatcher
// (found beside it), same process, same arguments minus --role; the
// --dispatch.* flags it no longer declares pass through.
func TestDeprecatedRoleDispatcher(t *testing.T) {
	remediator := testenv.Bin(t, "gpu-orphan-remediator")
	testenv.Bin(t, "gpu-orphan-dispatcher") // built beside it
	targets := filepath.Join(t.TempDir(), "targets.json")
	if err := os.WriteFile(targets, []byte(`{"gpu-a": "http://127.0.0.1:1"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	var log bytes.Buffer
	cmd := exec.Command(remediator, "--role=dispatcher", "--web.listen-address="+addr, "--auth.insecure-none",
		"--dispatch.targets-file="+targets, "--dispatch.max-nodes=2", "--store.path="+filepath.Join(t.TempDir(), "d.db"))
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	testenv.Eventually(t, 30*time.Second, "the dispatcher to serve", func() bool {
		resp, err := http.Get("http://" + addr + "/api/v1/status")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return err == nil && resp.StatusCode == http.StatusOK && strings.Contains(string(b), `"dispatcher"`)
	})
	exe, err := os.Readlink("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/exe")
	if err != nil || filepath.Base(exe) != "gpu-orphan-dispatcher" {
		t.Errorf("the process runs %q (%v), want gpu-orphan-dispatcher", exe, err)
	}
	cmd.Process.Signal(os.Interrupt)
	cmd.Wait()
	for _, says := range []string{"level=WARN", "--role=dispatcher is deprecated", "gpu-orphan-dispatcher"} {
		if !strings.Contains(log.String(), says) {
			t.Errorf("the log does not say %q:\n%s", says, log.String())
		}
	}
}

// TestDeprecatedRoleDispatcherMissing: without gpu-orphan-dispatcher beside
// it or in PATH, --role=dispatcher exits 1 and says what is missing.
func TestDeprecatedRoleDispatcherMissing(t *testing.T) {
	alone := filepath.Join(t.TempDir(), "gpu-orphan-remediator")
	testenv.CopyExecutable(t, testenv.Bin(t, "gpu-orphan-remediator"), alone, 0o755)
	cmd := exec.Command(alone, "--role=dispatcher", "--dispatch.targets-file=/nonexistent")
	cmd.Env = append(os.Environ(), "PATH="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 1 {
		t.Fatalf("exit: %v, want status 1\n%s", err, out)
	}
	for _, says := range []string{"deprecated", "gpu-orphan-dispatcher is neither beside this executable nor in PATH"} {
		if !strings.Contains(string(out), says) {
			t.Errorf("the message does not say %q:\n%s", says, out)
		}
	}
}
