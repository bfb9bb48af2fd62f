package handover

// Address plan: listeners on 127.0.0.1 with kernel-chosen ports; the hand-over socket in the
// test's temporary directory (made 0755 where another user must reach it). "Another user" is
// uid/gid 65534 (nobody), taken by one locked OS thread only (setresuid applies per thread in
// Linux; the Go runtime ends the thread with its goroutine), so the test process stays root.

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

const nobody = 65534

// asNobody runs fn on an OS thread whose effective user and group are nobody's: what it
// creates, binds or connects is nobody's (file owner, SO_PEERCRED). Needs root.
func asNobody(t *testing.T, fn func()) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Unavailable(t, "acting as another user needs root")
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: this thread's credentials are not the process's
		keep := ^uintptr(0)    // -1: leave unchanged
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, keep, nobody, keep); e != 0 {
			errc <- e
			return
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, nobody, keep); e != 0 {
			errc <- e
			return
		}
		fn()
		errc <- nil
	}()
	if err := <-errc; err != nil {
		t.Fatalf("switch the thread to uid %d: %v", nobody, err)
	}
}

// openDir is a temporary directory others may enter (not write): a socket in it is reachable by
// nobody as far as the socket file's own mode allows.
func openDir(t *testing.T) string {
	return reachableDir(t, 0o755)
}

// reachableDir is a temporary directory of mode perm whose parent (testing's per-test directory,
// 0700) others may enter.
func reachableDir(t *testing.T, perm os.FileMode) string {
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(dir, perm); err != nil {
		t.Fatal(err)
	}
	return dir
}

// countFDs is the number of descriptors this process holds.
func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// listenTCP is a listener on loopback to hand over.
func listenTCP(t *testing.T) *net.TCPListener {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln.(*net.TCPListener)
}

// dupFD duplicates the descriptor of a listener or file (the caller's copy to send).
func dupFD(t *testing.T, sc syscall.Conn) int {
	t.Helper()
	raw, err := sc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	var derr error
	if err := raw.Control(func(f uintptr) { fd, derr = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) }); err != nil || derr != nil {
		t.Fatalf("dup: %v %v", err, derr)
	}
	return fd
}

// fakePredecessor answers one successor on ln with the raw messages given, each sent with the
// descriptors of the same index (closed here afterwards), then waits for the successor to hang
// up. done is closed when it has finished.
func fakePredecessor(ln *net.UnixListener, msgs [][]byte, fds [][]int) (done <-chan struct{}) {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		defer func() {
			for _, f := range fds {
				closeAll(f)
			}
		}()
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(testenv.WaitTimeout))
		var h hello
		if _, err := receive(c, &h); err != nil {
			return
		}
		for i, m := range msgs {
			var oob []byte
			if i < len(fds) && len(fds[i]) > 0 {
				oob = unix.UnixRights(fds[i]...)
			}
			if _, _, err := c.WriteMsgUnix(m, oob, nil); err != nil {
				return
			}
		}
		buf := make([]byte, maxMessage)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
		}
	}()
	return ch
}

