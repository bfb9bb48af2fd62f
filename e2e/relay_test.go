package e2e

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// apiRelay lets a process in a test namespace reach the API server, which listens on the root
// namespace's loopback: it listens on 127.0.0.1 inside the namespace (the serving certificate is
// valid for 127.0.0.1) and splices every accepted connection to the API server, dialled from the
// root namespace. All traffic stays on the two loopbacks.
type apiRelay struct {
	ln     net.Listener
	target string

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	done  bool
}

// startRelay listens inside ns and relays to target (host:port in the root namespace) until t ends.
func startRelay(t *testing.T, ns *netns.NS, target string) *apiRelay {
	t.Helper()
	r := &apiRelay{target: target, conns: map[net.Conn]struct{}{}}
	if err := ns.Do(func() (err error) {
		r.ln, err = net.Listen("tcp4", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatalf("API relay in %s: %v", ns.Name, err)
	}
	r.wg.Go(r.accept)
	t.Cleanup(r.close)
	return r
}

// addr is the relay's address inside the namespace.
func (r *apiRelay) addr() string { return r.ln.Addr().String() }

func (r *apiRelay) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		if !r.track(c) {
			c.Close()
			return
		}
		r.wg.Go(func() { r.splice(c) })
	}
}

// splice dials the API server (this goroutine runs in the root namespace) and copies both ways.
func (r *apiRelay) splice(client net.Conn) {
	defer r.untrack(client)
	server, err := net.DialTimeout("tcp", r.target, 5*time.Second)
	if err != nil {
		return
	}
	if !r.track(server) {
		server.Close()
		return
	}
	defer r.untrack(server)
	var wg sync.WaitGroup
	wg.Go(func() { copyHalf(server, client) })
	copyHalf(client, server)
	wg.Wait()
}

// copyHalf copies src to dst and then closes dst's write side, so half-closes pass through.
func copyHalf(dst, src net.Conn) {
	_, err := io.Copy(dst, src)
	if tc, ok := dst.(*net.TCPConn); ok && err == nil {
		_ = tc.CloseWrite()
		return
	}
	if err != nil && !errors.Is(err, net.ErrClosed) {
		dst.Close()
	}
}

func (r *apiRelay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *apiRelay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

// close stops accepting, closes every relayed connection and waits for the goroutines.
func (r *apiRelay) close() {
	r.mu.Lock()
	r.done = true
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.ln.Close()
	r.wg.Wait()
}
