package gpu

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// nvmlValueNotAvailable is NVML_VALUE_NOT_AVAILABLE as a usedGpuMemory value.
// go-nvml declares it as the untyped constant -1, which does not convert to
// uint64.
const nvmlValueNotAvailable = math.MaxUint64

// nvmlCloseWait bounds how long Close waits for a Read still inside NVML.
const nvmlCloseWait = 5 * time.Second

// NVMLDriver reads the node's GPUs through NVML. It is safe for concurrent use.
type NVMLDriver struct {
	lib    nvml.Interface
	logger *slog.Logger

	// mu is held for reading by every Read and for writing by Shutdown:
	// Shutdown unloads libnvidia-ml, and calling into it afterwards, or while
	// it unloads, crashes the process rather than returning an error.
	mu        sync.RWMutex
	closed    atomic.Bool
	closeOnce sync.Once
	closeErr  error
	closeWait time.Duration
}

var _ Driver = (*NVMLDriver)(nil)

// NVMLOptions tune OpenNVML.
type NVMLOptions struct {
	// ReleaseZeroPages hands back the pages of zeros that nvmlInit wrote
	// into libnvidia-ml's BSS (ReleaseZeroPages): 13 MiB on driver 580.
	ReleaseZeroPages bool
}

// nvmlLibrary is the file name of NVML's library, as the loader maps it
// (libnvidia-ml.so.1 resolves to libnvidia-ml.so.DRIVER_VERSION).
const nvmlLibrary = "libnvidia-ml.so"

// OpenNVML loads libnvidia-ml and initialises NVML. When that is impossible
// (no library, no driver, no GPU) the error wraps ErrUnavailable.
func OpenNVML(logger *slog.Logger, opts NVMLOptions) (d *NVMLDriver, err error) {
	// go-nvml calls straight into C; if anything on this path panics on a
	// machine without the library, report the backend as unavailable.
	defer func() {
		if r := recover(); r != nil {
			d, err = nil, nvmlUnavailable(fmt.Errorf("panic in go-nvml: %v", r))
		}
	}()
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, nvmlUnavailable(fmt.Errorf("nvml.Init: %w", ret))
	}
	d = NewNVMLDriver(lib, logger)
	// Versions are only for the log; failing to read them is harmless.
	driver, _ := lib.SystemGetDriverVersion()
	version, _ := lib.SystemGetNVMLVersion()
	d.logger.Info("NVML initialised", "driver_version", driver, "nvml_version", version)
	// Before anything else may call NVML: see ReleaseZeroPages.
	if opts.ReleaseZeroPages {
		z, err := ReleaseZeroPages(nvmlLibrary)
		if err != nil {
			// Nothing was handed back, or what was is zeros still.
			d.logger.Warn("Kept NVML's zero-filled memory", "err", err)
		} else {
			d.logger.Info("Handed back the pages of zeros that nvmlInit wrote into NVML's static memory",
				"library", z.Library, "bss_bytes", z.Bytes, "released_bytes", z.Released, "kept_bytes", z.Unreleased)
		}
	}
	return d, nil
}

func nvmlUnavailable(cause error) error {
	return fmt.Errorf("NVML could not be loaded (%w); on a machine without an NVIDIA GPU run with --backend=sim: %w", cause, ErrUnavailable)
}

// NewNVMLDriver wraps an NVML library on which Init has already succeeded.
// Tests pass go-nvml's mocks here.
func NewNVMLDriver(lib nvml.Interface, logger *slog.Logger) *NVMLDriver {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &NVMLDriver{lib: lib, logger: logger, closeWait: nvmlCloseWait}
}

// Name implements Driver.
func (d *NVMLDriver) Name() string { return "nvml" }

// DevicePath implements Driver.
func (d *NVMLDriver) DevicePath(minor int) string { return fmt.Sprintf("/dev/nvidia%d", minor) }

