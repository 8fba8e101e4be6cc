//go:build ignore

// promhttp: client_golang's promhttp on a port, with cgo on (as every
// binary that links go-nvml has), and no NVML. Usage: promhttp ADDR.
// Built and run by scripts/hardware-rss.sh.
package main

// #include <stdlib.h>
import "C"

import (
	"net/http"
	"os"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func main() {
	C.free(C.malloc(1)) // libc in use, as NVML's users have it
	http.Handle("/metrics", promhttp.Handler())
	if err := http.ListenAndServe(os.Args[1], nil); err != nil {
		os.Exit(1)
	}
}
