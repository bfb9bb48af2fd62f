package main

// relay.go lets a process in the node namespace reach the API server, which listens on the root
// namespace's loopback: a listener on 127.0.0.1 inside the namespace (the serving certificate is
// valid for 127.0.0.1) whose connections are spliced to the API server, dialled from the root
// namespace. Both ends are loopback addresses; no packet leaves either namespace.

import (
	"io"
	"net"
	"sync"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// relay is one running relay; close stops it and every connection it carries.
type relay struct {
	ln     net.Listener
	target string

	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	done  bool
}

// startRelay listens on 127.0.0.1:0 inside ns and relays to target (host:port on the root
// namespace's loopback).
func startRelay(ns *netns.NS, target string) (*relay, error) {
	r := &relay{target: target, conns: map[net.Conn]struct{}{}}
	if err := ns.Do(func() (err error) {
		r.ln, err = net.Listen("tcp4", "127.0.0.1:0")
		return err
	}); err != nil {
		return nil, err
	}
	r.wg.Go(r.accept)
	return r, nil
}

// addr is the relay's address inside the namespace.
func (r *relay) addr() string { return r.ln.Addr().String() }

func (r *relay) accept() {
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

// splice runs in the root namespace (only ns.Do switches), so the dial reaches the API server.
func (r *relay) splice(client net.Conn) {
	defer r.untrack(client)
	server, err := net.DialTimeout("tcp", r.target, 5*time.Second)
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

// copyHalf copies src to dst, then closes dst's write side so a half-close passes through.
func copyHalf(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

// track records c so close can end it; after close it closes c and reports false.
func (r *relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		c.Close()
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *relay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

// close stops accepting, closes every relayed connection and waits for the goroutines.
func (r *relay) close() {
	r.mu.Lock()
	r.done = true
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.ln.Close()
	r.wg.Wait()
}
