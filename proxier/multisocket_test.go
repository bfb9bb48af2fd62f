package proxier

import (
	"context"
	"net/netip"
	"testing"
)

// startable is a socket that can start on its own (can) or not; it counts its Starts.
type startable struct {
	can    bool
	starts int
}

func (s *startable) Listen(netip.AddrPort) error     { return nil }
func (s *startable) Addr() netip.AddrPort            { return netip.MustParseAddrPort("127.0.0.1:80") }
func (s *startable) Run(context.Context) error       { return nil }
func (s *startable) Close() error                    { return nil }
func (s *startable) DropEndpoint(netip.AddrPort) int { return 0 }
func (s *startable) Start() (bool, error)            { s.starts++; return s.can, nil }

// plain is a socket without Start.
type plain struct{ startable }

func (p *plain) Start() {}

// A multiSocket starts its members on their own only when every one can; otherwise it starts none
// and is left to Run.
func TestMultiSocketStart(t *testing.T) {
	a, b := &startable{can: true}, &startable{can: true}
	if started, err := (&multiSocket{socks: []ProxySocket{a, b}}).Start(); !started || err != nil || a.starts != 1 || b.starts != 1 {
		t.Errorf("members that can: Start = %v, %v; starts %d, %d, want true and one each", started, err, a.starts, b.starts)
	}
	c, d := &startable{}, &startable{}
	if started, err := (&multiSocket{socks: []ProxySocket{c, d}}).Start(); started || err != nil || d.starts != 0 {
		t.Errorf("members that cannot: Start = %v, %v; second started %d times, want false and none", started, err, d.starts)
	}
	e := &startable{can: true}
	if started, _ := (&multiSocket{socks: []ProxySocket{e, &plain{}}}).Start(); started || e.starts != 0 {
		t.Errorf("a member without Start: Start = %v, first started %d times, want false and none", started, e.starts)
	}
}
