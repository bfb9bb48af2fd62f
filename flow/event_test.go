package flow

import "testing"

func TestVerdicts(t *testing.T) {
	tcp := &Port{Protocol: TCP}
	udp := &Port{Protocol: UDP}
	kernel := &Port{Protocol: TCP, Path: PathKernel}
	tests := []struct {
		port  *Port
		phase Phase
		end   EndReason
		want  Verdict
	}{
		{tcp, PhaseStart, Unknown, Forwarded},
		{tcp, PhaseHeld, Unknown, Held},
		{tcp, PhaseDial, Unknown, Forwarded},
		{tcp, PhaseEnd, ClientClosed, Forwarded},
		{tcp, PhaseEnd, EndpointClosed, Forwarded},
		{tcp, PhaseEnd, ClientReset, Reset},
		{tcp, PhaseEnd, EndpointReset, Reset},
		{tcp, PhaseEnd, IdleTimeout, Timeout},
		{udp, PhaseEnd, IdleTimeout, Forwarded}, // a UDP session's normal end
		{tcp, PhaseEnd, DialFailed, DialFailedV},
		{tcp, PhaseEnd, NoEndpoints, Refused},
		{udp, PhaseEnd, NoEndpoints, Refused},
		{tcp, PhaseEnd, EndpointRemoved, Ejected},
		{tcp, PhaseEnd, Shutdown, Closed},
		{udp, PhaseEnd, Evicted, EvictedV},
		{udp, PhaseEnd, EndpointRefused, Unreachable},
		{udp, PhaseEnd, EndpointError, Failed},
		{tcp, PhaseEnd, SourceDenied, Denied},
		{tcp, PhaseEnd, HoldTimeout, Held},
		{tcp, PhaseEnd, DrainTimeout, Drained},
		{kernel, PhaseStart, Unknown, Kernel},
		{kernel, PhaseEnd, ClientClosed, Kernel},
	}
	for _, tt := range tests {
		e := &Event{Phase: tt.phase, Port: tt.port, Info: Info{End: tt.end}}
		if got := e.Verdict(); got != tt.want {
			t.Errorf("%v %v %v: verdict %v, want %v", tt.port.Protocol, tt.phase, tt.end, got, tt.want)
		}
	}
	// Every end reason has a verdict of its own list, and every name parses back.
	for r := EndReason(0); r < NumEndReasons; r++ {
		if v := VerdictOf(PhaseEnd, r); v >= NumVerdicts {
			t.Errorf("end reason %v: verdict %v out of range", r, v)
		}
	}
	for v := Verdict(0); v < NumVerdicts; v++ {
		if got, err := ParseVerdict(v.String()); err != nil || got != v {
			t.Errorf("ParseVerdict(%q) = %v, %v", v.String(), got, err)
		}
	}
	for p := Phase(0); p < NumPhases; p++ {
		if got, err := ParsePhase(p.String()); err != nil || got != p {
			t.Errorf("ParsePhase(%q) = %v, %v", p.String(), got, err)
		}
	}
	if _, err := ParseVerdict("dropped"); err == nil {
		t.Error(`ParseVerdict("dropped") = nil error`)
	}
}
