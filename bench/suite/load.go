package main

// load.go is the client: a child process in the client namespace that runs one load against one
// address and prints its outcome as one JSON line. It reads the proxy's CPU time itself (the PID
// namespace is shared), at the edges of the measured window.

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/rlimit"
)

// stdin is where children learn that the harness is done with them (EOF).
var stdin io.Reader = os.Stdin

// loadSpec is one load, as the harness passes it to the client child.
type loadSpec struct {
	Test    string        // bulk, conn, keepalive, udp, idle
	Addr    string        // host:port to load
	PID     int           // proxy to measure; 0 for none
	Dur     time.Duration // measured window of the rate tests
	Warmup  time.Duration // unmeasured time before it (keepalive, udp)
	Conc    int           // concurrent clients of the rate tests
	Bytes   int64         // bulk size
	Size    int           // request size of keepalive and udp
	N       int           // idle connections
	Timeout time.Duration // per operation
}

// loadResult is what the client child prints.
type loadResult struct {
	Ops     int64   `json:"ops"`     // completed operations (bulk: bytes)
	Seconds float64 `json:"seconds"` // measured window
	CPU     float64 `json:"cpu_s"`   // the proxy's CPU time in the window
	Errors  int64   `json:"errors"`  // failed operations
	Open    int     `json:"open"`    // idle: connections held
}

