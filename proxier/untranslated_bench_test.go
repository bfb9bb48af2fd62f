package proxier

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// BenchmarkSync10000UDPPorts measures the sync of 10,000 UDP node-port service ports (fake sockets,
// portals and conntrack), where clearUntranslated does its per-port bookkeeping: a sync with
// nothing changed, and one where ns/u42 loses and regains its only endpoint in turn (every other
// sync begins to steer it again and clears its untranslated entries).
//
//	go test -run XXX -bench BenchmarkSync10000UDPPorts -benchtime 200x ./proxier/
func BenchmarkSync10000UDPPorts(b *testing.B) {
	slice := func(i int, eps ...sliceEP) *discovery.EndpointSlice {
		return makeSlice("ns", fmt.Sprintf("u%d", i), "a", discovery.AddressTypeIPv4,
			[]discovery.EndpointPort{{Port: ptr(int32(5353)), Protocol: ptr(v1.ProtocolUDP), Name: ptr("")}}, eps...)
	}
	setup := func(b *testing.B) *fakeEnv {
		e := newFakeEnv(b, nil)
		e.synced()
		for i := range 10000 {
			ip := fmt.Sprintf("10.96.%d.%d", i/250, i%250+1)
			e.p.OnServiceAdd(makeService("ns", fmt.Sprintf("u%d", i), ip, func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = int32(30000 + i%2700)
			}, udpPort("", 53)))
			e.p.OnEndpointSliceAdd(slice(i, sliceEP{addr: "10.244.0.1"}))
		}
		e.sync()
		return e
	}
	b.Run("no_change", func(b *testing.B) {
		e := setup(b)
		b.ReportAllocs()
		for b.Loop() {
			e.sync()
		}
	})
	b.Run("endpoint_flap", func(b *testing.B) {
		e := setup(b)
		with, without := slice(42, sliceEP{addr: "10.244.0.1"}), slice(42)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if i%2 == 0 {
				e.p.OnEndpointSliceUpdate(with, without)
			} else {
				e.p.OnEndpointSliceUpdate(without, with)
			}
			i++
			e.sync()
		}
	})
}

// BenchmarkClearUntranslatedUDPBookkeeping isolates what clearUntranslated adds to a sync of
// 10,000 UDP ports when none begins to steer (the common sync): a map lookup and store per port.
//
//	go test -run XXX -bench BenchmarkClearUntranslatedUDPBookkeeping ./proxier/
func BenchmarkClearUntranslatedUDPBookkeeping(b *testing.B) {
	e := newFakeEnv(b, nil)
	e.synced()
	for i := range 10000 {
		e.p.OnServiceAdd(makeService("ns", fmt.Sprintf("u%d", i), fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), nil, udpPort("", 53)))
	}
	e.sync()
	specs := e.p.paths.specs()
	b.ReportAllocs()
	for b.Loop() {
		e.p.paths.clearUntranslated(specs)
	}
}
