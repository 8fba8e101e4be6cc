package gpu

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

// Figures from docs/facts.md's table (one H200, driver 580), in MiB.
const (
	h200TotalMiB    = 144384 // what the dgxh200 mock reports
	h200ReservedMiB = 615
)

// nvmlMem is memory info v2 as NVML reports it with usedMiB in use.
func nvmlMem(usedMiB uint64) nvml.Memory_v2 {
	return nvml.Memory_v2{
		Version:  2,
		Total:    h200TotalMiB * MiB,
		Reserved: h200ReservedMiB * MiB,
		Used:     usedMiB * MiB,
		Free:     (h200TotalMiB - h200ReservedMiB - usedMiB) * MiB,
	}
}

// wantMem is what the driver must report for nvmlMem(usedMiB).
func wantMem(usedMiB uint64) Memory {
	m := nvmlMem(usedMiB)
	return Memory{Total: m.Total, Reserved: m.Reserved, Used: m.Used, Free: m.Free}
}

// procEntry is one process-list entry; usedMiB == math.MaxUint64 means NVML's
// NOT_AVAILABLE.
func procEntry(pid uint32, usedMiB uint64) nvml.ProcessInfo {
	b := usedMiB * MiB
	if usedMiB == math.MaxUint64 {
		b = math.MaxUint64
	}
	// Instance ids are what NVML returns outside MIG.
	return nvml.ProcessInfo{Pid: pid, UsedGpuMemory: b, GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
}

// handleState is what one GPU or MIG device handle answers.
type handleState struct {
	mem                             nvml.Memory_v2
	memRet                          nvml.Return
	compute, graphics, mps          []nvml.ProcessInfo
	computeRet, graphicsRet, mpsRet nvml.Return
}

// idleHandle is docs/facts.md's idle row, with graphics and MPS lists supported
// but empty.
func idleHandle() handleState { return handleState{mem: nvmlMem(0)} }

// wireHandle sets the funcs that the dgxh200 mock leaves unset.
func wireHandle(d *mock.Device, h handleState) {
	d.GetMemoryInfo_v2Func = func() (nvml.Memory_v2, nvml.Return) { return h.mem, h.memRet }
	d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return h.compute, h.computeRet }
	d.GetGraphicsRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return h.graphics, h.graphicsRet }
	d.GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return h.mps, h.mpsRet }
}

// migState is one MIG device behind a slot of GetMigDeviceHandleByIndex.
type migState struct {
	uuid   string
	gi, ci int
	giRet  nvml.Return
	handle handleState
}

// gpuState is one physical GPU; the zero value is an idle GPU without MIG.
type gpuState struct {
	handleState
	// setup, when set, changes the mock after the handle has been wired.
	setup func(d *server.Device)
	// migSlots enables MIG; a nil slot answers ERROR_NOT_FOUND.
	migSlots   []*migState
	migSlotRet nvml.Return // answer of every GetMigDeviceHandleByIndex call, if set
}

func newServer(t *testing.T, gpus map[int]gpuState) *server.Server {
	t.Helper()
	s := dgxh200.New()
	for i, nd := range s.Devices {
		d := nd.(*server.Device)
		g, ok := gpus[i]
		if !ok {
			g.handleState = idleHandle()
		}
		wireHandle(&d.Device, g.handleState)
		if g.migSlots != nil {
			d.MigMode = nvml.DEVICE_MIG_ENABLE
			slots := g.migSlots
			slotRet := g.migSlotRet
			d.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return len(slots), nvml.SUCCESS }
			d.GetMigDeviceHandleByIndexFunc = func(n int) (nvml.Device, nvml.Return) {
				if slotRet != nvml.SUCCESS {
					return nil, slotRet
				}
				if slots[n] == nil {
					return nil, nvml.ERROR_NOT_FOUND
				}
				m := slots[n]
				md := &mock.Device{
					GetUUIDFunc:              func() (string, nvml.Return) { return m.uuid, nvml.SUCCESS },
					GetGpuInstanceIdFunc:     func() (int, nvml.Return) { return m.gi, m.giRet },
					GetComputeInstanceIdFunc: func() (int, nvml.Return) { return m.ci, nvml.SUCCESS },
				}
				wireHandle(md, m.handle)
				return md, nvml.SUCCESS
			}
		}
		if g.setup != nil {
			g.setup(d)
		}
	}
	return s
}

