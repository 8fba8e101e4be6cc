package intake

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// testToken is a bearer token long enough for NewAuth.
const testToken = "abcdefghijklmnop0123456789"

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func newTestMetrics() *remediate.Metrics { return remediate.NewMetrics(prometheus.NewRegistry()) }

// writeFile writes content to a new file in a test directory.
func writeFile(t testing.TB, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// openStore opens a real store on a temporary file.
func openStore(t testing.TB) (*store.Store, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "store.db")
	s, err := store.Open(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, path
}

func queueDepth(t testing.TB, s *store.Store) int {
	t.Helper()
	n, err := s.QueueDepth(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// gpuClassifier accepts alerts for node-a's GPU 3 only, as the node role
// would on a node whose one known GPU is that one.
func gpuClassifier(labels map[string]string) (node, uuid, ignore string) {
	node, uuid = labels["node"], labels["uuid"]
	switch {
	case uuid == "":
		return node, uuid, "no uuid label"
	case node != "node-a":
		return node, uuid, "for another node"
	case uuid != "GPU-5f3a1c2e-0000-1111-2222-333344445555":
		return node, uuid, "uuid names no GPU of this node"
	}
	return node, uuid, ""
}
