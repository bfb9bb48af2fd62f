package main

import (
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// Address plan: everything on 127.0.0.1, ephemeral ports - the sink, and in front of it a
// forwarder that closes both sides at the first EOF as the legacy userspace proxy does.

func TestBulkThroughAProxyWithoutHalfClose(t *testing.T) {
	sinkLn := listenLoopback(t)
	go acceptAll(sinkLn, sink)
	fwd := listenLoopback(t)
	go closeBothAtFirstEOF(t, fwd, sinkLn.Addr().String())

	for _, tc := range []struct {
		name    string
		addr    string
		run     func(loadSpec) (loadResult, error)
		wantErr string
	}{
		{"plain_bulk_direct_is_acked_at_EOF", sinkLn.Addr().String(), bulk, ""},
		{"framed_bulk_direct_is_acked", sinkLn.Addr().String(), bulkFramed, ""},
		{"plain_bulk_loses_the_ack_when_the_proxy_closes_both_sides", fwd.Addr().String(), bulk, "bulk ack"},
		{"framed_bulk_is_acked_before_any_FIN", fwd.Addr().String(), bulkFramed, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const size = 3<<20 + 17 // not a multiple of the 1 MiB write
			res, err := tc.run(loadSpec{Addr: tc.addr, Bytes: size, Timeout: 5 * time.Second})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			// The plain test writes whole MiB buffers; the framed one exactly what it announced.
			if res.Ops < size || (strings.HasPrefix(tc.name, "framed") && res.Ops != size) {
				t.Errorf("sent %d bytes, want %d", res.Ops, size)
			}
		})
	}
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// closeBothAtFirstEOF forwards each connection to target and closes both sockets as soon as
// either direction ends.
func closeBothAtFirstEOF(t *testing.T, ln net.Listener, target string) {
	for {
		in, err := ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp4", target)
		if err != nil {
			t.Error(err)
			in.Close()
			return
		}
		var once sync.Once
		closeBoth := func() { once.Do(func() { in.Close(); out.Close() }) }
		go func() { _, _ = io.Copy(out, in); closeBoth() }()
		go func() { _, _ = io.Copy(in, out); closeBoth() }()
	}
}