// wantGPU is the expected outcome for one physical GPU.
type wantGPU struct {
	// readings, with Device.Index, Name and Minor filled in from the mock,
	// and Device.UUID too when left empty. Err is compared with errors.Is.
	readings []Reading
	// errText must appear in the message of each reading's Err.
	errText []string
	// anonymous: the GPU failed before its identity could be read, so only
	// Device.Index is known.
	anonymous bool
	// unknownMinor: GetMinorNumber failed, so Device.Minor stays zero.
	unknownMinor bool
}

func idleWant() wantGPU { return wantGPU{readings: []Reading{{Memory: wantMem(0)}}} }

func TestNVMLRead(t *testing.T) {
	const (
		pidA       = 4242
		pidP       = 5000
		pidC       = 5001 // the forked child: holds the memory, never listed
		pidS       = 6000
		pidTrainer = 7000
	)
	oneProcess := gpuState{handleState: handleState{mem: nvmlMem(4714), compute: []nvml.ProcessInfo{procEntry(pidA, 4706)}}}
	tests := []struct {
		name string
		gpus map[int]gpuState // GPUs not named are idle
		// setup, when set, changes the mock server once it is wired.
		setup func(s *server.Server)
		want  map[int]wantGPU // GPUs not named must read idle
	}{
		{
			name: "FACTS idle: used 0, reserved 615, empty list",
		},
		{
			name: "FACTS one process that allocated 4096",
			gpus: map[int]gpuState{0: oneProcess},
			want: map[int]wantGPU{0: {readings: []Reading{{
				Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 4706 * MiB}},
			}}}},
		},
		{
			name: "FACTS after SIGKILL, SIGTERM or SIGINT of that process",
		},
		{
			name: "FACTS fork after CUDA init: only the parent is listed",
			gpus: map[int]gpuState{1: {handleState: handleState{mem: nvmlMem(6762), compute: []nvml.ProcessInfo{procEntry(pidP, 6754)}}}},
			want: map[int]wantGPU{1: {readings: []Reading{{
				Memory: wantMem(6762), Processes: []Process{{PID: pidP, UsedBytes: 6754 * MiB}},
			}}}},
		},
		{
			// NVML still names the dead creator; whether it lives is for the
			// caller to find out, not the driver.
			name: "FACTS fork, after SIGKILL of the parent: dead PID still listed",
			gpus: map[int]gpuState{1: {handleState: handleState{mem: nvmlMem(6762), compute: []nvml.ProcessInfo{procEntry(pidP, 6754)}}}},
			want: map[int]wantGPU{1: {readings: []Reading{{
				Memory: wantMem(6762), Processes: []Process{{PID: pidP, UsedBytes: 6754 * MiB}},
			}}}},
		},
		{
			name: "FACTS fork, after SIGKILL of the child too",
		},
		{
			name: "FACTS spawned child with its own context outlives its parent",
			gpus: map[int]gpuState{2: {handleState: handleState{mem: nvmlMem(2666), compute: []nvml.ProcessInfo{procEntry(pidS, 2658)}}}},
			want: map[int]wantGPU{2: {readings: []Reading{{
				Memory: wantMem(2666), Processes: []Process{{PID: pidS, UsedBytes: 2658 * MiB}},
			}}}},
		},
		{
			name: "FACTS trainer with forked DataLoader workers: only the trainer is listed",
			gpus: map[int]gpuState{7: {handleState: handleState{mem: nvmlMem(5740), compute: []nvml.ProcessInfo{procEntry(pidTrainer, 5732)}}}},
			want: map[int]wantGPU{7: {readings: []Reading{{
				Memory: wantMem(5740), Processes: []Process{{PID: pidTrainer, UsedBytes: 5732 * MiB}},
			}}}},
		},
		{
			name: "same PID in compute, graphics and MPS lists counts once, at its largest",
			gpus: map[int]gpuState{0: {handleState: handleState{
				mem:      nvmlMem(4722),
				compute:  []nvml.ProcessInfo{procEntry(pidA, 4700)},
				graphics: []nvml.ProcessInfo{procEntry(pidA, 4706), procEntry(pidS, 8)},
				mps:      []nvml.ProcessInfo{procEntry(pidA, 4706)},
			}}},
			want: map[int]wantGPU{0: {readings: []Reading{{
				Memory: wantMem(4722),
				Processes: []Process{
					{PID: pidA, UsedBytes: 4706 * MiB},
					{PID: pidS, UsedBytes: 8 * MiB},
				},
			}}}},
		},
		{
			name: "NOT_AVAILABLE usedGpuMemory reads as 0",
			gpus: map[int]gpuState{0: {handleState: handleState{mem: nvmlMem(4714), compute: []nvml.ProcessInfo{procEntry(pidA, math.MaxUint64)}}}},
			want: map[int]wantGPU{0: {readings: []Reading{{
				Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 0}},
			}}}},
		},
		{
			name: "NOT_AVAILABLE in one list does not hide the figure from another",
			gpus: map[int]gpuState{0: {handleState: handleState{
				mem:      nvmlMem(4714),
				compute:  []nvml.ProcessInfo{procEntry(pidA, math.MaxUint64)},
				graphics: []nvml.ProcessInfo{procEntry(pidA, 4706)},
			}}},
			want: map[int]wantGPU{0: {readings: []Reading{{
				Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 4706 * MiB}},
			}}}},
		},
		{
			name: "graphics and MPS lists NOT_SUPPORTED are skipped",
			gpus: map[int]gpuState{0: {handleState: handleState{
				mem:         nvmlMem(4714),
				compute:     []nvml.ProcessInfo{procEntry(pidA, 4706)},
				graphicsRet: nvml.ERROR_NOT_SUPPORTED,
				mpsRet:      nvml.ERROR_NOT_SUPPORTED,
			}}},
			want: map[int]wantGPU{0: {readings: []Reading{{
				Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 4706 * MiB}},
			}}}},
		},
		{
			name: "compute-list error fails that GPU only",
			gpus: map[int]gpuState{
				3: {handleState: handleState{mem: nvmlMem(4714), computeRet: nvml.ERROR_UNKNOWN}},
				4: oneProcess,
			},
			want: map[int]wantGPU{
				3: {readings: []Reading{{Err: nvml.ERROR_UNKNOWN}}, errText: []string{"GPU 3", "GetComputeRunningProcesses"}},
				4: {readings: []Reading{{Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 4706 * MiB}}}}},
			},
		},
		{
			name: "compute list NOT_SUPPORTED is an error, not an empty list",
			gpus: map[int]gpuState{3: {handleState: handleState{mem: nvmlMem(0), computeRet: nvml.ERROR_NOT_SUPPORTED}}},
			want: map[int]wantGPU{3: {readings: []Reading{{Err: nvml.ERROR_NOT_SUPPORTED}}, errText: []string{"GPU 3", "GetComputeRunningProcesses"}}},
		},
		{
			name: "graphics-list error other than NOT_SUPPORTED fails that GPU",
			gpus: map[int]gpuState{5: {handleState: handleState{mem: nvmlMem(0), graphicsRet: nvml.ERROR_GPU_IS_LOST}}},
			want: map[int]wantGPU{5: {readings: []Reading{{Err: nvml.ERROR_GPU_IS_LOST}}, errText: []string{"GPU 5", "GetGraphicsRunningProcesses"}}},
		},
		{
			name: "MPS-list error other than NOT_SUPPORTED fails that GPU",
			gpus: map[int]gpuState{5: {handleState: handleState{mem: nvmlMem(0), mpsRet: nvml.ERROR_NO_PERMISSION}}},
			want: map[int]wantGPU{5: {readings: []Reading{{Err: nvml.ERROR_NO_PERMISSION}}, errText: []string{"GPU 5", "GetMPSComputeRunningProcesses"}}},
		},
		{
			name: "memory info v2 NOT_SUPPORTED: unsupported, no fallback to v1",
			gpus: map[int]gpuState{6: {handleState: handleState{memRet: nvml.ERROR_NOT_SUPPORTED, compute: []nvml.ProcessInfo{procEntry(pidA, 4706)}}}},
			want: map[int]wantGPU{6: {readings: []Reading{{Unsupported: "memory_info_v2"}}}},
		},
		{
			name: "memory info v2 error fails that GPU",
			gpus: map[int]gpuState{6: {handleState: handleState{memRet: nvml.ERROR_UNKNOWN}}},
			want: map[int]wantGPU{6: {readings: []Reading{{Err: nvml.ERROR_UNKNOWN}}, errText: []string{"GPU 6", "GetMemoryInfo_v2"}}},
		},
		{
			name: "handle error fails that GPU",
			setup: func(s *server.Server) {
				s.DeviceGetHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
					if i == 2 {
						return nil, nvml.ERROR_GPU_IS_LOST
					}
					return s.Devices[i], nvml.SUCCESS
				}
			},
			want: map[int]wantGPU{2: {readings: []Reading{{Err: nvml.ERROR_GPU_IS_LOST}}, errText: []string{"GPU 2", "DeviceGetHandleByIndex"}, anonymous: true}},
		},
		{
			name: "minor number error fails that GPU",
			gpus: map[int]gpuState{2: {handleState: idleHandle(), setup: func(d *server.Device) {
				d.GetMinorNumberFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
			}}},
			want: map[int]wantGPU{2: {readings: []Reading{{Err: nvml.ERROR_UNKNOWN}}, errText: []string{"GPU 2", "GetMinorNumber"}, unknownMinor: true}},
		},
		{
			name: "GetMigMode NOT_SUPPORTED: a GPU without MIG",
			gpus: map[int]gpuState{0: {handleState: oneProcess.handleState, setup: func(d *server.Device) {
				d.GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_NOT_SUPPORTED }
			}}},
			want: map[int]wantGPU{0: {readings: []Reading{{
				Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 4706 * MiB}},
			}}}},
		},
		{
			name: "GetMigMode error fails that GPU",
			gpus: map[int]gpuState{0: {handleState: idleHandle(), setup: func(d *server.Device) {
				d.GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_UNKNOWN }
			}}},
			want: map[int]wantGPU{0: {readings: []Reading{{Err: nvml.ERROR_UNKNOWN}}, errText: []string{"GPU 0", "GetMigMode"}}},
		},
		{
			name: "MIG enabled: one reading per instance, empty slots skipped",
			gpus: map[int]gpuState{1: {
				// The parent handle must not be read: its figures describe
				// no instance.
				handleState: handleState{memRet: nvml.ERROR_UNKNOWN, computeRet: nvml.ERROR_UNKNOWN},
				migSlots: []*migState{
					{uuid: "MIG-11111111-1111-1111-1111-111111111111", gi: 1, ci: 0, handle: handleState{
						mem: nvmlMem(4714), compute: []nvml.ProcessInfo{procEntry(pidA, 4706)},
						graphicsRet: nvml.ERROR_NOT_SUPPORTED, mpsRet: nvml.ERROR_NOT_SUPPORTED,
					}},
					nil,
					{uuid: "MIG-22222222-2222-2222-2222-222222222222", gi: 2, ci: 0, handle: handleState{
						mem: nvmlMem(0), graphicsRet: nvml.ERROR_NOT_SUPPORTED, mpsRet: nvml.ERROR_NOT_SUPPORTED,
					}},
				},
			}},
			want: map[int]wantGPU{1: {readings: []Reading{
				{
					Device: Device{UUID: "MIG-11111111-1111-1111-1111-111111111111", MIGInstance: "1/0"},
					Memory: wantMem(4714), Processes: []Process{{PID: pidA, UsedBytes: 4706 * MiB}},
				},
				{
					Device: Device{UUID: "MIG-22222222-2222-2222-2222-222222222222", MIGInstance: "2/0"},
					Memory: wantMem(0),
				},
			}}},
		},
		{
			name: "MIG enabled, instance handles NOT_SUPPORTED: unsupported",
			gpus: map[int]gpuState{1: {handleState: idleHandle(), migSlots: []*migState{nil}, migSlotRet: nvml.ERROR_NOT_SUPPORTED}},
			want: map[int]wantGPU{1: {readings: []Reading{{Unsupported: "mig"}}}},
		},
		{
			name: "MIG enabled, instance memory info v2 NOT_SUPPORTED: unsupported",
			gpus: map[int]gpuState{1: {handleState: idleHandle(), migSlots: []*migState{
				{uuid: "MIG-1", gi: 1, handle: handleState{memRet: nvml.ERROR_NOT_SUPPORTED}},
			}}},
			want: map[int]wantGPU{1: {readings: []Reading{{Unsupported: "mig"}}}},
		},
		{
			name: "MIG enabled, one instance's GPU instance id fails: unsupported, nothing partial",
			gpus: map[int]gpuState{1: {handleState: idleHandle(), migSlots: []*migState{
				{uuid: "MIG-1", gi: 1, handle: idleHandle()},
				{uuid: "MIG-2", gi: 2, giRet: nvml.ERROR_UNKNOWN, handle: idleHandle()},
			}}},
			want: map[int]wantGPU{1: {readings: []Reading{{Unsupported: "mig"}}}},
		},
		{
			name: "MIG enabled, instance compute list fails: unsupported",
			gpus: map[int]gpuState{1: {handleState: idleHandle(), migSlots: []*migState{
				{uuid: "MIG-1", gi: 1, handle: handleState{mem: nvmlMem(0), computeRet: nvml.ERROR_UNKNOWN}},
			}}},
			want: map[int]wantGPU{1: {readings: []Reading{{Unsupported: "mig"}}}},
		},
		{
			name: "MIG enabled without any instance: unsupported",
			gpus: map[int]gpuState{1: {handleState: idleHandle(), migSlots: []*migState{nil, nil}}},
			want: map[int]wantGPU{1: {readings: []Reading{{Unsupported: "mig"}}}},
		},
	}

	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newServer(t, tt.gpus)
			if tt.setup != nil {
				tt.setup(s)
			}
			got, err := NewNVMLDriver(s, nil).Read(context.Background())
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
			var want []Reading
			var errText [][]string
			for i, nd := range s.Devices {
				d := nd.(*server.Device)
				w, ok := tt.want[i]
				if !ok {
					w = idleWant()
				}
				for _, r := range w.readings {
					r.Device.Index = i
					if w.anonymous {
						want = append(want, r)
						errText = append(errText, w.errText)
						continue
					}
					r.Device.Name = d.Config.Name
					if !w.unknownMinor {
						r.Device.Minor = d.Minor
					}
					if r.Device.UUID == "" {
						r.Device.UUID = d.UUID
					}
					want = append(want, r)
					errText = append(errText, w.errText)
				}
			}
			if len(got) != len(want) {
				t.Fatalf("got %d readings, want %d:\n got %+v\nwant %+v", len(got), len(want), got, want)
			}
			for i := range want {
				g, w := got[i], want[i]
				if !errors.Is(g.Err, w.Err) || (g.Err == nil) != (w.Err == nil) {
					t.Errorf("reading %d: Err = %v, want %v", i, g.Err, w.Err)
				}
				for _, s := range errText[i] {
					if g.Err == nil || !strings.Contains(g.Err.Error(), s) {
						t.Errorf("reading %d: Err = %v, want it to name %q", i, g.Err, s)
					}
				}
				g.Err, w.Err = nil, nil
				if !reflect.DeepEqual(g, w) {
					t.Errorf("reading %d:\n got %+v\nwant %+v", i, g, w)
				}
			}
			// v1 counts the reservation as used: it must never be read.
			for i, nd := range s.Devices {
				if n := len(nd.(*server.Device).GetMemoryInfoCalls()); n != 0 {
					t.Errorf("GPU %d: GetMemoryInfo (v1) called %d times", i, n)
				}
			}
		})
	}
}

