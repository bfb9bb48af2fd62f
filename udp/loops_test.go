package udp

// Address plan: see helpers_test.go (proxy and clients on 127.0.0.1, endpoints on 127.0.0.2).

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// sessionsPerShard counts each loop's sessions.
func sessionsPerShard(p *Proxy) []int {
	var out []int
	for _, s := range p.shardList() {
		s.mu.Lock()
		out = append(out, len(s.sessions))
		s.mu.Unlock()
	}
	return out
}

// TestLoopsSpreadClientsAndKeepEachOnOne: with several loops, the kernel spreads the clients over
// the sockets of the group, and every datagram of one client reaches the same loop: one session
// per client, whatever the number of its datagrams.
func TestLoopsSpreadClientsAndKeepEachOnOne(t *testing.T) {
	const clients, rounds = 32, 5
	p := startProxy(t, newFakePicker(echoServer(t, "127.0.0.2", "e:")), Config{Loops: 2, Logger: quietLogger()})
	var cs []*client
	for range clients {
		cs = append(cs, newClient(t, "127.0.0.1", p.Addr()))
	}
	for r := range rounds {
		for i, c := range cs {
			msg := fmt.Sprintf("%d/%d", i, r)
			if got := c.roundTrip(msg); got != "e:"+msg {
				t.Fatalf("client %d round %d: reply %q, want %q", i, r, got, "e:"+msg)
			}
		}
	}
	if st := p.Stats(); st.Total != clients || st.Active != clients {
		t.Errorf("Stats() = Total %d Active %d, want %d each (one session per client)", st.Total, st.Active, clients)
	}
	per := sessionsPerShard(p)
	if len(per) != 2 || per[0] == 0 || per[1] == 0 {
		t.Errorf("sessions per loop = %v, want both loops serving some of the %d clients", per, clients)
	}
}

// TestLoopsSplitTheSessionCap: each loop holds at most its share of MaxSessions, so a flood costs
// at most MaxSessions descriptors in all.
func TestLoopsSplitTheSessionCap(t *testing.T) {
	const maxSessions, sources = 8, 64
	p := startProxy(t, newFakePicker(echoServer(t, "127.0.0.2", "")), Config{MaxSessions: maxSessions, Loops: 2, Logger: quietLogger()})
	for i := range sources {
		c := newClient(t, fmt.Sprintf("127.0.%d.%d", 10+i/250, 1+i%250), p.Addr())
		c.roundTrip("x")
		c.conn.Close()
	}
	for i, n := range sessionsPerShard(p) {
		if n > maxSessions/2 {
			t.Errorf("loop %d holds %d sessions, want at most %d", i, n, maxSessions/2)
		}
	}
	if st := p.Stats(); st.Active > maxSessions {
		t.Errorf("Active = %d, want at most %d", st.Active, maxSessions)
	}
}

// TestLoopsHandOver: a successor adopts every socket of its predecessor's group (and binds none
// of its own when they are enough), or adds members to the one socket of a predecessor that ran
// one loop; either way, once the predecessor is released, the successor answers every client.
func TestLoopsHandOver(t *testing.T) {
	for _, tt := range []struct {
		name                string
		oldLoops, newLoops  int
		wantShards, wantFDs int // the successor's loops, and how many of its sockets are adopted
	}{
		{"two sockets to two loops", 2, 2, 2, 2},
		{"one socket grows to two loops", 1, 2, 2, 1},
		{"two sockets to a one-loop successor: it serves both", 2, 1, 2, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			backend := echoServer(t, "127.0.0.2", "e:")
			old := startProxy(t, newFakePicker(backend), Config{Loops: tt.oldLoops, Logger: quietLogger()})
			var handed []int
			for _, s := range old.shardList() {
				s.mu.Lock()
				fd, err := unix.Dup(s.lfd)
				s.mu.Unlock()
				if err != nil {
					t.Fatal(err)
				}
				handed = append(handed, fd)
			}
			adopted := 0
			succ := New(testService, newFakePicker(backend), Config{Loops: tt.newLoops, Logger: quietLogger(),
				Adopt: func(a netip.AddrPort) (int, bool) {
					if a != old.Addr() || len(handed) == 0 {
						return -1, false
					}
					fd := handed[0]
					handed = handed[1:]
					adopted++
					return fd, true
				}})
			if err := succ.Listen(old.Addr()); err != nil {
				t.Fatalf("successor Listen: %v", err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- succ.Run(ctx) }()
			t.Cleanup(func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("successor Run: %v", err)
				}
			})
			if got := len(succ.shardList()); got != tt.wantShards || adopted != tt.wantFDs || !succ.Adopted() {
				t.Errorf("successor: %d loops, %d adopted sockets, Adopted() %t; want %d, %d, true",
					got, adopted, succ.Adopted(), tt.wantShards, tt.wantFDs)
			}
			old.Release()
			for i := range 16 {
				c := newClient(t, "127.0.0.1", old.Addr())
				msg := fmt.Sprintf("after-%d", i)
				if got := c.roundTrip(msg); got != "e:"+msg {
					t.Errorf("client %d after the hand-over: %q, want %q", i, got, "e:"+msg)
				}
			}
			if st := old.Stats(); st.Total != 0 {
				t.Errorf("the released predecessor opened %d sessions, want 0", st.Total)
			}
		})
	}
}
