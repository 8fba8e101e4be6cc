package sim

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// devices are the device nodes a simulated CUDA process holds open: its
// GPU's, mapped; the uvm node; and, for a process that sees every GPU, the
// other GPUs' nodes, mapped too. Descriptors opened by Go are close-on-exec:
// only a child given them explicitly inherits them.
type devices struct {
	dev, uvm *os.File
	// others are the device nodes of the other GPUs (visible all).
	others []*os.File
}

// openDevices opens and maps g's device node, then opens the uvm node when
// uvm is set and the other GPUs' nodes when all is set. On error it closes
// what it opened.
func openDevices(n *Node, g GPU, uvm, all bool) (*devices, error) {
	d := &devices{}
	var err error
	d.dev, err = os.OpenFile(n.DevicePath(g.Minor), os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("sim: opening device node: %w", err)
	}
	if err := mapDevice(int(d.dev.Fd())); err != nil {
		d.close()
		return nil, err
	}
	if uvm {
		d.uvm, err = os.OpenFile(n.UVMPath(), os.O_RDWR, 0)
		if err != nil {
			d.close()
			return nil, fmt.Errorf("sim: opening %s (a node made by an older gpu-orphan-sim? init --force): %w", n.UVMPath(), err)
		}
	}
	if all {
		if err := d.openOthers(n, g.Index); err != nil {
			d.close()
			return nil, err
		}
	}
	return d, nil
}

// openOthers opens and maps the device node of every GPU but own.
func (d *devices) openOthers(n *Node, own int) error {
	for _, o := range n.GPUs {
		if o.Index == own {
			continue
		}
		f, err := os.OpenFile(n.DevicePath(o.Minor), os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("sim: opening device node of GPU %d: %w", o.Index, err)
		}
		d.others = append(d.others, f)
		if err := mapDevice(int(f.Fd())); err != nil {
			return err
		}
	}
	return nil
}

// close closes the descriptors; the mappings stay, as they do in a process
// that closes its descriptors without unmapping.
func (d *devices) close() error {
	var errs []error
	for _, f := range append([]*os.File{d.dev, d.uvm}, d.others...) {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	return errors.Join(errs...)
}

// DeviceMapBytes is the size of a simulated device node, and of the
// mapping a workload keeps of it.
const DeviceMapBytes = 4096

// mapDevice maps the device node as a CUDA context maps the real one: the
// mapping (not just the descriptor) is what tells a context's holders from
// tools that only query NVML. It is never unmapped: it lives as long as the
// process.
//
// Only device nodes are mapped, never a context's file: a mapping keeps a
// reference to the open file description, and flock's lock lives until its
// last reference goes, so a mapped context file would outlive every
// descriptor. The real driver frees a context when its last descriptor
// closes, whatever stays mapped (docs/facts.md: "descriptors hold a
// context, mappings do not").
func mapDevice(fd int) error {
	if _, err := unix.Mmap(fd, 0, DeviceMapBytes, unix.PROT_READ, unix.MAP_SHARED); err != nil {
		return fmt.Errorf("sim: mapping the device node: %w", err)
	}
	return nil
}
