package iptables

import (
	"context"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Address plan: as in golden_test.go (node 192.168.1.10, cluster IPs 10.96.0.0/16).

// everyRestore runs check after each restore the portals make, on the fake's tables.
type everyRestore struct {
	*Fake
	check func(step int)
	steps int
}

func (e *everyRestore) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	err := e.Fake.Restore(ctx, fam, data)
	e.steps++
	e.check(e.steps)
	return err
}

// TestRefusalSwapLeavesNoGap: a service port changing between refused (no endpoints: a filter
// REJECT) and served (a nat REDIRECT) is, after every single iptables-restore of the sync, either
// refused or steered, never neither: a SYN arriving in between would be dropped and its client
// would wait a second for the retransmission (a new Service's first connection took 1.15 s).
func TestRefusalSwapLeavesNoGap(t *testing.T) {
	const dst = "10.96.0.1:80"
	has := func(save []byte, chain string) bool {
		for _, l := range strings.Split(string(save), "\n") {
			if strings.HasPrefix(l, "-A "+chain+" -d 10.96.0.1/32 -p tcp ") && strings.Contains(l, "--dport 80 ") {
				return true
			}
		}
		return false
	}
	for _, tc := range []struct {
		name     string
		from, to bool // refused before, after
	}{
		{"endpoints_arrive", true, false},
		{"endpoints_leave", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			specs := manySpecs(3, 34000)
			specs[0].RejectInternal = tc.from
			run := &everyRestore{Fake: NewFake(), check: func(int) {}}
			p := New(v4Config(), run)
			mustSync(t, p, specs)
			run.check = func(step int) {
				nat, _ := run.Fake.Save(t.Context(), portal.IPv4, tableNAT)
				filter, _ := run.Fake.Save(t.Context(), portal.IPv4, tableFilter)
				steered, refused := has(nat, ChainPortalsContainer), has(filter, ChainReject)
				if !steered && !refused {
					t.Errorf("after restore %d of the sync, %s is neither steered nor refused:\n%s\n%s", step, dst, nat, filter)
				}
			}
			specs[0].RejectInternal = tc.to
			mustSync(t, p, specs)
			if run.steps == 0 {
				t.Fatal("the change ran no restore")
			}
		})
	}
}
