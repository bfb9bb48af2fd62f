package udp

// Address plan: see helpers_test.go (proxy and clients on 127.0.0.1, endpoints on 127.0.0.2-3).

import (
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// TestDrainEndpointMovesSessionsAtTheDeadline: a session to an endpoint that left the rotation
// goes on until its drain deadline (the proxier calls DrainEndpoint then); it then ends as
// drain-timeout and the client's next datagram opens a session to an endpoint in the rotation.
func TestDrainEndpointMovesSessionsAtTheDeadline(t *testing.T) {
	b1 := echoServer(t, "127.0.0.2", "b1:")
	b2 := echoServer(t, "127.0.0.3", "b2:")
	picker := newFakePicker(b1)
	p := startProxy(t, picker, Config{})
	c := newClient(t, "127.0.0.1", p.Addr())
	if got, want := c.roundTrip("x"), "b1:x"; got != want {
		t.Fatalf("before the change: got %q, want %q", got, want)
	}
	picker.setEndpoints(b2) // b1 left the rotation, its session stays until the deadline
	if got, want := c.roundTrip("y"), "b1:y"; got != want {
		t.Errorf("before the deadline: got %q, want %q (the session keeps its endpoint)", got, want)
	}
	if got, want := p.DrainEndpoint(b1, time.Second), 1; got != want {
		t.Errorf("DrainEndpoint(b1) = %d, want %d", got, want)
	}
	if got, want := c.roundTrip("z"), "b2:z"; got != want {
		t.Errorf("after the deadline: got %q, want %q", got, want)
	}
	if got := p.Stats(); got.Ended[flow.DrainTimeout] != 1 || got.Ended[flow.EndpointRemoved] != 0 {
		t.Errorf("Stats().Ended = %v, want one drain-timeout", got.Ended)
	}
}
