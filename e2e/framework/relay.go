package framework

// relay.go lets a process in a test namespace reach the API server, which listens on the root
// namespace's loopback: a listener on 127.0.0.1 inside the namespace (the serving certificate is
// valid for 127.0.0.1) whose connections are spliced to the API server, dialled from the root
// namespace. Both ends are loopback addresses; no packet leaves either namespace. Used by the
// e2e suite and bench/suite's legacy target.

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// Relay is one running relay; Close stops it and every connection it carries.
type Relay struct {
	ln net.Listener
	// dial opens the relayed connection's other end.
	dial func() (net.Conn, error)

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	done  bool
}

// StartRelay listens on 127.0.0.1:0 inside ns and relays every connection to target (host:port
// on the root namespace's loopback) until Close.
func StartRelay(ns *netns.NS, target string) (*Relay, error) {
	r := &Relay{conns: map[net.Conn]struct{}{}}
	r.dial = func() (net.Conn, error) { return net.DialTimeout("tcp", target, 5*time.Second) }
	if err := ns.Do(func() (err error) {
		r.ln, err = net.Listen("tcp4", "127.0.0.1:0")
		return err
	}); err != nil {
		return nil, fmt.Errorf("API relay in %s: %w", ns.Name, err)
	}
	r.wg.Go(r.accept)
	return r, nil
}

// StartForward is the other way round: it listens on listen (host:port on the root
// namespace's loopback; port 0 picks one) and relays every connection to target inside ns (a
// loopback address there), until Close. The demo uses it so that `kube-portal-proxy observe` on
// the host reaches the proxy's metrics address in the node namespace.
func StartForward(ns *netns.NS, listen, target string) (*Relay, error) {
	r := &Relay{conns: map[net.Conn]struct{}{}}
	r.dial = func() (c net.Conn, err error) {
		err = ns.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", target, 5*time.Second)
			return err
		})
		return c, err
	}
	var err error
	if r.ln, err = net.Listen("tcp", listen); err != nil {
		return nil, fmt.Errorf("forward %s to %s in %s: %w", listen, target, ns.Name, err)
	}
	r.wg.Go(r.accept)
	return r, nil
}

// Addr is the relay's address inside the namespace.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

func (r *Relay) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		if !r.track(c) {
			return
		}
		r.wg.Go(func() { r.splice(c) })
	}
}

// splice dials the other end (this goroutine runs in the root namespace: only ns.Do switches)
// and copies both ways.
func (r *Relay) splice(client net.Conn) {
	defer r.untrack(client)
	server, err := r.dial()
	if err != nil {
		return
	}
	if !r.track(server) {
		return
	}
	defer r.untrack(server)
	var wg sync.WaitGroup
	wg.Go(func() { copyHalf(server, client) })
	copyHalf(client, server)
	wg.Wait()
}

// copyHalf copies src to dst and then closes dst's write side, so half-closes pass through; on
// an error it closes dst, so the other direction ends too.
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

// track records c so Close can end it; after Close it closes c and reports false.
func (r *Relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		c.Close()
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *Relay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

// Close stops accepting, closes every relayed connection and waits for the goroutines.
func (r *Relay) Close() {
	r.mu.Lock()
	r.done = true
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.ln.Close()
	r.wg.Wait()
}

// WriteRelayedKubeconfig copies the kubeconfig at src to dst with every cluster's server set to
// server (a relay's https://address).
func WriteRelayedKubeconfig(src, dst, server string) error {
	cfg, err := clientcmd.LoadFromFile(src)
	if err != nil {
		return fmt.Errorf("read %s: %w", src, err)
	}
	for _, c := range cfg.Clusters {
		c.Server = server
	}
	if err := clientcmd.WriteToFile(*cfg, dst); err != nil {
		return fmt.Errorf("write %s: %w", dst, err)
	}
	return nil
}
