package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// result is one measurement of one target.
type result struct {
	rate           float64 // exchanges per second
	p50, p99       time.Duration
	cpuPerExchange time.Duration // of the target process tree; 0 for direct
	lost           int64         // clients that stopped on a missing reply
}

// histogram counts latencies in 1 µs buckets up to 50 ms.
type histogram [50001]uint64

func (h *histogram) add(d time.Duration) {
	us := int(d / time.Microsecond)
	h[min(us, len(h)-1)]++
}

func (h *histogram) quantile(q float64) time.Duration {
	var total uint64
	for _, n := range h {
		total += n
	}
	want := uint64(q * float64(total))
	var seen uint64
	for us, n := range h {
		seen += n
		if seen > want {
			return time.Duration(us) * time.Microsecond
		}
	}
	return time.Duration(len(h)) * time.Microsecond
}

// load runs closed-loop clients against addr: each sends a request and waits for its reply.
// Only the exchanges completed between the end of warmup and the end of d are counted.
func load(addr netip.AddrPort, pid, clients, size int, warmup, d time.Duration) (result, error) {
	var measuring, stop atomic.Bool
	var wg sync.WaitGroup
	var lost atomic.Int64
	counts := make([]uint64, clients)
	hists := make([]*histogram, clients)
	end := time.Now().Add(warmup + d + time.Second)
	for i := range clients {
		conn, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(addr))
		if err != nil {
			return result{}, err
		}
		hists[i] = new(histogram)
		wg.Go(func() {
			defer conn.Close()
			// One deadline for the whole run: a per-read deadline would cost the clients more
			// than the proxy. A lost reply parks the client until then, and is counted.
			conn.SetReadDeadline(end)
			req, resp := make([]byte, size), make([]byte, 65536)
			var n uint64
			for !stop.Load() {
				t0 := time.Now()
				if _, err := conn.Write(req); err != nil {
					lost.Add(1)
					return
				}
				if _, err := conn.Read(resp); err != nil {
					if !stop.Load() {
						lost.Add(1)
					}
					return
				}
				if measuring.Load() {
					hists[i].add(time.Since(t0))
					n++
				}
			}
			counts[i] = n
		})
	}
	time.Sleep(warmup)
	cpu0, err := cpuTime(pid)
	if err != nil {
		return result{}, err
	}
	measuring.Store(true)
	t0 := time.Now()
	time.Sleep(d)
	measuring.Store(false)
	elapsed := time.Since(t0)
	cpu1, err := cpuTime(pid)
	if err != nil {
		return result{}, err
	}
	stop.Store(true)
	wg.Wait()

	var total uint64
	var h histogram
	for i := range clients {
		total += counts[i]
		for b, n := range hists[i] {
			h[b] += n
		}
	}
	res := result{rate: float64(total) / elapsed.Seconds(), p50: h.quantile(0.5), p99: h.quantile(0.99),
		lost: lost.Load()}
	if pid != 0 && total > 0 {
		res.cpuPerExchange = (cpu1 - cpu0) / time.Duration(total)
	}
	return res, nil
}

// probe waits up to 5 s for addr to answer (nginx takes a moment to bind).
func probe(addr netip.AddrPort, size int) error {
	conn, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(addr))
	if err != nil {
		return err
	}
	defer conn.Close()
	buf := make([]byte, 65536)
	deadline := time.Now().Add(5 * time.Second)
	for {
		conn.Write(make([]byte, size))
		conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		_, err := conn.Read(buf)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cpuTime is the CPU time of pid and its descendants, all threads, from schedstat (ns precision).
func cpuTime(pid int) (time.Duration, error) {
	if pid == 0 {
		return 0, nil
	}
	var total time.Duration
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	if err != nil || len(tasks) == 0 {
		return 0, fmt.Errorf("tasks of %d: %v", pid, err)
	}
	for _, task := range tasks {
		b, err := os.ReadFile(task + "/schedstat")
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue // the thread exited
			}
			return 0, err
		}
		ns, err := strconv.ParseInt(strings.Fields(string(b))[0], 10, 64)
		if err != nil {
			return 0, err
		}
		total += time.Duration(ns)
		children, _ := os.ReadFile(task + "/children")
		for _, c := range strings.Fields(string(children)) {
			cpid, _ := strconv.Atoi(c)
			ct, err := cpuTime(cpid)
			if err != nil {
				return 0, err
			}
			total += ct
		}
	}
	return total, nil
}

// echoServer answers every datagram with itself, from one goroutine per CPU.
type echoServer struct {
	conn *net.UDPConn
	addr netip.AddrPort
	wg   sync.WaitGroup
}

func startEcho(listen string) (*echoServer, error) {
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(listen)))
	if err != nil {
		return nil, err
	}
	conn.SetReadBuffer(4 << 20)
	e := &echoServer{conn: conn, addr: conn.LocalAddr().(*net.UDPAddr).AddrPort()}
	for range 2 {
		e.wg.Go(func() {
			buf := make([]byte, 65536)
			for {
				n, from, err := conn.ReadFromUDPAddrPort(buf)
				if err != nil {
					return
				}
				conn.WriteToUDPAddrPort(buf[:n], from)
			}
		})
	}
	return e, nil
}

func (e *echoServer) close() {
	e.conn.Close()
	e.wg.Wait()
}
