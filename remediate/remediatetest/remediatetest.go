// Package remediatetest holds what the tests of the dispatcher share that
// names the remediator's own types, in its packages and against a real
// kube-apiserver (test/kubernetes): internal/testenv may not
// (cmd/imports_test.go: internal/ is below remediate/). Only tests import
// it.
package remediatetest

import (
	"context"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// OpenStore opens an audit store in the test's temp dir, closed at its end.
func OpenStore(t testing.TB) *store.Store {
	t.Helper()
	st, err := store.Open(t.Context(), filepath.Join(t.TempDir(), "d.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// Executor forwards an action: dispatch.Dispatcher, which this package
// does not import (package dispatch's own tests use it).
type Executor interface {
	Execute(ctx context.Context, a remediate.Action) (remediate.Action, time.Duration)
}

// ForwardAndStore forwards an alert for node's GPU-1 and records the
// dispatcher's action, as the engine does; it fails the test unless the
// agent's reply names the action it made. It returns the action's ID.
func ForwardAndStore(t testing.TB, d Executor, st *store.Store, node, fingerprint string) string {
	t.Helper()
	a, _ := d.Execute(t.Context(), remediate.Action{Node: node, GPUUUID: "GPU-1", AlertFingerprint: fingerprint,
		AlertStartsAt: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), StartedAt: time.Now()})
	if a.State != remediate.StateSucceeded || a.Agent == nil || a.Agent.ActionID == "" {
		t.Fatalf("forwarding %s's alert: %s %s, agent %+v", node, a.State, a.Reason, a.Agent)
	}
	id, err := st.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// SignedFor reports whether an Authorization header is the dispatcher's
// signature for node, and does not carry the fleet's token.
func SignedFor(auth, node, token string) bool {
	scheme, cred, _ := strings.Cut(auth, " ")
	v, err := url.ParseQuery(cred)
	return scheme == intake.FleetScheme && err == nil && v.Get("node") == node && len(v.Get("sig")) == 64 &&
		!strings.Contains(auth, token)
}