// runClient runs spec and prints the result; the idle test then holds its connections until
// stdin closes.
func runClient(spec loadSpec) error {
	_, _ = rlimit.RaiseNoFile(1 << 20)
	var res loadResult
	var err error
	switch spec.Test {
	case "bulk":
		res, err = bulk(spec)
	case "bulk-framed":
		res, err = bulkFramed(spec)
	case "conn":
		res = rateLoop(spec, connOnce)
	case "keepalive":
		res, err = echoLoad(spec, "tcp4", readFull)
	case "udp":
		res, err = echoLoad(spec, "udp4", readDatagram)
	case "idle":
		return holdIdle(spec)
	default:
		err = fmt.Errorf("unknown test %q", spec.Test)
	}
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// window measures the proxy's CPU across a timed section.
type window struct {
	pid  int
	t0   time.Time
	cpu0 time.Duration
}

func openWindow(pid int) window { return window{pid: pid, t0: time.Now(), cpu0: procstat.CPUTime(pid)} }

func (w window) close(res *loadResult) {
	res.Seconds = time.Since(w.t0).Seconds()
	res.CPU = (procstat.CPUTime(w.pid) - w.cpu0).Seconds()
}

// bulk sends spec.Bytes on one connection to the sink and waits for its ack.
func bulk(spec loadSpec) (loadResult, error) {
	var res loadResult
	c, err := net.DialTimeout("tcp4", spec.Addr, spec.Timeout)
	if err != nil {
		return res, err
	}
	defer c.Close()
	buf := make([]byte, 1<<20)
	w := openWindow(spec.PID)
	for res.Ops < spec.Bytes {
		n, err := c.Write(buf)
		res.Ops += int64(n)
		if err != nil {
			return res, fmt.Errorf("bulk write: %w", err)
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return res, err
	}
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		return res, fmt.Errorf("bulk ack: %w", err)
	}
	w.close(&res)
	return res, nil
}

// bulkFramed is bulk for proxies that close both sides at the first EOF (the legacy userspace
// proxy): the length goes first, and the sink acks after that many bytes, before any FIN.
func bulkFramed(spec loadSpec) (loadResult, error) {
	var res loadResult
	c, err := net.DialTimeout("tcp4", spec.Addr, spec.Timeout)
	if err != nil {
		return res, err
	}
	defer c.Close()
	buf := make([]byte, 1<<20)
	w := openWindow(spec.PID)
	hdr := binary.BigEndian.AppendUint64([]byte(bulkMagic), uint64(spec.Bytes))
	if _, err := c.Write(hdr); err != nil {
		return res, fmt.Errorf("bulk header: %w", err)
	}
	for res.Ops < spec.Bytes {
		n, err := c.Write(buf[:min(int64(len(buf)), spec.Bytes-res.Ops)])
		res.Ops += int64(n)
		if err != nil {
			return res, fmt.Errorf("bulk write: %w", err)
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		return res, fmt.Errorf("bulk ack: %w", err)
	}
	w.close(&res)
	return res, nil
}

// rateLoop runs op from spec.Conc workers for spec.Dur and counts the successes.
func rateLoop(spec loadSpec, op func(loadSpec, []byte) error) loadResult {
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	w := openWindow(spec.PID)
	deadline := w.t0.Add(spec.Dur)
	for range spec.Conc {
		wg.Go(func() {
			buf := make([]byte, 64)
			for time.Now().Before(deadline) {
				if err := op(spec, buf); err != nil {
					failed.Add(1)
					continue
				}
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	res := loadResult{Ops: ok.Load(), Errors: failed.Load()}
	w.close(&res)
	return res
}

// connOnce is one short connection: connect, 4 bytes there and back, close.
func connOnce(spec loadSpec, buf []byte) error {
	c, err := net.DialTimeout("tcp4", spec.Addr, spec.Timeout)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(spec.Timeout))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	_, err = io.ReadFull(c, buf[:4])
	return err
}

// echoLoad: spec.Conc connections of network (TCP keep-alive connections, or connected UDP
// sockets), each a closed loop of spec.Size-byte requests echoed back, read with read. Only
// exchanges inside the window after the warmup count.
func echoLoad(spec loadSpec, network string, read func(c net.Conn, resp []byte, n int) error) (loadResult, error) {
	conns, err := dialAll(spec, network)
	defer closeAll(conns)
	if err != nil {
		return loadResult{}, err
	}
	return closedLoop(spec, conns, func(c net.Conn, req, resp []byte) error {
		if _, err := c.Write(req); err != nil {
			return err
		}
		return read(c, resp, len(req))
	})
}

// readFull reads an n-byte answer from a stream.
func readFull(c net.Conn, resp []byte, n int) error {
	_, err := io.ReadFull(c, resp[:n])
	return err
}

// readDatagram reads one datagram, the whole answer.
func readDatagram(c net.Conn, resp []byte, _ int) error {
	_, err := c.Read(resp)
	return err
}

// dialAll opens spec.Conc connections (connected sockets for UDP) to spec.Addr. On an error it
// returns the ones opened so far with it.
func dialAll(spec loadSpec, network string) ([]net.Conn, error) {
	conns := make([]net.Conn, 0, spec.Conc)
	for range spec.Conc {
		c, err := net.DialTimeout(network, spec.Addr, spec.Timeout)
		if err != nil {
			return conns, err
		}
		conns = append(conns, c)
	}
	return conns, nil
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		c.Close()
	}
}

// closedLoop runs exchange on every connection until the warmup and the window are over. One
// read deadline for the whole run: a lost datagram parks its client (counted as an error) rather
// than costing every exchange a deadline update.
func closedLoop(spec loadSpec, conns []net.Conn, exchange func(c net.Conn, req, resp []byte) error) (loadResult, error) {
	var measuring, stop atomic.Bool
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	end := time.Now().Add(spec.Warmup + spec.Dur + spec.Timeout)
	for _, c := range conns {
		_ = c.SetDeadline(end)
		wg.Go(func() {
			req, resp := make([]byte, spec.Size), make([]byte, 65536)
			for !stop.Load() {
				if err := exchange(c, req, resp); err != nil {
					if !stop.Load() {
						failed.Add(1)
					}
					return
				}
				if measuring.Load() {
					ok.Add(1)
				}
			}
		})
	}
	time.Sleep(spec.Warmup) // load shaping, not synchronisation: the window starts after it
	w := openWindow(spec.PID)
	measuring.Store(true)
	time.Sleep(spec.Dur)
	measuring.Store(false)
	res := loadResult{Ops: ok.Load()}
	w.close(&res)
	stop.Store(true)
	for _, c := range conns {
		_ = c.SetDeadline(time.Now()) // unblock the readers
	}
	wg.Wait()
	res.Errors = failed.Load()
	if res.Ops == 0 {
		return res, errors.New("no exchange completed")
	}
	return res, nil
}

// holdIdle opens spec.N connections to the echo, one exchange each (so the proxy has dialled
// the endpoint), prints how many it holds, and keeps them until stdin closes.
func holdIdle(spec loadSpec) error {
	conns := make([]net.Conn, 0, spec.N)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	buf := make([]byte, 4)
	var firstErr error
	for range spec.N {
		if err := func() error {
			c, err := net.DialTimeout("tcp4", spec.Addr, spec.Timeout)
			if err != nil {
				return err
			}
			_ = c.SetDeadline(time.Now().Add(spec.Timeout))
			if _, err := c.Write([]byte("idle")); err != nil {
				c.Close()
				return err
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				c.Close()
				return err
			}
			_ = c.SetDeadline(time.Time{})
			conns = append(conns, c)
			return nil
		}(); err != nil {
			firstErr = err
			break
		}
	}
	res := loadResult{Open: len(conns)}
	if firstErr != nil {
		fmt.Fprintf(os.Stderr, "idle: stopped at %d connections: %v\n", len(conns), firstErr)
		res.Errors = 1
	}
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, stdin)
	return nil
}
