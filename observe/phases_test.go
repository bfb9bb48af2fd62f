package observe

import (
	"net/url"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// TestRingSkipsUnwantedPhases: an observer's phase filter is applied in the ring, before the
// copy: next steps over the events of other phases and hands out only the wanted ones, in order.
func TestRingSkipsUnwantedPhases(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 16})
	rec := h.ForPort(&flow.Port{Namespace: "ns", Service: "web"})
	for id := uint64(1); id <= 3; id++ {
		for _, ph := range []flow.Phase{flow.PhaseStart, flow.PhaseDial, flow.PhaseFirstByte, flow.PhaseEnd} {
			rec.Record(&flow.Event{ID: id, Phase: ph})
		}
	}
	for _, tc := range []struct {
		query string
		want  []flow.Phase
	}{
		{"phase=end", []flow.Phase{flow.PhaseEnd}},
		{"phase=start,end", []flow.Phase{flow.PhaseStart, flow.PhaseEnd}},
		{"not-phase=dial,first-byte", []flow.Phase{flow.PhaseStart, flow.PhaseEnd}},
		{"phase=start,dial&not-phase=dial", []flow.Phase{flow.PhaseStart}},
		{"namespace=ns", []flow.Phase{flow.PhaseStart, flow.PhaseDial, flow.PhaseFirstByte, flow.PhaseEnd}},
	} {
		q, _ := url.ParseQuery(tc.query)
		f, err := ParseFilter(q)
		if err != nil {
			t.Fatalf("%s: %v", tc.query, err)
		}
		var cursor uint64
		var e flow.Event
		var got []flow.Phase
		var ids []uint64
		for {
			ok, lost := h.next(&cursor, &e, f.phases)
			if lost != 0 {
				t.Fatalf("%s: lost %d", tc.query, lost)
			}
			if !ok {
				break
			}
			if id := e.ID; len(ids) == 0 || ids[len(ids)-1] != id {
				ids = append(ids, id)
			}
			if e.ID == 1 {
				got = append(got, e.Phase)
			}
		}
		if cursor != 12 {
			t.Errorf("%s: cursor %d after the ring, want 12", tc.query, cursor)
		}
		if len(got) != len(tc.want) || len(ids) != 3 {
			t.Errorf("%s: flow 1's phases %v (flows %v), want %v", tc.query, got, ids, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("%s: flow 1's phases %v, want %v", tc.query, got, tc.want)
				break
			}
		}
	}
}
