//go:build kubernetes

package kubernetes

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
)

// TestStartRefusedWithoutRBAC: the dispatcher binary, with the chart's
// flags and ServiceAccount, its Role short of one of its rules (and the
// authorizer has seen it): it exits with status 1 at start-up, long
// before its sync timeout and without serving, with an error that names
// the permission it needs and the namespace, and leaves no audit database
// behind, nor the directory made for it. Without list on EndpointSlices,
// discovery's first list is refused; without get on pods, the check of
// the agents' endpoints against their pods; without the Lease's verbs,
// the check of the fleet limit's shared window.
func TestStartRefusedWithoutRBAC(t *testing.T) {
	for _, tc := range []struct {
		resource string
		refused  authorizationv1.ResourceAttributes
		says     string
	}{
		{"endpointslices", authorizationv1.ResourceAttributes{Verb: "list", Group: "discovery.k8s.io", Resource: "endpointslices"},
			"is forbidden: the dispatcher's service account needs RBAC verbs list and watch on endpointslices (API group discovery.k8s.io) in namespace "},
		{"pods", authorizationv1.ResourceAttributes{Verb: "get", Resource: "pods"},
			"is forbidden: the dispatcher's service account needs RBAC verb get on pods and on daemonsets (API group apps) in namespace "},
		{"leases", authorizationv1.ResourceAttributes{Verb: "get", Group: "coordination.k8s.io", Resource: "leases", Name: "go-gpu-orphan-dispatcher"},
			"forbidden: the dispatcher's service account needs RBAC verbs get, create and update on leases (API group coordination.k8s.io) in namespace "},
	} {
		t.Run(tc.resource, func(t *testing.T) {
			cp := kubereal.Get(t)
			r, f := chartFleet(t, cp, "refused-"+tc.resource, dispatcherValues(false, true))
			// An agent: the start checks its endpoint against its pod.
			f.addAgent(t, "node-a", newAgent(t))
			r.setRoleRules(t, without(r.roleRules(t), tc.resource))
			refused := tc.refused
			refused.Namespace = r.namespace
			cp.WaitAccess(t, r.namespace, r.dispatcherName(), false, refused)

			storeDir := filepath.Join(t.TempDir(), "var")
			const syncTimeout = 10 * time.Minute
			cmd := dispatcherCommand(t, r, storeDir, append(r.kubernetesFlags(t), "--web.listen-address="+testenv.FreeAddr(t),
				"--dispatch.kubernetes.sync-timeout="+syncTimeout.String())...)
			began := time.Now()
			out, err := runToExit(t, cmd, syncTimeout/2)
			took := time.Since(began)
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Fatalf("exit: %v, want status 1\n%s", err, out)
			}
			if took > testenv.Scale(30*time.Second) {
				t.Errorf("failing took %s: a refusal must not wait for the sync timeout", took)
			}
			if !strings.Contains(out, tc.says+r.namespace) {
				t.Errorf("the output does not say %q:\n%s", tc.says+r.namespace, out)
			}
			// exporter-toolkit logs it when it serves.
			if strings.Contains(out, "Listening on") {
				t.Errorf("the dispatcher served before it failed:\n%s", out)
			}
			if _, err := os.Stat(storeDir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a failed start left %s behind (stat: %v)", storeDir, err)
			}
		})
	}
}

// runToExit runs cmd to its end, or kills it after limit, and returns its
// output, standard error included.
func runToExit(t *testing.T, cmd *exec.Cmd, limit time.Duration) (string, error) {
	t.Helper()
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return out.String(), err
	case <-time.After(limit):
		_ = cmd.Process.Kill()
		t.Fatalf("still running after %s (killed: %v):\n%s", limit, <-done, out.String())
		return "", nil
	}
}
