package sim

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

var uuidRE = regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

func TestInit(t *testing.T) {
	root := newNode(t, 3)
	n, err := Load(root)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	if n.PIDNamespace != ns {
		t.Errorf("pid_namespace %q, want %q", n.PIDNamespace, ns)
	}
	if real, _ := filepath.EvalSymlinks(root); n.Root != real || len(n.GPUs) != 3 {
		t.Fatalf("root %q with %d GPUs, want %q with 3", n.Root, len(n.GPUs), root)
	}
	seen := map[string]bool{}
	for i, g := range n.GPUs {
		if g.Index != i || g.Minor != i || g.Name != GPUName || g.MIG ||
			g.TotalBytes != 143771*gpu.MiB || g.ReservedBytes != 615*gpu.MiB {
			t.Errorf("GPU %d: %+v", i, g)
		}
		if !uuidRE.MatchString(g.UUID) || seen[g.UUID] {
			t.Errorf("GPU %d: uuid %q not in NVML's form or repeated", i, g.UUID)
		}
		seen[g.UUID] = true
		fi, err := os.Stat(filepath.Join(root, "dev", "nvidia"+strconv.Itoa(i)))
		if err != nil || !fi.Mode().IsRegular() {
			t.Errorf("GPU %d device node: %v %v", i, fi, err)
		}
		if p := n.DevicePath(g.Minor); !filepath.IsAbs(p) {
			t.Errorf("device path %q not absolute", p)
		}
	}
	if fi, err := os.Stat(filepath.Join(root, "contexts")); err != nil || !fi.IsDir() {
		t.Errorf("contexts: %v", err)
	}

	// UUIDs are stable across nodes.
	other, err := Load(newNode(t, 2))
	if err != nil {
		t.Fatal(err)
	}
	for i := range other.GPUs {
		if other.GPUs[i].UUID != n.GPUs[i].UUID {
			t.Errorf("GPU %d: uuid %q on one node, %q on another", i, n.GPUs[i].UUID, other.GPUs[i].UUID)
		}
	}

	if err := Init(root, 2); !errors.Is(err, ErrNodeExists) {
		t.Errorf("second Init: %v, want ErrNodeExists", err)
	}
	if err := InitWithOptions(root, InitOptions{GPUs: 2, Force: true}); err != nil {
		t.Fatalf("forced Init: %v", err)
	}
	if n, err := Load(root); err != nil || len(n.GPUs) != 2 {
		t.Errorf("after forced Init: %v GPUs, %v", n, err)
	}
	if _, err := os.Stat(filepath.Join(root, "dev", "nvidia2")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("forced Init kept the old device node nvidia2: %v", err)
	}

	for _, gpus := range []int{0, -1, 65} {
		if err := Init(t.TempDir(), gpus); err == nil {
			t.Errorf("Init with %d GPUs succeeded", gpus)
		}
	}
	if err := Init(t.TempDir(), 64); err != nil {
		t.Errorf("Init with 64 GPUs: %v", err)
	}
	if _, err := Load(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no simulated node") {
		t.Errorf("Load of an empty directory: %v", err)
	}
}

const validNode = `{"pid_namespace": "pid:[4026531836]", "gpus": [
 {"index": 0, "uuid": "GPU-a", "name": "n", "minor": 0, "total_bytes": 100, "reserved_bytes": 10, "mig": false},
 {"index": 1, "uuid": "GPU-b", "name": "n", "minor": 5, "total_bytes": 100, "reserved_bytes": 10, "mig": true}]}`

