package main

import (
	"io"
	"strings"
	"testing"
)

func TestTCPCountersDelta(t *testing.T) {
	before, after := tcpCounters{}, tcpCounters{}
	if err := before.parse([]byte("Tcp: RtoAlgorithm MaxConn ActiveOpens OutRsts\nTcp: 1 -1 10 3\nTcpExt: TCPSynRetrans ListenOverflows DelayedACKs\nTcpExt: 0 0 7\n")); err != nil {
		t.Fatal(err)
	}
	if err := after.parse([]byte("Tcp: RtoAlgorithm MaxConn ActiveOpens OutRsts\nTcp: 1 -1 12 3\nTcpExt: TCPSynRetrans ListenOverflows DelayedACKs\nTcpExt: 2 0 9\n")); err != nil {
		t.Fatal(err)
	}
	// DelayedACKs moved but is not watched; OutRsts and ListenOverflows did not move.
	if got, want := after.delta(before), "TCPSynRetrans=2 Tcp:ActiveOpens=2"; got != want {
		t.Errorf("delta = %q, want %q", got, want)
	}
	if err := (tcpCounters{}).parse([]byte("Tcp: A B\nTcp: 1\n")); err == nil {
		t.Error("names and values of different lengths parsed")
	}
}

func TestLogWatchAcrossWrites(t *testing.T) {
	l := newLogWatch(io.Discard, servingMessage)
	for _, p := range []string{"level=info msg=\"Proxy sockets", " open: serving\" sinceRun=1ms\n"} {
		if !l.seen().IsZero() {
			t.Fatal("seen before the line was complete")
		}
		if _, err := l.Write([]byte(p)); err != nil {
			t.Fatal(err)
		}
	}
	if l.seen().IsZero() {
		t.Error("the line split over two writes was not seen")
	}
	other := newLogWatch(io.Discard, servingMessage)
	_, _ = other.Write([]byte(strings.Repeat("x", 100) + "\nProxy sockets\n open: serving\n"))
	if !other.seen().IsZero() {
		t.Error("a message split over two lines was taken for the line")
	}
}
