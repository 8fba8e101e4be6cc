package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

// Faults make the simulated NVML fail, hang or leak, for tests of the code
// that must survive a broken or stuck driver. They live in DIR/faults.json,
// which Read re-reads every time, so tests can add and remove faults at
// runtime:
//
//	{"error": "GPU is lost", "gpu": -1, "delay": "2s"}
//	{"leaks": [{"gpu": 3, "mib": 40960}]}
type Faults struct {
	// Error, when set, is the message of the error Read returns.
	Error string
	// GPU is the index of the GPU whose Reading.Err carries Error, or
	// AllGPUs to fail the whole Read. In the file, leaving gpu out means
	// AllGPUs; in Go, the zero value means GPU 0.
	GPU int
	// Delay is how long every Read hangs before it answers.
	Delay time.Duration
	// Leaks are memory that the driver keeps used with no process holding
	// it, as a driver-level leak does: NVML counts it in the GPU's used
	// memory, lists no process for it, and no descriptor that any process
	// could close gives it back. Only a GPU reset would.
	Leaks []Leak
}

// Leak is memory that one GPU keeps used with no process holding it.
type Leak struct {
	GPU   int
	Bytes uint64
}

// MaxLeakBytes bounds one leak: it must fit on a GPU.
const MaxLeakBytes = TotalBytes - ReservedBytes

// AllGPUs as Faults.GPU makes the whole Read fail.
const AllGPUs = -1

// faultsJSON is the file's form: delay is written as "2s".
type faultsJSON struct {
	Error string `json:"error,omitempty"`
	GPU   *int   `json:"gpu,omitempty"`
	Delay string `json:"delay,omitempty"`
	// Leaks are in MiB, as people read them.
	Leaks []leakJSON `json:"leaks,omitempty"`
}

type leakJSON struct {
	GPU *int   `json:"gpu"`
	MiB uint64 `json:"mib"`
}

// WriteFaults installs faults on the node under root.
func WriteFaults(root string, f Faults) error {
	if f.GPU < -1 {
		return fmt.Errorf("sim: fault GPU %d: want -1 or an index", f.GPU)
	}
	if f.Delay < 0 {
		return fmt.Errorf("sim: negative fault delay %v", f.Delay)
	}
	fj := faultsJSON{Error: f.Error, GPU: &f.GPU}
	if f.Delay > 0 {
		fj.Delay = f.Delay.String()
	}
	for _, l := range f.Leaks {
		if err := l.check(); err != nil {
			return fmt.Errorf("sim: %w", err)
		}
		if l.Bytes%gpu.MiB != 0 {
			return fmt.Errorf("sim: leak of %d bytes on GPU %d: want whole MiB", l.Bytes, l.GPU)
		}
		g := l.GPU
		fj.Leaks = append(fj.Leaks, leakJSON{GPU: &g, MiB: l.Bytes / gpu.MiB})
	}
	data, err := json.Marshal(fj)
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return writeFileAtomic(filepath.Join(root, faultsFile), append(data, '\n'))
}

// ClearFaults removes the node's faults; it is not an error if there are none.
func ClearFaults(root string) error {
	err := os.Remove(filepath.Join(root, faultsFile))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("sim: %w", err)
	}
	return nil
}

// readFaults returns no faults when the file is missing.
func readFaults(root string) (Faults, error) {
	data, err := os.ReadFile(filepath.Join(root, faultsFile))
	if errors.Is(err, os.ErrNotExist) {
		return Faults{GPU: AllGPUs}, nil
	}
	if err != nil {
		return Faults{}, fmt.Errorf("sim: %w", err)
	}
	f, err := parseFaults(data)
	if err != nil {
		return Faults{}, fmt.Errorf("sim: %s: %w", faultsFile, err)
	}
	return f, nil
}

func parseFaults(data []byte) (Faults, error) {
	var fj faultsJSON
	if err := decodeStrict(data, &fj, "error", "gpu", "delay", "leaks", "mib"); err != nil {
		return Faults{}, err
	}
	f := Faults{Error: fj.Error, GPU: AllGPUs}
	if fj.GPU != nil {
		if *fj.GPU < -1 {
			return Faults{}, fmt.Errorf("gpu %d: want -1 or an index", *fj.GPU)
		}
		f.GPU = *fj.GPU
	}
	if fj.Delay != "" {
		d, err := time.ParseDuration(fj.Delay)
		if err != nil {
			return Faults{}, fmt.Errorf("delay: %w", err)
		}
		if d < 0 {
			return Faults{}, fmt.Errorf("negative delay %v", d)
		}
		f.Delay = d
	}
	for i, lj := range fj.Leaks {
		if lj.GPU == nil {
			return Faults{}, fmt.Errorf("leaks[%d]: no gpu", i)
		}
		l := Leak{GPU: *lj.GPU, Bytes: lj.MiB * gpu.MiB}
		if lj.MiB > MaxLeakBytes/gpu.MiB {
			l.Bytes = MaxLeakBytes + 1 // refused below, without overflowing
		}
		if err := l.check(); err != nil {
			return Faults{}, fmt.Errorf("leaks[%d]: %w", i, err)
		}
		f.Leaks = append(f.Leaks, l)
	}
	return f, nil
}

func (l Leak) check() error {
	switch {
	case l.GPU < 0:
		return fmt.Errorf("leak on GPU %d: want an index", l.GPU)
	case l.Bytes == 0:
		return fmt.Errorf("leak of 0 bytes on GPU %d", l.GPU)
	case l.Bytes > MaxLeakBytes:
		return fmt.Errorf("leak of %d MiB on GPU %d: more than a GPU holds (%d MiB)", l.Bytes/gpu.MiB, l.GPU, MaxLeakBytes/gpu.MiB)
	}
	return nil
}

// leaked is what f's leaks keep used on GPU index.
func (f Faults) leaked(index int) uint64 {
	var b uint64
	for _, l := range f.Leaks {
		if l.GPU == index {
			b += l.Bytes
		}
	}
	return b
}
