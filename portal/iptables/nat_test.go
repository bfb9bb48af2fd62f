package iptables

import (
	"context"
	"errors"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

func TestCheckNAT(t *testing.T) {
	tests := []struct {
		name        string
		fake        *Fake
		fam         portal.Family
		wantNoNAT   bool
		wantMissing bool
	}{
		{name: "nat_works", fake: NewFake(), fam: portal.IPv4},
		{name: "nat_works_IPv6", fake: NewFake(), fam: portal.IPv6},
		{name: "no_nat_table", fake: &Fake{NoNAT: true}, fam: portal.IPv4, wantNoNAT: true},
		{name: "no_iptables_binary", fake: &Fake{Unavailable: map[portal.Family]bool{portal.IPv4: true}}, fam: portal.IPv4,
			wantNoNAT: true, wantMissing: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckNAT(t.Context(), tt.fake, tt.fam)
			if got := errors.Is(err, ErrNATUnavailable); got != tt.wantNoNAT {
				t.Errorf("CheckNAT() = %v; errors.Is(ErrNATUnavailable) = %v, want %v", err, got, tt.wantNoNAT)
			}
			if got := errors.Is(err, ErrUnavailable); got != tt.wantMissing {
				t.Errorf("CheckNAT() = %v; errors.Is(ErrUnavailable) = %v, want %v", err, got, tt.wantMissing)
			}
			if d := tt.fake.Dump(); d != "" {
				t.Errorf("the probe left rules behind:\n%s", d)
			}
		})
	}
	t.Run("a_cancelled_context_says_nothing_about_NAT", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		err := CheckNAT(ctx, &Fake{RestoreHook: func(portal.Family, []byte) error { return ctx.Err() }}, portal.IPv4)
		if !errors.Is(err, context.Canceled) || errors.Is(err, ErrNATUnavailable) {
			t.Errorf("CheckNAT() = %v, want context.Canceled and not ErrNATUnavailable", err)
		}
	})
}
