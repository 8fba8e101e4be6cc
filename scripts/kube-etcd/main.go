//go:build ignore

// Command etcd is the etcd of gpu-orphan's real-Kubernetes tests: one member
// started with etcd's embed package (go.etcd.io/etcd/server/v3/embed), at the
// version that k8s.io/kubernetes links. scripts/kube-tools.sh builds it in
// its copy of the k8s.io/kubernetes module (where that etcd is already in
// the module graph), beside kube-apiserver; the build tag keeps it out of
// gpu-orphan's own module.
//
// It listens for clients on a port that the kernel picks on 127.0.0.1, and
// prints the client URL on one line of its standard output once the member
// is ready to serve; the caller reads that line instead of guessing a free
// port. SIGTERM or SIGINT stops it.
package main

import (
	"flag"
	"fmt"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	dir := flag.String("data-dir", "", "directory of the member's data (required)")
	flag.Parse()
	if *dir == "" {
		log.Fatal("etcd: --data-dir is required")
	}
	cfg := embed.NewConfig()
	cfg.Name = "gpu-orphan-test"
	cfg.Dir = *dir
	cfg.LogLevel = "error"
	local := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	cfg.ListenClientUrls = []url.URL{local}
	cfg.AdvertiseClientUrls = []url.URL{local}
	cfg.ListenPeerUrls = []url.URL{local}
	cfg.AdvertisePeerUrls = []url.URL{local}
	cfg.InitialCluster = cfg.Name + "=" + local.String()
	// The tests' data is thrown away with the member: no fsync per write.
	cfg.UnsafeNoFsync = true
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("etcd: %v", err)
	}
	defer e.Close()
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		log.Fatalf("etcd: %v", err)
	case <-stop:
		return
	}
	fmt.Printf("http://%s\n", e.Clients[0].Addr())
	select {
	case err := <-e.Err():
		log.Fatalf("etcd: %v", err)
	case <-stop:
	}
}