func TestNVMLReadDeviceCountFails(t *testing.T) {
	s := newServer(t, nil)
	s.DeviceGetCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_DRIVER_NOT_LOADED }
	got, err := NewNVMLDriver(s, nil).Read(context.Background())
	if !errors.Is(err, nvml.ERROR_DRIVER_NOT_LOADED) || !strings.Contains(err.Error(), "DeviceGetCount") {
		t.Fatalf("Read = %v, %v; want an error naming DeviceGetCount", got, err)
	}
}

func TestNVMLReadContext(t *testing.T) {
	t.Run("cancelled before the read", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		got, err := NewNVMLDriver(newServer(t, nil), nil).Read(ctx)
		if !errors.Is(err, context.Canceled) || got != nil {
			t.Fatalf("Read = %v, %v; want nil, context.Canceled", got, err)
		}
	})
	t.Run("expires between devices", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s := newServer(t, nil)
		// GPU 2 answers, but by then the caller has given up.
		s.Devices[2].(*server.Device).GetMemoryInfo_v2Func = func() (nvml.Memory_v2, nvml.Return) {
			cancel()
			return nvmlMem(0), nvml.SUCCESS
		}
		got, err := NewNVMLDriver(s, nil).Read(ctx)
		if !errors.Is(err, context.Canceled) || got != nil {
			t.Fatalf("Read = %v, %v; want nil, context.Canceled", got, err)
		}
		if n := len(s.Devices[3].(*server.Device).GetMemoryInfo_v2Calls()); n != 0 {
			t.Errorf("GPU 3 read %d times after ctx expired", n)
		}
	})
	t.Run("deadline exceeded", func(t *testing.T) {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		defer cancel()
		_, err := NewNVMLDriver(newServer(t, nil), nil).Read(ctx)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Read error = %v, want context.DeadlineExceeded", err)
		}
	})
}