func TestParseNode(t *testing.T) {
	gpu0 := `{"index": 0, "uuid": "GPU-a", "minor": 0, "total_bytes": 100}`
	for _, tc := range []struct {
		name, in, err string
	}{
		{"valid", validNode, ""},
		{"empty", ``, "EOF"},
		{"not JSON", `pid_namespace: x`, "invalid character"},
		{"array", `[]`, "cannot unmarshal array"},
		{"unknown field", `{"pid_namespace": "p", "gpus": [` + gpu0 + `], "gpu": []}`, `unknown field "gpu"`},
		{"field in another case", `{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": 1, "Mig": true}]}`, `"Mig": field names are lower case`},
		{"repeated field", `{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": 1, "mig": true, "mig": false}]}`, `"mig" repeated`},
		{"trailing data", `{"pid_namespace": "p", "gpus": [` + gpu0 + `]} {}`, "trailing data"},
		{"wrong type", `{"pid_namespace": "p", "gpus": [{"index": "0"}]}`, "cannot unmarshal string"},
		{"negative size", `{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": -1}]}`, "cannot unmarshal number -1"},
		{"no namespace", `{"gpus": [` + gpu0 + `]}`, "pid_namespace is empty"},
		{"no GPUs", `{"pid_namespace": "p", "gpus": []}`, "0 GPUs"},
		{"index out of order", `{"pid_namespace": "p", "gpus": [{"index": 1, "uuid": "GPU-a", "total_bytes": 1}]}`, "indexes must be"},
		{"no uuid", `{"pid_namespace": "p", "gpus": [{"index": 0, "total_bytes": 1}]}`, "no uuid"},
		{"repeated uuid", `{"pid_namespace": "p", "gpus": [` + gpu0 + `, {"index": 1, "uuid": "GPU-a", "minor": 1, "total_bytes": 1}]}`, "repeats uuid"},
		{"repeated minor", `{"pid_namespace": "p", "gpus": [` + gpu0 + `, {"index": 1, "uuid": "GPU-b", "minor": 0, "total_bytes": 1}]}`, "repeats minor"},
		{"negative minor", `{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "minor": -1, "total_bytes": 1}]}`, "negative minor"},
		{"no memory", `{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a"}]}`, "total_bytes 0"},
		{"reserved above total", `{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": 1, "reserved_bytes": 2}]}`, "reserves"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := parseNode(strings.NewReader(tc.in))
			if tc.err == "" {
				if err != nil {
					t.Fatal(err)
				}
				if len(n.GPUs) != 2 || !n.GPUs[1].MIG || n.GPUs[1].Minor != 5 {
					t.Errorf("parsed %+v", n)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("error %v, want one containing %q", err, tc.err)
			}
		})
	}
}

func TestLoadErrorNamesFile(t *testing.T) {
	root := newNode(t, 1)
	path := filepath.Join(root, "node.json")
	if err := os.WriteFile(path, []byte(`{"pid_namespace": 1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(root); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("Load: %v, want an error naming %s", err, path)
	}
}

// FuzzLoadNode checks that the state file parser never panics and that
// whatever it accepts is a valid node that survives a save and a reload.
func FuzzLoadNode(f *testing.F) {
	f.Add(validNode)
	f.Add(`{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": 1}]}`)
	f.Add(`{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": 1}]} x`)
	f.Add(`{"gpus": null}`)
	f.Add(`{"pid_namespace": "p", "gpus": [{"index": 0, "uuid": "GPU-a", "minor": 0, "total_bytes": 1}, {"index": 1, "uuid": "GPU-a", "minor": 0, "total_bytes": 1}]}`)
	f.Add(`[`)
	f.Add(``)
	f.Fuzz(func(t *testing.T, in string) {
		n, err := parseNode(strings.NewReader(in))
		if err != nil {
			return
		}
		if err := n.validate(); err != nil {
			t.Fatalf("accepted an invalid node: %v", err)
		}
		n.Root = t.TempDir()
		if err := n.Save(); err != nil {
			t.Fatal(err)
		}
		back, err := Load(n.Root)
		if err != nil {
			t.Fatalf("reloading a saved node: %v", err)
		}
		if !reflect.DeepEqual(back, n) {
			t.Fatalf("round trip changed the node:\n%+v\n%+v", n, back)
		}
	})
}

// FuzzParseState feeds the driver's other state files, a context record and
// faults.json, arbitrary bytes: errors are fine, panics and nonsense are not.
func FuzzParseState(f *testing.F) {
	f.Add([]byte(`{"gpu":1,"pid":4242,"start_time":123,"used_bytes":4294967296}`))
	f.Add([]byte(`{"error":"GPU is lost","gpu":-1,"delay":"2s"}`))
	f.Add([]byte(`{"gpu":1,"gpu":2}`))
	f.Add([]byte(`{"gpu":-1,"pid":5,"start_time":1,"used_bytes":1}`))
	f.Add([]byte(`{"delay":"-5s"}`))
	f.Add([]byte(`[`))
	f.Fuzz(func(t *testing.T, data []byte) {
		if c, err := parseContext(bytes.NewReader(data)); err == nil && (c.PID <= 0 || c.GPU < 0) {
			t.Errorf("accepted a context with pid %d gpu %d", c.PID, c.GPU)
		}
		if fl, err := parseFaults(data); err == nil && fl.Delay < 0 {
			t.Errorf("accepted a negative delay %v", fl.Delay)
		}
	})
}
