package iptables

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// DefaultCounterInterval is how long KernelCounters reuses one read of the counters.
const DefaultCounterInterval = 5 * time.Second

// CounterSaver is the Runner method KernelCounters needs: `iptables-save -c -t table`, every
// rule prefixed with its [packets:bytes]. ExecRunner and Fake have it.
type CounterSaver interface {
	SaveCounters(ctx context.Context, fam portal.Family, table string) ([]byte, error)
}

// SaveCounters implements CounterSaver.
func (r *ExecRunner) SaveCounters(ctx context.Context, fam portal.Family, table string) ([]byte, error) {
	return r.run(ctx, nil, r.binary(fam, "save"), "-c", "-t", table)
}

// KernelCounters returns the packet and byte counters of the DNAT rule of every KUBE-SEP chain:
// per endpoint of each kernel-path port, what the kernel sent there. One `iptables-save -c -t
// nat` per family, at most once per CounterInterval (later calls get the same figures), and none
// at all while no port is on the kernel path, so a scrape or a debug page costs nothing on a
// proxy-only node.
func (p *Portals) KernelCounters(ctx context.Context) ([]portal.EndpointCounter, error) {
	saver, ok := p.runner.(CounterSaver)
	if !ok {
		return nil, errors.New("kernel counters: the iptables runner cannot read counters")
	}
	p.counterMu.Lock()
	defer p.counterMu.Unlock()
	p.viewMu.Lock()
	kernelPorts := p.kernelPorts
	var fams []portal.Family
	for _, fam := range portal.Families {
		if len(p.view[fam]) > 0 {
			fams = append(fams, fam)
		}
	}
	p.viewMu.Unlock()
	if kernelPorts == 0 {
		p.counters, p.countersAt = nil, time.Time{}
		return nil, nil
	}
	now := p.cfg.Clock.Now()
	if !p.countersAt.IsZero() && now.Sub(p.countersAt) < p.cfg.CounterInterval {
		return p.counters, nil
	}
	var out []portal.EndpointCounter
	var errs []error
	for _, fam := range fams {
		data, err := saver.SaveCounters(ctx, fam, tableNAT)
		if err != nil {
			errs = append(errs, fmt.Errorf("kernel counters %s: %w", fam, err))
			continue
		}
		out = append(out, parseEndpointCounters(data)...)
	}
	p.counters, p.countersAt = out, now
	return out, errors.Join(errs...)
}

// parseEndpointCounters reads the DNAT rules of the KUBE-SEP chains from `iptables-save -c`:
//
//	[12:720] -A KUBE-SEP-X -p tcp -m comment --comment "ns/web:http" -m tcp -j DNAT --to-destination 10.244.1.5:8080
func parseEndpointCounters(data []byte) []portal.EndpointCounter {
	var out []portal.EndpointCounter
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		counts, rule, ok := strings.Cut(line, " -A "+kernel.PrefixEndpoint)
		if !ok || !strings.HasPrefix(counts, "[") {
			continue
		}
		_, dst, ok := strings.Cut(rule, " -j DNAT --to-destination ")
		if !ok {
			continue
		}
		ep, err := netip.ParseAddrPort(strings.Fields(dst)[0])
		if err != nil {
			continue
		}
		pk, by, ok := strings.Cut(strings.Trim(counts, "[]"), ":")
		if !ok {
			continue
		}
		c := portal.EndpointCounter{Chain: kernel.PrefixEndpoint + strings.Fields(rule)[0], Endpoint: ep}
		c.Packets, _ = strconv.ParseUint(pk, 10, 64)
		c.Bytes, _ = strconv.ParseUint(by, 10, 64)
		if comment, ok := commentOf(rule); ok {
			c.Name, _ = parsePortName(comment)
		}
		if _, rest, ok := strings.Cut(rule, " -p "); ok {
			c.Protocol = service.Protocol(strings.ToUpper(strings.Fields(rest)[0]))
		}
		out = append(out, c)
	}
	return out
}

// commentOf returns the quoted --comment of a rule body.
func commentOf(rule string) (string, bool) {
	_, rest, ok := strings.Cut(rule, `--comment "`)
	if !ok {
		return "", false
	}
	s, _, ok := strings.Cut(rest, `"`)
	return s, ok
}
