package main

// backend.go is the pod: a child process in the pod namespace serving a TCP echo (request/response
// and idle connections), a TCP sink (bulk: reads to EOF, then acks one byte) and a UDP echo.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/rlimit"
)

// The pod's ports.
const (
	echoPort = 8080
	sinkPort = 8081
	udpPort  = 5353
)

// bulkMagic starts a framed bulk stream: then 8 bytes of length (big endian), then the data.
// The plain bulk test sends zeros, so it never starts with it.
const bulkMagic = "KPPBULK1"

// runBackend serves until stdin closes (the harness is gone or done), printing "ready" first.
func runBackend(ctx context.Context) error {
	_, _ = rlimit.RaiseNoFile(1 << 20)
	echoLn, err := net.Listen("tcp4", fmt.Sprintf(":%d", echoPort))
	if err != nil {
		return err
	}
	sinkLn, err := net.Listen("tcp4", fmt.Sprintf(":%d", sinkPort))
	if err != nil {
		return err
	}
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{Port: udpPort})
	if err != nil {
		return err
	}
	_ = pc.SetReadBuffer(4 << 20)
	var wg sync.WaitGroup
	wg.Go(func() { acceptAll(echoLn, echo) })
	wg.Go(func() { acceptAll(sinkLn, sink) })
	for range 2 {
		wg.Go(func() { udpEcho(pc) })
	}
	fmt.Println("ready")
	ctx, cancel := context.WithCancel(ctx)
	go func() { _, _ = io.Copy(io.Discard, stdin); cancel() }()
	<-ctx.Done()
	echoLn.Close()
	sinkLn.Close()
	pc.Close()
	wg.Wait()
	return nil
}

// acceptAll serves each connection on its own goroutine until the listener closes. Connections
// still open then die with the process.
func acceptAll(ln net.Listener, serve func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // EMFILE and the like: the client sees a failure and reports it
		}
		go func() { defer c.Close(); serve(c) }()
	}
}

// echo writes back what it reads. Not io.Copy: between two TCP sockets it would splice through a
// pipe held for the connection's life, 3 descriptors per idle connection.
func echo(c net.Conn) {
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// sink reads to EOF and acks with one byte, so the sender knows every byte arrived. A stream
// that starts with bulkMagic announces its length instead (the framed bulk test, for proxies
// without half-close): the ack follows that many bytes, no EOF needed.
func sink(c net.Conn) {
	var hdr [16]byte
	n, err := io.ReadFull(c, hdr[:])
	switch {
	case err == nil && string(hdr[:8]) == bulkMagic:
		if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint64(hdr[8:]))); err != nil {
			return
		}
	case err == nil:
		if _, err := io.Copy(io.Discard, c); err != nil {
			return
		}
	case n > 0 && errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		// a short stream, already at EOF
	default:
		return
	}
	_, _ = c.Write([]byte{1})
}

func udpEcho(pc *net.UDPConn) {
	buf := make([]byte, 65536)
	for {
		n, from, err := pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		_, _ = pc.WriteToUDPAddrPort(buf[:n], from)
	}
}