// DeviceNode implements Driver: character device 195:minor.
func (d *NVMLDriver) DeviceNode(minor int) (proc.Device, error) {
	if minor < 0 || minor > 254 {
		return proc.Device{}, fmt.Errorf("GPU minor number %d out of range 0..254", minor)
	}
	return proc.CharDevice(proc.NVIDIAMajor, uint32(minor)), nil
}

// PIDNamespace implements Driver: NVML reports host PIDs even when called
// from inside a container.
func (d *NVMLDriver) PIDNamespace() string { return InitPIDNamespace }

// Close shuts NVML down once. It waits for Reads in progress, but no longer
// than closeWait: a Read stuck in the driver must not block shutdown, and
// NVML is then shut down as soon as that Read returns.
func (d *NVMLDriver) Close() error {
	d.closeOnce.Do(func() {
		d.closed.Store(true)
		done := make(chan nvml.Return, 1)
		go func() {
			d.mu.Lock()
			defer d.mu.Unlock()
			done <- d.lib.Shutdown()
		}()
		select {
		case ret := <-done:
			if ret != nvml.SUCCESS {
				d.closeErr = fmt.Errorf("nvml Shutdown: %w", ret)
			}
		case <-time.After(d.closeWait):
			d.closeErr = fmt.Errorf("nvml Shutdown: a read has been in progress for more than %s; shutting down when it returns", d.closeWait)
		}
	})
	return d.closeErr
}

var errNVMLClosed = fmt.Errorf("nvml driver closed: %w", ErrUnavailable)

// Read implements Driver. A failure on one GPU is that GPU's Reading.Err;
// only a failure to count the GPUs, or ctx, fails the whole Read.
func (d *NVMLDriver) Read(ctx context.Context) ([]Reading, error) {
	// Checked before taking the lock too: a Close waiting for the lock
	// would otherwise hold up this Read.
	if d.closed.Load() {
		return nil, errNVMLClosed
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed.Load() {
		return nil, errNVMLClosed
	}

	count, ret := d.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvml DeviceGetCount: %w", ret)
	}
	readings := make([]Reading, 0, count)
	for i := range count {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		readings = append(readings, d.readGPU(i)...)
	}
	return readings, nil
}

// readGPU returns one Reading, or one per MIG instance.
func (d *NVMLDriver) readGPU(index int) []Reading {
	r := Reading{Device: Device{Index: index}}
	fail := func(call string, ret nvml.Return) []Reading {
		r.Err = fmt.Errorf("nvml GPU %d: %s: %w", index, call, ret)
		return []Reading{r}
	}

	dev, ret := d.lib.DeviceGetHandleByIndex(index)
	if ret != nvml.SUCCESS {
		return fail("DeviceGetHandleByIndex", ret)
	}
	// Methods are called on the handle, not as lib.DeviceGetX(dev): go-nvml's
	// mock servers only wire the former.
	// Each field is set only once its call succeeds: a failed call's zero
	// value would read as minor 0, the node of another GPU.
	uuid, ret := dev.GetUUID()
	if ret != nvml.SUCCESS {
		return fail("GetUUID", ret)
	}
	r.Device.UUID = uuid
	name, ret := dev.GetName()
	if ret != nvml.SUCCESS {
		return fail("GetName", ret)
	}
	r.Device.Name = name
	minor, ret := dev.GetMinorNumber()
	if ret != nvml.SUCCESS {
		return fail("GetMinorNumber", ret)
	}
	r.Device.Minor = minor

	mode, _, ret := dev.GetMigMode()
	switch {
	case ret == nvml.ERROR_NOT_SUPPORTED:
		// A GPU without MIG.
	case ret != nvml.SUCCESS:
		return fail("GetMigMode", ret)
	case mode == nvml.DEVICE_MIG_ENABLE:
		migs, err := d.readMIG(dev, r.Device)
		if err != nil {
			// With MIG on, the parent's figures do not describe any
			// instance, so publish nothing rather than a wrong number.
			d.logger.Debug("MIG instances cannot be read; GPU reported as unsupported",
				"gpu", index, "uuid", r.Device.UUID, "err", err)
			r.Unsupported = "mig"
			return []Reading{r}
		}
		return migs
	}

	var call string
	r.Memory, r.Processes, call, ret = nvmlReadHandle(dev)
	switch {
	case ret == nvml.SUCCESS:
	case call == "GetMemoryInfo_v2" && ret == nvml.ERROR_NOT_SUPPORTED:
		// No fallback to v1: its Used includes the driver's reservation.
		r.Memory, r.Processes = Memory{}, nil
		r.Unsupported = "memory_info_v2"
	default:
		return fail(call, ret)
	}
	return []Reading{r}
}

