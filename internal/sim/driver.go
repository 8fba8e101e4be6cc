package sim

import (
	"context"
	"errors"
	"sort"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Driver reads a simulated node the way the NVML driver reads real GPUs.
type Driver struct {
	node *Node
}

var _ gpu.Driver = (*Driver)(nil)

// NewDriver loads the node under root. The GPU list is read once, as NVML
// enumerates devices once; contexts and faults are read on every Read.
func NewDriver(root string) (*Driver, error) {
	n, err := Load(root)
	if err != nil {
		return nil, err
	}
	return &Driver{node: n}, nil
}

// Name implements gpu.Driver.
func (d *Driver) Name() string { return "sim" }

// DevicePath implements gpu.Driver: the absolute path of the simulated
// /dev/nvidia<minor>.
func (d *Driver) DevicePath(minor int) string { return d.node.DevicePath(minor) }

// DeviceNode implements gpu.Driver: the identity (device and inode) of the
// simulated node, a regular file. A file bind-mounted over its path, or a
// link to it under another name, is told apart as a real device number is.
func (d *Driver) DeviceNode(minor int) (proc.Device, error) {
	return proc.StatDevice(d.node.DevicePath(minor))
}

// PIDNamespace implements gpu.Driver.
func (d *Driver) PIDNamespace() string { return d.node.PIDNamespace }

// Node returns the node the driver reads.
func (d *Driver) Node() *Node { return d.node }

// Close implements gpu.Driver; the simulator holds nothing open.
func (d *Driver) Close() error { return nil }

// Read implements gpu.Driver.
func (d *Driver) Read(ctx context.Context) ([]gpu.Reading, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	f, err := readFaults(d.node.Root)
	if err != nil {
		return nil, err
	}
	if f.Delay > 0 {
		t := time.NewTimer(f.Delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
	// The fault's message exactly, so tests can match it.
	var faultErr error
	if f.Error != "" {
		faultErr = errors.New(f.Error)
		if f.GPU == AllGPUs {
			return nil, faultErr
		}
	}
	ctxs, err := listContexts(d.node)
	if err != nil {
		return nil, err
	}
	out := make([]gpu.Reading, 0, len(d.node.GPUs))
	for _, g := range d.node.GPUs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if faultErr != nil && f.GPU == g.Index {
			out = append(out, gpu.Reading{Device: device(g), Err: faultErr})
			continue
		}
		out = append(out, reading(g, ctxs, f.leaked(g.Index)))
	}
	return out, nil
}

func device(g GPU) gpu.Device {
	return gpu.Device{Index: g.Index, UUID: g.UUID, Name: g.Name, Minor: g.Minor}
}

// reading is NVML's view of one GPU given the node's live contexts: each
// context costs its allocation plus an overhead charged to no process, and
// is listed under its creator's PID for as long as it lives, even after the
// creator is gone (docs/facts.md). leaked bytes are used and charged to no
// process (Faults.Leaks).
func reading(g GPU, ctxs []Context, leaked uint64) gpu.Reading {
	r := gpu.Reading{Device: device(g)}
	if g.MIG {
		r.Unsupported = "mig"
		return r
	}
	used := leaked
	byPID := map[int]uint64{}
	for _, c := range ctxs {
		if c.GPU != g.Index {
			continue
		}
		used += c.UsedBytes + ContextOverheadBytes
		byPID[c.PID] += c.UsedBytes
	}
	r.Memory = gpu.Memory{Total: g.TotalBytes, Reserved: g.ReservedBytes, Used: used}
	if avail := g.TotalBytes - g.ReservedBytes; used < avail {
		r.Memory.Free = avail - used
	}
	r.Processes = make([]gpu.Process, 0, len(byPID))
	for pid, b := range byPID {
		r.Processes = append(r.Processes, gpu.Process{PID: uint32(pid), UsedBytes: b})
	}
	sort.Slice(r.Processes, func(i, j int) bool { return r.Processes[i].PID < r.Processes[j].PID })
	return r
}
