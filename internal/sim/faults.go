package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Faults make the simulated NVML fail or hang, for tests of the code that
// must survive a broken or stuck driver. They live in DIR/faults.json, which
// Read re-reads every time, so tests can add and remove faults at runtime:
//
//	{"error": "GPU is lost", "gpu": -1, "delay": "2s"}
type Faults struct {
	// Error, when set, is the message of the error Read returns.
	Error string
	// GPU is the index of the GPU whose Reading.Err carries Error, or
	// AllGPUs to fail the whole Read. In the file, leaving gpu out means
	// AllGPUs; in Go, the zero value means GPU 0.
	GPU int
	// Delay is how long every Read hangs before it answers.
	Delay time.Duration
}

// AllGPUs as Faults.GPU makes the whole Read fail.
const AllGPUs = -1

// faultsJSON is the file's form: delay is written as "2s".
type faultsJSON struct {
	Error string `json:"error,omitempty"`
	GPU   *int   `json:"gpu,omitempty"`
	Delay string `json:"delay,omitempty"`
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
	if err := decodeStrict(data, &fj, "error", "gpu", "delay"); err != nil {
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
	return f, nil
}
