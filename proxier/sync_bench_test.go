package proxier

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// addServices adds n services ns/s<i>, cluster IPs from 10.96.0.1 on, each with TCP port 80 and
// one slice of eps on port 8080.
func addServices(e *fakeEnv, n int, eps ...sliceEP) {
	for i := range n {
		ip := fmt.Sprintf("10.96.%d.%d", i/250, i%250+1)
		e.p.OnServiceAdd(makeService("ns", fmt.Sprintf("s%d", i), ip, nil, tcpPort("", 80)))
		e.p.OnEndpointSliceAdd(makeSlice("ns", fmt.Sprintf("s%d", i), "a", discovery.AddressTypeIPv4,
			[]discovery.EndpointPort{{Port: ptr(int32(8080)), Protocol: ptr(v1.ProtocolTCP), Name: ptr("")}},
			eps...))
	}
}

// BenchmarkSync10000Ports measures the sync with fake sockets and portals at 10,000 service
// ports: the first sync (every socket opens) and a sync of one change among them.
func BenchmarkSync10000Ports(b *testing.B) {
	fill := func(e *fakeEnv) {
		e.synced()
		addServices(e, 10000, sliceEP{addr: "10.244.0.1"})
	}
	b.Run("first_sync", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			b.StopTimer()
			e := newFakeEnv(b, nil)
			fill(e)
			b.StartTimer()
			e.sync()
		}
	})
	b.Run("one_change", func(b *testing.B) {
		e := newFakeEnv(b, nil)
		fill(e)
		e.sync()
		benchOneChange(b, e)
	})
}

// benchOneChange times syncs of one change among the services addServices added: ns/s42 is
// deleted and added back in turn.
func benchOneChange(b *testing.B, e *fakeEnv) {
	svc := makeService("ns", "s42", "10.96.0.43", nil, tcpPort("", 80))
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if i%2 == 0 {
			e.p.OnServiceDelete(svc)
		} else {
			e.p.OnServiceAdd(svc)
		}
		i++
		e.sync()
	}
}
