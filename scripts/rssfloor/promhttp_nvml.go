//go:build ignore

// promhttp_nvml: the least a Go exporter of NVML on client_golang can be:
// nvmlInit, one read of GPU 0 every 5 s, and promhttp on a port; no
// flags, no TLS, no /proc. Usage: promhttp_nvml ADDR. Built and run by
// scripts/hardware-rss.sh.
package main

import (
	"net/http"
	"os"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func main() {
	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		os.Exit(1)
	}
	go func() {
		for {
			if dev, ret := lib.DeviceGetHandleByIndex(0); ret == nvml.SUCCESS {
				dev.GetMemoryInfo()
				dev.GetComputeRunningProcesses()
			}
			time.Sleep(5 * time.Second)
		}
	}()
	http.Handle("/metrics", promhttp.Handler())
	if err := http.ListenAndServe(os.Args[1], nil); err != nil {
		os.Exit(1)
	}
}
