package observe

import (
	"encoding/json"
	"errors"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// jsonEvents cover every field of Flow and Pick, and strings that need escaping.
func jsonEvents() []*flow.Event {
	ap := netip.MustParseAddrPort
	odd := &flow.Port{Namespace: "ns", Service: "svc", Port: "hé<&>\"\\\x01", Protocol: flow.UDP, Node: "n\u2028"}
	full := *webEvent(1)
	full.Port = webPort
	full.Phase, full.Source = flow.PhaseEnd, ap("10.0.0.1:34567")
	full.Pick = flow.Pick{Algorithm: flow.LeastConnections, Why: flow.Affinity | flow.Retry | flow.Terminating}
	full.ConnectLatency, full.FirstByte, full.Duration = 1500*time.Microsecond, 2*time.Millisecond, 3*time.Second
	full.BytesToEndpoint, full.BytesToClient, full.PacketsToEndpoint, full.PacketsToClient = 1, 2, 3, 4
	full.DialAttempts, full.End, full.Err = 2, flow.EndpointReset, errors.New("read client->endpoint: \"reset\" <&> \n ü \xff")
	return []*flow.Event{
		&full,
		{Phase: flow.PhaseStart, ID: 2, Time: t0.Add(123456789), Port: kernPort, Local: ap("[2001:db8::1]:443"),
			Info: flow.Info{Client: ap("[2001:db8::2]:5000"), Endpoint: ap("[2001:db8::3]:8443")}},
		{}, // no port, zero time
		{Phase: flow.PhaseHeld, ID: 4, Time: t0, Port: webPort, Info: flow.Info{Client: ap("10.0.1.5:1")}},
		{Phase: flow.PhaseDial, ID: 5, Time: t0.In(time.FixedZone("x", 3600)), Port: odd,
			Info: flow.Info{Client: ap("[fe80::1%eth0]:80"), Endpoint: ap("[fe80::2%\"x]:80")}},
		{Phase: flow.PhaseEnd, ID: 6, Time: t0, Port: dnsPort, Local: ap("10.96.0.53:53"),
			Info: flow.Info{Client: ap("10.0.2.9:5353"), Endpoint: ap("10.244.2.3:53"), End: flow.Evicted, PacketsToEndpoint: 9}},
	}
}

// The hand-written encoder writes exactly what encoding/json writes for Item{Flow: NewFlow(e)}.
func TestAppendFlowItemIsJSON(t *testing.T) {
	set := map[string]bool{} // the Flow and Pick fields some event sets
	for _, e := range jsonEvents() {
		r := &fakeResolver{}
		f := NewFlow(e, r)
		want, err := json.Marshal(Item{Flow: f})
		if err != nil {
			t.Fatal(err)
		}
		got := appendFlowItem(nil, &view{e: e, r: &fakeResolver{}})
		if diff := cmp.Diff(string(want), string(got)); diff != "" {
			t.Errorf("event %d (-encoding/json +appendFlowItem):\n%s", e.ID, diff)
		}
		markSet(set, "", reflect.ValueOf(*f))
	}
	for _, typ := range []reflect.Type{reflect.TypeFor[Flow](), reflect.TypeFor[Pick]()} {
		for f := range typ.Fields() {
			if !set[typ.Name()+"."+f.Name] {
				t.Errorf("no test event sets %s.%s: add one, and teach appendFlowItem the field", typ.Name(), f.Name)
			}
		}
	}
}

func markSet(set map[string]bool, _ string, v reflect.Value) {
	for i := range v.NumField() {
		f := v.Field(i)
		if f.IsZero() {
			continue
		}
		set[v.Type().Name()+"."+v.Type().Field(i).Name] = true
		if f.Kind() == reflect.Pointer && f.Elem().Kind() == reflect.Struct {
			markSet(set, "", f.Elem())
		}
	}
}

// FuzzAppendFlowItem: whatever the names and the error say, the hand-written encoder writes
// what encoding/json writes.
func FuzzAppendFlowItem(f *testing.F) {
	f.Add("default", "web", "http", "node-a", "read: connection reset", uint8(4), uint8(3), int64(1234567))
	f.Add("ns\u2028", "<svc>", "é", "\x00\xff", "\"quoted\" & \\", uint8(0), uint8(255), int64(-1))
	f.Fuzz(func(t *testing.T, ns, svc, port, node, errText string, phase, why uint8, nanos int64) {
		e := *jsonEvents()[0]
		e.Port = &flow.Port{Namespace: ns, Service: svc, Port: port, Node: node}
		e.Phase, e.Pick.Why, e.Err = flow.Phase(phase%uint8(flow.NumPhases+1)), flow.PickWhy(why), errors.New(errText)
		e.Time, e.Duration = time.Unix(0, nanos).UTC(), time.Duration(nanos)
		want, err := json.Marshal(Item{Flow: NewFlow(&e, nil)})
		if err != nil {
			t.Skip() // encoding/json refuses it (a time out of its range): so does the stream
		}
		if got := appendFlowItem(nil, &view{e: &e}); string(got) != string(want) {
			t.Errorf("appendFlowItem:\n%s\nencoding/json:\n%s", got, want)
		}
	})
}
