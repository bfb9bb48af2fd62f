package tcp

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"
)

// Address plan: the proxy on 127.0.0.1, echo endpoints on 127.0.0.3 and 127.0.0.4 (kernel-chosen
// ports); loopback only.

// TestIOUringRingBuffersRunningOut: with one buffer in each loop's ring, most recvs find none
// (ENOBUFS) and their directions fall back to a poll and a read into a pooled buffer; every byte
// still arrives, in order, on every connection.
func TestIOUringRingBuffersRunningOut(t *testing.T) {
	requireIOURing(t)
	e := &uringEngine{threads: 2, ringBufs: 1}
	t.Cleanup(func() { e.Close() }) // after the proxy's Shutdown (cleanups run last first)
	ep1, ep2 := serve(t, "127.0.0.3", echo), serve(t, "127.0.0.4", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep1, ep2}}, Config{Engine: e})
	const clients = 50
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		wg.Go(func() {
			c, err := net.Dial("tcp4", p.Addr().String())
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			for j := range 20 {
				msg := fmt.Sprintf("client %d message %d %0900d", i, j, j)
				c.Write([]byte(msg))
				buf := make([]byte, len(msg))
				if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
					errs <- fmt.Errorf("client %d: got %.40q, %v; want %.40q", i, buf, err, msg)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestIOUringCloseEndsWhatIsLeft: an engine closed under an open connection closes it and ends
// it, so the proxy's Shutdown does not wait for it forever, and the client sees its connection end.
func TestIOUringCloseEndsWhatIsLeft(t *testing.T) {
	requireIOURing(t)
	e := &uringEngine{threads: 1}
	ep := serve(t, "127.0.0.3", echo)
	closed := make(closedCh, 1)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Engine: e, Logger: testLogger(t), OnEnd: closed.onClose})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(t.Context()) }()
	c := dial(t, p)
	roundTrip(t, c, "hello")
	p.Close()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	e.Close()
	closed.next(t)
	shut := make(chan struct{})
	go func() { p.Shutdown(); close(shut) }()
	select {
	case <-shut:
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown after the engine closed did not return")
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the client's connection is still open")
	}
}