func manifest(t *testing.T, entries ...Entry) []byte {
	t.Helper()
	b, err := json.Marshal(entries)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func tcpEntry(ln net.Listener) Entry {
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	return newEntry("tcp", IPv4, ap)
}

// TestHandOverPeers checks who may take the listening sockets and whose sockets are taken.
func TestHandOverPeers(t *testing.T) {
	t.Run("the socket file is the owner's alone: another user cannot connect", func(t *testing.T) {
		path := filepath.Join(openDir(t), "handover.sock")
		serveOnce(t, path)
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 || st.Mode().Type() != os.ModeSocket {
			t.Fatalf("socket file mode %v, want a socket with 0600", st.Mode())
		}
		var dialErr error
		asNobody(t, func() { _, dialErr = net.Dial("unixpacket", path) })
		if !errors.Is(dialErr, unix.EACCES) {
			t.Fatalf("connect as uid %d = %v, want EACCES", nobody, dialErr)
		}
	})

	t.Run("a successor of another user gets nothing and the predecessor keeps serving", func(t *testing.T) {
		path := filepath.Join(openDir(t), "handover.sock")
		var collected atomic.Int32
		s := NewServer(ServerConfig{Path: path, Logger: quietLog(), Collect: func() ([]socket, error) {
			collected.Add(1)
			return Collect()
		}})
		if err := s.Listen(); err != nil {
			t.Fatal(err)
		}
		// Past the file's mode (as if it were opened up by hand): the credentials still refuse.
		if err := os.Chmod(path, 0o666); err != nil {
			t.Fatal(err)
		}
		handedOff, done := make(chan struct{}), make(chan struct{})
		ctx, cancel := context.WithCancel(context.Background())
		go func() { defer close(done); s.Run(ctx, func() { close(handedOff) }) }()
		t.Cleanup(func() { cancel(); <-done })

		var c *net.UnixConn
		var dialErr error
		asNobody(t, func() {
			var nc net.Conn
			if nc, dialErr = net.Dial("unixpacket", path); dialErr == nil {
				c = nc.(*net.UnixConn)
			}
		})
		if dialErr != nil {
			t.Fatalf("connect as uid %d through a 0666 file: %v", nobody, dialErr)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(testenv.WaitTimeout))
		// The predecessor hangs up at once: the hello fails (EPIPE) or the answer is the end.
		if err := send(c, hello{Version: Version}, nil); err == nil {
			var h header
			fds, err := receive(c, &h)
			closeAll(fds)
			if err == nil {
				t.Fatalf("a successor of uid %d got a header %+v and %d descriptors", nobody, h, len(fds))
			}
		}
		if n := collected.Load(); n != 0 {
			t.Fatalf("the predecessor collected its sockets %d times for a peer of another user", n)
		}
		// The predecessor still serves its own user.
		in := receiveOK(t, path)
		if _, err := in.Ready(); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, handedOff, "the hand-over to a successor of the same user")
	})

	t.Run("a predecessor of another user is refused before anything is received", func(t *testing.T) {
		path := filepath.Join(reachableDir(t, 0o777), "handover.sock") // nobody binds its socket here
		var ln *net.UnixListener
		var lerr error
		asNobody(t, func() { ln, lerr = net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"}) })
		if lerr != nil {
			t.Fatal(lerr)
		}
		defer ln.Close()
		if err := os.Chmod(path, 0o666); err != nil {
			t.Fatal(err)
		}
		victim := listenTCP(t)
		before := countFDs(t)
		done := fakePredecessor(ln, [][]byte{[]byte(`{"version":1,"sockets":1,"chunks":1}`), manifest(t, tcpEntry(victim))},
			[][]int{nil, {dupFD(t, victim)}})
		_, err := Receive(t.Context(), path, 5*time.Second)
		if !errors.Is(err, ErrPeerUser) || errors.Is(err, ErrNoPredecessor) {
			t.Fatalf("Receive from a predecessor of uid %d = %v, want ErrPeerUser", nobody, err)
		}
		<-done
		if after := countFDs(t); after != before {
			t.Errorf("descriptors: %d before, %d after a refused hand-over", before, after)
		}
	})
}

// TestHandOverManifestChecked: a predecessor (of the same user, but buggy, of another version or
// hostile) must not make this process take a descriptor for what it is not. The hand-over fails
// whole, every descriptor received is closed, and the caller starts as without one.
func TestHandOverManifestChecked(t *testing.T) {
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	a, b := listenTCP(t), listenTCP(t)
	udp, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	header1 := []byte(`{"version":1,"sockets":1,"chunks":1}`)
	tests := []struct {
		name string
		msgs func() ([][]byte, [][]int)
		want string
	}{
		{"a file sent as a listening socket", func() ([][]byte, [][]int) {
			return [][]byte{header1, manifest(t, tcpEntry(a))}, [][]int{nil, {dupFD(t, devnull)}}
		}, "not a listening socket"},
		{"another listener than the entry names", func() ([][]byte, [][]int) {
			return [][]byte{header1, manifest(t, tcpEntry(a))}, [][]int{nil, {dupFD(t, b)}}
		}, "the descriptor is tcp/" + b.Addr().String()},
		{"a UDP socket sent as TCP", func() ([][]byte, [][]int) {
			e := tcpEntry(a)
			e.Port = uint16(udp.LocalAddr().(*net.UDPAddr).Port)
			return [][]byte{header1, manifest(t, e)}, [][]int{nil, {dupFD(t, udp)}}
		}, "the descriptor is udp/"},
		{"more chunks announced than the sockets need", func() ([][]byte, [][]int) {
			return [][]byte{[]byte(`{"version":1,"sockets":1,"chunks":1000000000}`)}, nil
		}, "header announces"},
		{"a negative count", func() ([][]byte, [][]int) {
			return [][]byte{[]byte(`{"version":1,"sockets":-1,"chunks":0}`)}, nil
		}, "header announces"},
		{"fewer descriptors than entries", func() ([][]byte, [][]int) {
			return [][]byte{[]byte(`{"version":1,"sockets":2,"chunks":1}`), manifest(t, tcpEntry(a), tcpEntry(b))}, [][]int{nil, {dupFD(t, a)}}
		}, "1 descriptors for 2 manifest entries"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "handover.sock")
			ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			before := countFDs(t)
			msgs, fds := tc.msgs()
			done := fakePredecessor(ln, msgs, fds)
			in, err := Receive(t.Context(), path, 5*time.Second)
			if err == nil {
				in.Close()
				t.Fatalf("Receive accepted it: %d sockets", in.Received())
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Receive = %v, want an error saying %q", err, tc.want)
			}
			<-done
			if after := countFDs(t); after != before {
				t.Errorf("descriptors: %d before, %d after a refused hand-over", before, after)
			}
		})
	}
}

