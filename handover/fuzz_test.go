package handover

import (
	"context"
	"encoding/json"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// fuzzFDs counts this process's descriptors (a fuzz target's testing.F has no testing.T helper).
func fuzzFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	return len(ents)
}

// FuzzReceive plays a predecessor that may be buggy, of another version or hostile: after the
// successor's hello it sends a header and two chunk messages of any bytes, the first with up to
// three descriptors (a real listener on loopback, or /dev/null), then waits. "PORT" in the
// messages is replaced by the listener's port, so the seeds can be valid. Receive must not panic
// and must either take only descriptors that are what their entries say, or fail with every
// descriptor it received closed: the process holds as many descriptors after as before.
func FuzzReceive(f *testing.F) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	defer ln.Close()
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		f.Fatal(err)
	}
	defer devnull.Close()
	path := filepath.Join(f.TempDir(), "handover.sock")
	uln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		f.Fatal(err)
	}
	defer uln.Close()

	entry := `{"name":"tcp/127.0.0.1:PORT","protocol":"tcp","family":"ipv4","address":"127.0.0.1","port":PORT}`
	f.Add([]byte(`{"version":1,"sockets":1,"chunks":1}`), []byte("["+entry+"]"), uint8(1), []byte{})
	f.Add([]byte(`{"version":1,"sockets":2,"chunks":1}`), []byte("["+entry+","+entry+"]"), uint8(2), []byte{})
	f.Add([]byte(`{"version":1,"sockets":1,"chunks":1}`), []byte("["+entry+"]"), uint8(1|4), []byte{})
	f.Add([]byte(`{"version":1,"sockets":0,"chunks":0}`), []byte{}, uint8(0), []byte{})
	f.Add([]byte(`{"version":1,"error":"busy"}`), []byte{}, uint8(0), []byte{})
	f.Add([]byte(`{"version":2,"sockets":1,"chunks":1}`), []byte("["+entry+"]"), uint8(1), []byte{})
	f.Add([]byte(`{"version":1,"sockets":201,"chunks":2}`), []byte("["+entry+"]"), uint8(1), []byte(`[]`))
	f.Add([]byte(`{"version":1,"sockets":1,"chunks":1}`), []byte(`[{"address":"::1%lo","protocol":"udp","port":PORT}]`), uint8(1), []byte{})
	// The affinity messages after the sockets (affinity.go): good, bad entries beside good ones,
	// a message with descriptors, one that does not decode, more announced than sent, too many.
	aff := `{"affinity":[{"ns":"default","n":"web","p":"http","c":"10.244.1.5","e":"10.244.2.3:8080","i":1500}]}`
	f.Add([]byte(`{"version":1,"sockets":1,"chunks":1,"affinity":1}`), []byte("["+entry+"]"), uint8(1), []byte(aff))
	f.Add([]byte(`{"version":1,"sockets":1,"chunks":1,"affinity":1}`), []byte("["+entry+"]"), uint8(1),
		[]byte(`{"affinity":[{"ns":"","n":"web","c":"10.244.1.5","e":"10.244.2.3:8080"},{"ns":"a","n":"b","c":"::","e":"[::1]:0","i":-1},{"ns":"a","n":"b","c":"10.0.0.1","e":"10.0.0.2:80","i":99999999999},{"ns":"a","n":"b","c":"fe80::1%eth0","e":"10.0.0.2:80"},{"ns":"a","n":"b","c":"10.0.0.1","e":"10.0.0.2:80","i":1}]}`))
	f.Add([]byte(`{"version":1,"sockets":0,"chunks":0,"affinity":2}`), []byte(aff), uint8(2), []byte(`{"affinity":[1,"x",null,{}]}`))
	f.Add([]byte(`{"version":1,"sockets":0,"chunks":0,"affinity":1}`), []byte(`{"affinity":`), uint8(0), []byte{})
	f.Add([]byte(`{"version":1,"sockets":0,"chunks":0,"affinity":3}`), []byte(aff), uint8(0), []byte(aff))
	f.Add([]byte(`{"version":1,"sockets":0,"chunks":0,"affinity":99999999}`), []byte(aff), uint8(0), []byte{})
	f.Add([]byte(`{"version":1,"sockets":0,"chunks":0,"affinity":-1}`), []byte(aff), uint8(0), []byte{})

	f.Fuzz(func(t *testing.T, head, chunk []byte, nfds uint8, chunk2 []byte) {
		head = []byte(strings.ReplaceAll(string(head), "PORT", port))
		chunk = []byte(strings.ReplaceAll(string(chunk), "PORT", port))
		before := fuzzFDs()
		var fds []int
		for i := range int(nfds % 4) {
			src := uintptr(0)
			if nfds&(4<<i) != 0 {
				src = devnull.Fd()
			} else {
				raw, _ := ln.(*net.TCPListener).SyscallConn()
				_ = raw.Control(func(fd uintptr) { src = fd })
			}
			fd, err := unix.FcntlInt(src, unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			fds = append(fds, fd)
		}
		done := fakePredecessor(uln, [][]byte{head, chunk, chunk2}, [][]int{nil, fds})
		// Messages on a local socket arrive in microseconds; a header announcing more chunks than
		// are sent costs this timeout, and a slow machine's spurious timeout is a valid failure.
		in, err := Receive(context.Background(), path, 300*time.Millisecond)
		if err == nil {
			if in.Received() > len(fds) {
				t.Fatalf("received %d sockets, %d were sent", in.Received(), len(fds))
			}
			if len(in.Affinity()) > maxAffinityEntries {
				t.Fatalf("took %d affinity entries, over the bound %d", len(in.Affinity()), maxAffinityEntries)
			}
			for _, e := range in.Affinity() {
				if e.Service.Namespace == "" || e.Service.Name == "" || !e.Client.IsValid() || e.Client.Zone() != "" ||
					!e.Endpoint.IsValid() || e.Endpoint.Port() == 0 || e.Idle < 0 || e.Idle > maxAffinityIdle {
					t.Fatalf("took an affinity entry that does not check out: %+v", e)
				}
			}
			for k, got := range in.socks {
				for _, fd := range got {
					e, ok := classify(fd)
					if gk, _ := e.key(); !ok || gk != k {
						t.Fatalf("a descriptor filed as %+v is %+v", k, e)
					}
				}
			}
			in.Close()
		} else if !strings.HasPrefix(err.Error(), "handover") {
			t.Fatalf("Receive error %q does not say it is the hand-over", err)
		}
		<-done
		if after := fuzzFDs(); after != before {
			t.Fatalf("descriptors: %d before, %d after (err %v)", before, after, err)
		}
	})
}