// readMIG returns one Reading per MIG instance of dev, or an error if any
// instance cannot be read completely.
func (d *NVMLDriver) readMIG(dev nvml.Device, parent Device) ([]Reading, error) {
	slots, ret := dev.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("GetMaxMigDeviceCount: %w", ret)
	}
	var readings []Reading
	for i := range slots {
		mig, ret := dev.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND {
			// NVML's slots are sparse: an index with no instance is not an error.
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("GetMigDeviceHandleByIndex(%d): %w", i, ret)
		}
		r := Reading{Device: parent}
		if r.Device.UUID, ret = mig.GetUUID(); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("MIG device %d: GetUUID: %w", i, ret)
		}
		gi, ret := mig.GetGpuInstanceId()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("MIG device %d: GetGpuInstanceId: %w", i, ret)
		}
		ci, ret := mig.GetComputeInstanceId()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("MIG device %d: GetComputeInstanceId: %w", i, ret)
		}
		r.Device.MIGInstance = fmt.Sprintf("%d/%d", gi, ci)
		var call string
		if r.Memory, r.Processes, call, ret = nvmlReadHandle(mig); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("MIG device %d: %s: %w", i, call, ret)
		}
		readings = append(readings, r)
	}
	if len(readings) == 0 {
		return nil, errors.New("MIG is enabled but no MIG instance exists")
	}
	return readings, nil
}

// nvmlReadHandle reads memory info v2 and the merged process lists of a GPU
// or MIG device handle. On failure it names the call that failed.
func nvmlReadHandle(dev nvml.Device) (Memory, []Process, string, nvml.Return) {
	m, ret := dev.GetMemoryInfo_v2()
	if ret != nvml.SUCCESS {
		return Memory{}, nil, "GetMemoryInfo_v2", ret
	}
	mem := Memory{Total: m.Total, Reserved: m.Reserved, Used: m.Used, Free: m.Free}

	lists := []struct {
		call string
		get  func() ([]nvml.ProcessInfo, nvml.Return)
		// optional lists may be unsupported (no graphics on data-centre
		// GPUs, no MPS server); the compute list may not.
		optional bool
	}{
		{"GetComputeRunningProcesses", dev.GetComputeRunningProcesses, false},
		{"GetGraphicsRunningProcesses", dev.GetGraphicsRunningProcesses, true},
		{"GetMPSComputeRunningProcesses", dev.GetMPSComputeRunningProcesses, true},
	}
	used := map[uint32]uint64{}
	for _, l := range lists {
		infos, ret := l.get()
		if ret == nvml.ERROR_NOT_SUPPORTED && l.optional {
			continue
		}
		if ret != nvml.SUCCESS {
			return Memory{}, nil, l.call, ret
		}
		for _, p := range infos {
			b := p.UsedGpuMemory
			if b == nvmlValueNotAvailable {
				b = 0
			}
			// The same context can appear in several lists; its memory
			// counts once.
			used[p.Pid] = max(used[p.Pid], b)
		}
	}
	var procs []Process
	for pid, b := range used {
		procs = append(procs, Process{PID: pid, UsedBytes: b})
	}
	slices.SortFunc(procs, func(a, b Process) int { return cmp.Compare(a.PID, b.PID) })
	return mem, procs, "", nvml.SUCCESS
}
