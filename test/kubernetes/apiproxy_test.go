//go:build kubernetes

package kubernetes

import (
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// apiProxy is a TCP proxy in front of kube-apiserver. Cut ends every
// connection through it, as a load balancer's restart or a network
// partition does: the dispatcher's watches end and its informer asks again,
// while kube-apiserver runs on (restarting it takes a minute, and its RBAC
// cache refuses everyone for a while after). TLS passes through untouched.
type apiProxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	conns map[net.Conn]time.Time // when each was opened
	// gate, while not nil, holds new connections until it is closed;
	// heldSince is when the first of them came.
	gate      chan struct{}
	heldSince time.Time
}

func newAPIProxy(t *testing.T, apiServerURL string) *apiProxy {
	t.Helper()
	u, err := url.Parse(apiServerURL)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &apiProxy{ln: ln, target: u.Host, conns: map[net.Conn]time.Time{}}
	t.Cleanup(func() {
		ln.Close()
		p.Release()
		p.Cut(false)
	})
	go p.serve()
	return p
}

func (p *apiProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			continue
		}
		go p.forward(c)
	}
}

func (p *apiProxy) forward(client net.Conn) {
	p.mu.Lock()
	gate := p.gate
	if gate != nil && p.heldSince.IsZero() {
		p.heldSince = time.Now()
	}
	p.mu.Unlock()
	if gate != nil {
		<-gate
	}
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		client.Close()
		return
	}
	p.track(client, server)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go pipe(server, client)
	go pipe(client, server)
	<-done
	<-done
	p.mu.Lock()
	delete(p.conns, client)
	delete(p.conns, server)
	p.mu.Unlock()
}

// track keeps the connections to be cut.
func (p *apiProxy) track(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		p.conns[c] = time.Now()
	}
}

// Cut closes every connection through the proxy; with hold, new ones wait
// until Release (as behind a partition that heals: a client's TLS
// handshake waits up to 10 s), and are then forwarded.
func (p *apiProxy) Cut(hold bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if hold && p.gate == nil {
		p.gate = make(chan struct{})
	}
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

// waitSettled waits until every connection through the proxy is older
// than client-go's "very short watch" (a watch that ends within a second
// of its start with no event is taken for a failure, and the informer
// lists again instead of watching from its resourceVersion), and there is
// at least one.
func (p *apiProxy) waitSettled(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, "the dispatcher's connections through the proxy to be older than 1.5 s", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, opened := range p.conns {
			if time.Since(opened) < 1500*time.Millisecond {
				return false
			}
		}
		return len(p.conns) > 0
	})
}

// Release forwards the connections held since Cut, and those after.
func (p *apiProxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gate != nil {
		close(p.gate)
		p.gate = nil
	}
	p.heldSince = time.Time{}
}

// heldFor is how long the first connection held since Cut has waited;
// zero when none has come.
func (p *apiProxy) heldFor() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.heldSince.IsZero() {
		return 0
	}
	return time.Since(p.heldSince)
}

// kubeconfig rewrites the kubeconfig at path to reach the API server
// through the proxy (its certificate names 127.0.0.1, as the proxy's
// address does), in t's temp dir.
func (p *apiProxy) kubeconfig(t *testing.T, path string) string {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cfg.Clusters {
		c.Server = "https://" + p.ln.Addr().String()
	}
	out := path + ".proxied"
	if err := clientcmd.WriteToFile(*cfg, out); err != nil {
		t.Fatal(err)
	}
	return out
}