// TestHandOverSocketPath: where the socket file goes, and what Listen does with what is there.
func TestHandOverSocketPath(t *testing.T) {
	t.Run("a directory others can write is refused", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Chmod(dir, 0o777); err != nil {
			t.Fatal(err)
		}
		err := NewServer(ServerConfig{Path: filepath.Join(dir, "handover.sock"), Logger: quietLog()}).Listen()
		if !errors.Is(err, ErrUnsafeDir) {
			t.Fatalf("Listen in a 0777 directory = %v, want ErrUnsafeDir", err)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Errorf("Listen left %d files in the directory it refused", len(ents))
		}
	})

	t.Run("a sticky world-writable directory is accepted", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Chmod(dir, 0o777|os.ModeSticky); err != nil {
			t.Fatal(err)
		}
		s := NewServer(ServerConfig{Path: filepath.Join(dir, "handover.sock"), Logger: quietLog()})
		if err := s.Listen(); err != nil {
			t.Fatalf("Listen in a sticky directory (like /tmp): %v", err)
		}
		s.close()
	})

	t.Run("a directory of another user is refused", func(t *testing.T) {
		if os.Geteuid() != 0 {
			testenv.Unavailable(t, "chown needs root")
		}
		dir := t.TempDir()
		if err := os.Chown(dir, nobody, nobody); err != nil {
			t.Fatal(err)
		}
		err := NewServer(ServerConfig{Path: filepath.Join(dir, "handover.sock"), Logger: quietLog()}).Listen()
		if !errors.Is(err, ErrUnsafeDir) || !strings.Contains(err.Error(), "uid "+strconv.Itoa(nobody)) {
			t.Fatalf("Listen in a directory of uid %d = %v, want ErrUnsafeDir naming the owner", nobody, err)
		}
	})

	t.Run("a symlink at the path is replaced, its target untouched", func(t *testing.T) {
		dir := t.TempDir()
		target := filepath.Join(dir, "precious")
		if err := os.WriteFile(target, []byte("keep me"), 0o644); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, "handover.sock")
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
		serveOnce(t, path)
		st, err := os.Lstat(path)
		if err != nil || st.Mode().Type() != os.ModeSocket {
			t.Fatalf("path after Listen: %v %v, want the socket itself", st, err)
		}
		got, err := os.ReadFile(target)
		tst, serr := os.Stat(target)
		if err != nil || string(got) != "keep me" || serr != nil || tst.Mode().Perm() != 0o644 {
			t.Errorf("symlink target after Listen: %q %v mode %v; want it untouched", got, err, tst.Mode())
		}
		in := receiveOK(t, path)
		if _, err := in.Ready(); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("a directory at the path fails clearly and stays", func(t *testing.T) {
		dir := t.TempDir()
		path := filepath.Join(dir, "handover.sock")
		if err := os.Mkdir(path, 0o700); err != nil {
			t.Fatal(err)
		}
		err := NewServer(ServerConfig{Path: path, Logger: quietLog()}).Listen()
		if err == nil || !strings.Contains(err.Error(), path) {
			t.Fatalf("Listen over a directory = %v, want an error naming %s", err, path)
		}
		if st, err := os.Stat(path); err != nil || !st.IsDir() {
			t.Errorf("the directory at the path is gone: %v", err)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 1 {
			t.Errorf("Listen left a temporary file: %d entries", len(ents))
		}
	})
}

// TestServeWantsItsOwnReady: the predecessor stops accepting only on a ready message of its own.
// Found by FuzzServe (seed, testdata/fuzz/FuzzServe/adoption_says_ready): the ready was decoded
// into the adoption's struct, so an adoption that also said "ready":true followed by any message
// that decoded to nothing ("null", "{}") handed over.
func TestServeWantsItsOwnReady(t *testing.T) {
	ln := listenTCP(t)
	for _, tc := range []struct {
		name           string
		adopted, ready string
		handsOver      bool
	}{
		{"adoption then ready hands over", `{"adopted":1}`, `{"ready":true}`, true},
		{"an adoption that says ready, then null, does not", `{"adopted":1,"ready":true}`, `null`, false},
		{"an adoption that says ready, then an empty object, does not", `{"adopted":1,"ready":true}`, `{}`, false},
		{"a ready without an adoption does not", `{"ready":true}`, `{"ready":true}`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := playSuccessor(t, ln, []byte(`{"version":1}`), []byte(tc.adopted), []byte(tc.ready))
			if (err == nil) != tc.handsOver {
				t.Fatalf("serve = %v; want a hand-over %v", err, tc.handsOver)
			}
		})
	}
}
