package proxier

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// multiSocket serves one service port from several already-listening sockets (bind mode: one per
// portal IP at the service port and one per node address at the node port). They share the
// port's balancer, so round robin and affinity span all of them.
type multiSocket struct {
	socks []ProxySocket
}

var _ ProxySocket = (*multiSocket)(nil)

// openAll builds and opens one socket per address; on any failure the ones already open close.
func openAll(addrs []netip.AddrPort, build func(at netip.AddrPort) ProxySocket) (*multiSocket, error) {
	m := &multiSocket{}
	for _, a := range addrs {
		s := build(a)
		if err := s.Listen(a); err != nil {
			_ = m.Close()
			return nil, err
		}
		m.socks = append(m.socks, s)
	}
	if len(m.socks) == 0 {
		return nil, errors.New("no address to listen on")
	}
	return m, nil
}

func (m *multiSocket) Listen(netip.AddrPort) error {
	return errors.New("multiSocket listens when it is built")
}

func (m *multiSocket) Addr() netip.AddrPort { return m.socks[0].Addr() }

func (m *multiSocket) addrs() []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(m.socks))
	for _, s := range m.socks {
		if inner, ok := s.(*multiSocket); ok {
			out = append(out, inner.addrs()...)
		} else {
			out = append(out, s.Addr())
		}
	}
	return out
}

// Stats sums the members' counters.
func (m *multiSocket) Stats() flow.Stats {
	var sum flow.Stats
	for _, s := range m.socks {
		if st, ok := socketStats(s); ok {
			sum.Add(st)
		}
	}
	return sum
}

// Live lists the members' live flows.
func (m *multiSocket) Live() []flow.Info {
	var out []flow.Info
	for _, s := range m.socks {
		if o, ok := s.(observed); ok {
			out = append(out, o.Live()...)
		}
	}
	return out
}

func (m *multiSocket) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make([]error, len(m.socks))
	for i, s := range m.socks {
		wg.Go(func() { errs[i] = s.Run(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Start starts every member without a goroutine of their own when they all can (TCP on the
// io_uring engine: the members share the process's engine, so either all can or none); false,
// with nothing started, means Run.
func (m *multiSocket) Start() (bool, error) {
	starters := make([]starter, 0, len(m.socks))
	for _, s := range m.socks {
		st, ok := s.(starter)
		if !ok {
			return false, nil
		}
		starters = append(starters, st)
	}
	var errs []error
	for i, st := range starters {
		started, err := st.Start()
		switch {
		case !started && i == 0:
			return false, nil
		case !started:
			errs = append(errs, fmt.Errorf("socket %s did not start where %s did", m.socks[i].Addr(), m.socks[0].Addr()))
		case err != nil:
			errs = append(errs, err)
		}
	}
	return true, errors.Join(errs...)
}

func (m *multiSocket) Close() error {
	var errs []error
	for _, s := range m.socks {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

func (m *multiSocket) Shutdown() {
	for _, s := range m.socks {
		if sd, ok := s.(shutdowner); ok {
			sd.Shutdown()
		} else {
			_ = s.Close()
		}
	}
}

func (m *multiSocket) DropEndpoint(ep netip.AddrPort) int {
	n := 0
	for _, s := range m.socks {
		n += s.DropEndpoint(ep)
	}
	return n
}

func (m *multiSocket) DrainEndpoint(ep netip.AddrPort, grace time.Duration) int {
	n := 0
	for _, s := range m.socks {
		if d, ok := s.(drainer); ok {
			n += d.DrainEndpoint(ep, grace)
		}
	}
	return n
}
