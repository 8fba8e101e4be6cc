// Package sim is a simulated GPU node: a stand-in for NVML on machines
// without a GPU that keeps NVML's measured accounting (docs/facts.md), including
// memory that outlives its creator while a forked child holds the context.
//
// A node is a directory:
//
//	DIR/node.json        the GPUs and the PID namespace of their PIDs
//	DIR/dev/nvidia<N>    one device node per GPU; workloads keep it open
//	DIR/contexts/*.json  one file per CUDA context, alive while flock'ed
//	DIR/faults.json      optional; makes Read fail or hang (faults.go)
package sim

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

// Sizes of one simulated NVIDIA H200, as NVML reports them (docs/facts.md).
const (
	TotalBytes    = 143771 * gpu.MiB
	ReservedBytes = 615 * gpu.MiB
	// ContextOverheadBytes is what each live context adds to Used without
	// being charged to any process.
	ContextOverheadBytes = 8 * gpu.MiB
	// MaxGPUs bounds the size of a node.
	MaxGPUs = 64
	// GPUName is the product name of every simulated GPU.
	GPUName = "NVIDIA H200 (simulated)"
)

const (
	nodeFile     = "node.json"
	devDir       = "dev"
	contextsDir  = "contexts"
	faultsFile   = "faults.json"
	allocLock    = "alloc.lock"
	maxNodeBytes = 1 << 20
)

// GPU is one simulated GPU as node.json describes it.
type GPU struct {
	Index         int    `json:"index"`
	UUID          string `json:"uuid"`
	Name          string `json:"name"`
	Minor         int    `json:"minor"`
	TotalBytes    uint64 `json:"total_bytes"`
	ReservedBytes uint64 `json:"reserved_bytes"`
	// MIG makes the driver report the GPU as Unsupported "mig", as the real
	// driver must for a GPU whose accounting is split into instances.
	MIG bool `json:"mig"`
}

// Node is a simulated node rooted at a directory.
type Node struct {
	// Root is the node's absolute directory; it is not stored in node.json.
	Root string `json:"-"`
	// PIDNamespace is where the workloads' PIDs live, as readlink prints it.
	PIDNamespace string `json:"pid_namespace"`
	GPUs         []GPU  `json:"gpus"`
}

// InitOptions configures InitWithOptions.
type InitOptions struct {
	GPUs int
	// Force replaces a node that root already holds. Workloads still running
	// on the old node keep their descriptors but lose their contexts.
	Force bool
}

// ErrNodeExists is returned by Init when root already holds a node.
var ErrNodeExists = errors.New("directory already holds a simulated node")

// Init creates a node of gpus GPUs under root, which may exist but must not
// hold a node yet.
func Init(root string, gpus int) error {
	return InitWithOptions(root, InitOptions{GPUs: gpus})
}

// InitWithOptions creates a node under root.
func InitWithOptions(root string, opts InitOptions) error {
	if opts.GPUs < 1 || opts.GPUs > MaxGPUs {
		return fmt.Errorf("sim: GPU count %d out of range 1..%d", opts.GPUs, MaxGPUs)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	if _, err := os.Lstat(filepath.Join(abs, nodeFile)); err == nil {
		if !opts.Force {
			return fmt.Errorf("sim: %s: %w (init --force replaces it)", abs, ErrNodeExists)
		}
		for _, p := range []string{nodeFile, devDir, contextsDir, faultsFile} {
			if err := os.RemoveAll(filepath.Join(abs, p)); err != nil {
				return fmt.Errorf("sim: removing old node: %w", err)
			}
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("sim: %w", err)
	}
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return fmt.Errorf("sim: reading own PID namespace: %w", err)
	}
	n := &Node{Root: abs, PIDNamespace: ns}
	for i := range opts.GPUs {
		n.GPUs = append(n.GPUs, GPU{
			Index:         i,
			UUID:          uuidFor(i),
			Name:          GPUName,
			Minor:         i,
			TotalBytes:    TotalBytes,
			ReservedBytes: ReservedBytes,
		})
	}
	for _, d := range []string{devDir, contextsDir} {
		if err := os.MkdirAll(filepath.Join(abs, d), 0o755); err != nil {
			return fmt.Errorf("sim: %w", err)
		}
	}
	nodes := []string{n.UVMPath()}
	for _, g := range n.GPUs {
		nodes = append(nodes, n.DevicePath(g.Minor))
	}
	for _, p := range nodes {
		f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o666)
		if err != nil {
			return fmt.Errorf("sim: creating device node: %w", err)
		}
		// One page, so that workloads can map it as CUDA maps the real one.
		err = f.Truncate(DeviceMapBytes)
		f.Close()
		if err != nil {
			return fmt.Errorf("sim: sizing device node: %w", err)
		}
	}
	// node.json last: its presence means the node is complete.
	return n.Save()
}

