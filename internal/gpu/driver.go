// Package gpu hides NVML behind a small interface, so that the accounting in
// package snapshot runs the same on real hardware and on the simulated node.
package gpu

import (
	"context"
	"errors"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Device identifies one GPU the way NVML names it.
type Device struct {
	Index int
	UUID  string
	Name  string
	// MIGInstance is set, as "GI/CI", when this reading is one MIG instance
	// of the physical GPU Index; UUID is then the instance's own UUID.
	MIGInstance string
	// Minor is NVML's DeviceGetMinorNumber: the GPU's device node is
	// /dev/nvidia<Minor> (or its simulated equivalent).
	Minor int
}

// Memory is NVML's memory info v2, in bytes. v1 counts the driver's
// reservation in Used; v2 does not (docs/facts.md).
type Memory struct {
	Total    uint64
	Reserved uint64
	Used     uint64
	Free     uint64
}

// Process is one entry of NVML's compute, graphics or MPS process lists,
// merged by PID.
type Process struct {
	PID uint32
	// UsedBytes is NVML's usedGpuMemory; zero when NVML could not tell.
	UsedBytes uint64
}

// Reading is what one GPU reported at one moment.
type Reading struct {
	Device    Device
	Memory    Memory
	Processes []Process
	// Unsupported, when set, says why this GPU's accounting cannot be trusted
	// (for example "mig"); Memory and Processes must then not be published.
	Unsupported string
	// Err is set when reading this GPU failed; the other GPUs still count.
	Err error
}

// Driver reads every GPU of the node.
type Driver interface {
	// Name is "nvml" or "sim"; it labels the source in metrics and logs.
	Name() string
	// Read returns one Reading per GPU. A non-nil error means no GPU could
	// be read at all (the driver is gone, or ctx expired).
	Read(ctx context.Context) ([]Reading, error)
	// DevicePath is the device node that holders of the GPU with this minor
	// number keep open: /dev/nvidia<minor> on real hardware. It is for
	// people to read; holders are matched by DeviceNode.
	DevicePath(minor int) string
	// DeviceNode is the kernel's name of that device node: character
	// device 195:<minor> on real hardware, whatever path shows it.
	DeviceNode(minor int) (proc.Device, error)
	// PIDNamespace is the PID namespace that Read's PIDs belong to, written
	// as readlink(/proc/PID/ns/pid) prints it. NVML reports host PIDs.
	PIDNamespace() string
	Close() error
}

// InitPIDNamespace is the kernel's fixed name of the initial (host) PID
// namespace (PROC_PID_INIT_INO).
const InitPIDNamespace = "pid:[4026531836]"

// ErrUnavailable is returned when the driver cannot be loaded at all.
var ErrUnavailable = errors.New("GPU driver unavailable")

// MiB is one mebibyte in bytes.
const MiB = 1 << 20
