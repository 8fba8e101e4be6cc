//go:build ignore

// nvml: Go and NVML, nothing else: the least memory any Go program that
// reads NVML holds. nvmlInit, then one read of GPU 0 every 5 s, as a
// collector would. Built and run by scripts/hardware-rss.sh.
package main

import (
	"os"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func main() {
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		os.Exit(1)
	}
	for {
		read(lib)
		time.Sleep(5 * time.Second)
	}
}

func read(lib nvml.Interface) {
	if dev, ret := lib.DeviceGetHandleByIndex(0); ret == nvml.SUCCESS {
		dev.GetMemoryInfo()
		dev.GetComputeRunningProcesses()
	}
}