// FuzzServe plays a successor that may be buggy, of another version or hostile: it sends a
// hello, an adoption and a ready message of any bytes. The predecessor must not panic, must hand
// off only after a hello of its version, an adoption and a ready, must report the pending
// hand-over in pairs (true, then false if it failed after the adoption), and must keep no
// descriptor of what it collected.
func FuzzServe(f *testing.F) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	defer ln.Close()
	f.Add([]byte(`{"version":1}`), []byte(`{"adopted":1}`), []byte(`{"ready":true}`))
	f.Add([]byte(`{"version":2}`), []byte(`{"adopted":1}`), []byte(`{"ready":true}`))
	f.Add([]byte(`{"version":1}`), []byte(`{"ready":true}`), []byte(`{"ready":true}`))
	f.Add([]byte(`{"version":1}`), []byte(`{"adopted":0}`), []byte(`{"ready":false}`))
	f.Add([]byte(`{"version":1}`), []byte(`{"adopted":-5,"ready":true}`), []byte(`null`))
	f.Add([]byte(``), []byte(``), []byte(``))
	f.Add([]byte(`{"version":1,"affinity":true}`), []byte(`{"adopted":1}`), []byte(`{"ready":true}`))
	f.Add([]byte(`{"version":1,"affinity":"yes"}`), []byte(`{"adopted":1}`), []byte(`{"ready":true}`))
	f.Fuzz(func(t *testing.T, hi, adopted, ready []byte) {
		before := fuzzFDs()
		pending, collected, affinity, err := playSuccessor(t, ln, hi, adopted, ready)
		var hv hello
		var ra, rr reply
		valid := json.Unmarshal(hi, &hv) == nil && hv.Version == Version &&
			json.Unmarshal(adopted, &ra) == nil && ra.Adopted != nil &&
			json.Unmarshal(ready, &rr) == nil && rr.Ready
		if (err == nil) != valid {
			t.Fatalf("serve(hello %q, adopted %q, ready %q) = %v; a hand-over wants exactly a hello of version %d, an adoption and a ready", hi, adopted, ready, err, Version)
		}
		if collected > 0 && (json.Unmarshal(hi, &hv) != nil || hv.Version != Version) {
			t.Fatalf("collected the sockets for hello %q", hi)
		}
		if want := collected > 0 && hv.Affinity; (affinity > 0) != want {
			t.Fatalf("hello %q: %d affinity messages sent; want them only to a successor that asks", hi, affinity)
		}
		switch {
		case len(pending) == 0:
		case len(pending) == 1 && pending[0] && err == nil:
		case len(pending) == 2 && pending[0] && !pending[1] && err != nil:
		default:
			t.Fatalf("pending reported %v for a hand-over that ended with %v", pending, err)
		}
		if after := fuzzFDs(); after != before {
			t.Fatalf("descriptors: %d before, %d after", before, after)
		}
	})
}