func TestNVMLClose(t *testing.T) {
	s := newServer(t, nil)
	var shutdowns atomic.Int32
	s.ShutdownFunc = func() nvml.Return {
		shutdowns.Add(1)
		return nvml.SUCCESS
	}
	d := NewNVMLDriver(s, nil)
	for range 2 {
		if err := d.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if n := shutdowns.Load(); n != 1 {
		t.Errorf("Shutdown called %d times, want 1", n)
	}
	// After Shutdown the library is unloaded: calling it would crash.
	if _, err := d.Read(context.Background()); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Read after Close = %v, want ErrUnavailable", err)
	}
	if n := len(s.DeviceGetCountCalls()); n != 0 {
		t.Errorf("DeviceGetCount called %d times after Close", n)
	}
}

func TestNVMLCloseShutdownError(t *testing.T) {
	s := newServer(t, nil)
	s.ShutdownFunc = func() nvml.Return { return nvml.ERROR_UNKNOWN }
	if err := NewNVMLDriver(s, nil).Close(); !errors.Is(err, nvml.ERROR_UNKNOWN) {
		t.Fatalf("Close = %v, want ERROR_UNKNOWN", err)
	}
}

func TestNVMLCloseWaitsForReadThenGivesUp(t *testing.T) {
	s := newServer(t, nil)
	var shutdowns atomic.Int32
	s.ShutdownFunc = func() nvml.Return {
		shutdowns.Add(1)
		return nvml.SUCCESS
	}
	entered, release := make(chan struct{}), make(chan struct{})
	s.DeviceGetCountFunc = func() (int, nvml.Return) {
		close(entered)
		<-release // a driver call that hangs
		return 0, nvml.SUCCESS
	}
	d := NewNVMLDriver(s, nil)
	d.closeWait = 50 * time.Millisecond
	readDone := make(chan error, 1)
	go func() {
		_, err := d.Read(context.Background())
		readDone <- err
	}()
	<-entered

	if err := d.Close(); err == nil {
		t.Fatal("Close returned nil while a Read was stuck in NVML")
	}
	if n := shutdowns.Load(); n != 0 {
		t.Fatalf("Shutdown called %d times while a Read was in NVML", n)
	}
	close(release)
	if err := <-readDone; err != nil {
		t.Fatalf("stuck Read: %v", err)
	}
	deadline := time.Now().Add(slowness.Scale(5*time.Second, slowness.Factor()))
	for shutdowns.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("Shutdown not called once the stuck Read returned")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestNVMLDriverIdentity(t *testing.T) {
	d := NewNVMLDriver(newServer(t, nil), nil)
	if got := d.Name(); got != "nvml" {
		t.Errorf("Name() = %q", got)
	}
	if got := d.DevicePath(3); got != "/dev/nvidia3" {
		t.Errorf("DevicePath(3) = %q", got)
	}
	if got := d.PIDNamespace(); got != InitPIDNamespace {
		t.Errorf("PIDNamespace() = %q", got)
	}
}

// TestOpenNVML runs against whatever this machine has. Without a GPU,
// OpenNVML must fail with ErrUnavailable (and not crash); with one, it must
// read every GPU.
func TestOpenNVML(t *testing.T) {
	d, err := OpenNVML(nil, NVMLOptions{ReleaseZeroPages: true})
	if err != nil {
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("OpenNVML error = %v, want it to wrap ErrUnavailable", err)
		}
		for _, s := range []string{"NVML could not be loaded", "--backend=sim"} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("OpenNVML error %q does not say %q", err, s)
			}
		}
		t.Logf("no NVML here: %v", err)
		return
	}
	defer func() {
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}()
	readings, err := d.Read(context.Background())
	if err != nil {
		t.Fatalf("Read on real NVML: %v", err)
	}
	if len(readings) == 0 {
		t.Fatal("NVML loaded but reported no GPU")
	}
	for _, r := range readings {
		t.Logf("%s", fmt.Sprintf("%+v", r))
		if r.Err != nil {
			t.Errorf("GPU %d: %v", r.Device.Index, r.Err)
		}
	}
}