// uuidFor derives a stable UUID in NVML's format from the GPU index, so that
// re-initialised nodes name their GPUs the same way.
func uuidFor(index int) string {
	h := sha256.Sum256([]byte("gpu-orphan-sim/" + strconv.Itoa(index)))
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// Load reads the node under root. Root is made absolute and free of
// symlinks, so that DevicePath matches what /proc/PID/fd links show.
func Load(root string) (*Node, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		abs = real
	}
	f, err := os.Open(filepath.Join(abs, nodeFile))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("sim: %s holds no simulated node (run gpu-orphan-sim init): %w", abs, err)
		}
		return nil, fmt.Errorf("sim: %w", err)
	}
	defer f.Close()
	n, err := parseNode(io.LimitReader(f, maxNodeBytes+1))
	if err != nil {
		return nil, fmt.Errorf("sim: %s: %w", f.Name(), err)
	}
	n.Root = abs
	return n, nil
}

// parseNode decodes and checks node.json strictly: a typo in a hand-edited
// file must fail loudly instead of silently meaning "false" or "0".
func parseNode(r io.Reader) (*Node, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	if len(data) > maxNodeBytes {
		return nil, fmt.Errorf("larger than %d bytes", maxNodeBytes)
	}
	var n Node
	if err := decodeStrict(data, &n, "pid_namespace", "gpus", "index", "uuid", "name", "minor",
		"total_bytes", "reserved_bytes", "mig"); err != nil {
		return nil, err
	}
	if err := n.validate(); err != nil {
		return nil, err
	}
	return &n, nil
}

func (n *Node) validate() error {
	if n.PIDNamespace == "" {
		return errors.New("pid_namespace is empty")
	}
	if len(n.GPUs) < 1 || len(n.GPUs) > MaxGPUs {
		return fmt.Errorf("%d GPUs, want 1..%d", len(n.GPUs), MaxGPUs)
	}
	uuids := map[string]bool{}
	minors := map[int]bool{}
	for i, g := range n.GPUs {
		switch {
		case g.Index != i:
			return fmt.Errorf("gpus[%d] has index %d; indexes must be 0, 1, ... in order", i, g.Index)
		case g.UUID == "":
			return fmt.Errorf("GPU %d has no uuid", i)
		case uuids[g.UUID]:
			return fmt.Errorf("GPU %d repeats uuid %q", i, g.UUID)
		case g.Minor < 0:
			return fmt.Errorf("GPU %d has negative minor %d", i, g.Minor)
		case minors[g.Minor]:
			return fmt.Errorf("GPU %d repeats minor %d", i, g.Minor)
		case g.TotalBytes == 0:
			return fmt.Errorf("GPU %d has total_bytes 0", i)
		case g.ReservedBytes > g.TotalBytes:
			return fmt.Errorf("GPU %d reserves %d bytes of %d", i, g.ReservedBytes, g.TotalBytes)
		}
		uuids[g.UUID] = true
		minors[g.Minor] = true
	}
	return nil
}

// Save writes node.json atomically, so that a concurrent Load never sees
// half a file. Tests use it to flip MIG on.
func (n *Node) Save() error {
	if err := n.validate(); err != nil {
		return fmt.Errorf("sim: refusing to save node: %w", err)
	}
	data, err := json.MarshalIndent(n, "", "  ")
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return writeFileAtomic(filepath.Join(n.Root, nodeFile), append(data, '\n'))
}

// GPU returns the GPU with this index.
func (n *Node) GPU(index int) (GPU, error) {
	if index < 0 || index >= len(n.GPUs) {
		return GPU{}, fmt.Errorf("sim: no GPU %d (node has %d)", index, len(n.GPUs))
	}
	return n.GPUs[index], nil
}

// UVMPath is the simulated /dev/nvidia-uvm, which every workload (and each
// child it forks) holds, as CUDA processes do.
func (n *Node) UVMPath() string { return filepath.Join(n.Root, devDir, "nvidia-uvm") }

// DevicePath is the simulated /dev/nvidia<minor>.
func (n *Node) DevicePath(minor int) string {
	return filepath.Join(n.Root, devDir, "nvidia"+strconv.Itoa(minor))
}

func (n *Node) contextsDir() string { return filepath.Join(n.Root, contextsDir) }

func writeFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("sim: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return nil
}