// playSuccessor runs one predecessor's serve against a successor that sends hi, adopted and
// ready as they are (reading what it is sent in between), and returns serve's result, what it
// reported as pending, how often it collected its sockets (one listener, ln), and how many
// affinity messages it sent (each must decode to a valid entry; the predecessor has one).
func playSuccessor(t *testing.T, ln net.Listener, hi, adopted, ready []byte) (pending []bool, collected int32, affinity int, err error) {
	pair, perr := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if perr != nil {
		t.Fatal(perr)
	}
	conn := func(fd int) *net.UnixConn {
		file := os.NewFile(uintptr(fd), "pair")
		defer file.Close()
		c, err := net.FileConn(file)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	old, succ := conn(pair[0]), conn(pair[1])
	var collects atomic.Int32
	s := NewServer(ServerConfig{Path: "unused", Logger: quietLog(), Timeout: 2 * time.Second, ReadyTimeout: 2 * time.Second,
		Pending: func(p bool) { pending = append(pending, p) },
		Affinity: func() []AffinityEntry {
			return []AffinityEntry{{Service: service.ServicePortName{Namespace: "default", Name: "web", Port: "http"},
				Client: netip.MustParseAddr("10.244.1.5"), Endpoint: netip.MustParseAddrPort("10.244.2.3:8080"), Idle: time.Second}}
		},
		Collect: func() ([]socket, error) {
			collects.Add(1)
			raw, _ := ln.(*net.TCPListener).SyscallConn()
			var fd int
			var derr error
			_ = raw.Control(func(f uintptr) { fd, derr = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) })
			if derr != nil {
				return nil, derr
			}
			return []socket{{Entry: tcpEntry(ln), fd: fd}}, nil
		}})
	errc := make(chan error, 1)
	go func() {
		_, err := s.serve(old, new(atomic.Bool))
		_ = old.Close() // as Run does: the successor sees the end
		errc <- err
	}()

	_ = succ.SetDeadline(time.Now().Add(5 * time.Second))
	_, _, _ = succ.WriteMsgUnix(hi, nil, nil)
	var h header
	if fds, err := receive(succ, &h); err == nil {
		closeAll(fds)
		for range max(0, min(h.Chunks, 10)) {
			var entries []Entry
			fds, err := receive(succ, &entries)
			closeAll(fds)
			if err != nil {
				break
			}
		}
		for range max(0, min(h.Affinity, 10)) {
			b, fds, err := receiveRaw(succ)
			closeAll(fds)
			if err != nil {
				break
			}
			affinity++
			var chunk affinityChunk
			if err := json.Unmarshal(b, &chunk); err != nil || len(chunk.Affinity) != 1 {
				t.Fatalf("affinity message %q: %v", b, err)
			}
			var w affinityWire
			if err := json.Unmarshal(chunk.Affinity[0], &w); err != nil {
				t.Fatalf("affinity entry %q: %v", chunk.Affinity[0], err)
			}
			if _, err := w.decode(); err != nil {
				t.Fatalf("affinity entry %q does not check out: %v", chunk.Affinity[0], err)
			}
		}
	}
	_, _, _ = succ.WriteMsgUnix(adopted, nil, nil)
	_, _, _ = succ.WriteMsgUnix(ready, nil, nil)
	_ = succ.Close()
	err = <-errc
	return pending, collects.Load(), affinity, err
}
