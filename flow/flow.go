// Package flow is the vocabulary the TCP and UDP proxy sockets share: a flow is one proxied TCP
// connection or UDP session, Info describes it live or ended, EndReason says why it ended, and
// Stats are a proxy socket's counters. tcp/ and udp/ speak it, so proxier/ reads both alike.
package flow

import (
	"fmt"
	"net/netip"
	"time"
)

// EndReason says why a flow ended: the first thing that ended it. The zero value, Unknown, marks a
// live flow (an ended one always has a reason).
type EndReason uint8

// The reasons a flow ends. Some happen to one protocol only (noted).
const (
	Unknown         EndReason = iota
	ClientClosed              // TCP: client sent FIN first, then both directions finished
	EndpointClosed            // TCP: endpoint sent FIN first, then both directions finished
	ClientReset               // TCP: client reset (or vanished); the endpoint leg was reset too
	EndpointReset             // TCP: endpoint reset (or vanished); the client leg was reset too
	IdleTimeout               // no traffic either way for the idle timeout
	DialFailed                // TCP: every dial attempt failed; the client was reset
	NoEndpoints               // TCP: the picker had no endpoint; the client was reset
	EndpointRemoved           // DropEndpoint: the endpoint is gone
	Shutdown                  // the proxy socket was shut down (TCP Shutdown, UDP Close)
	Evicted                   // UDP: least recently used when the session table was full
	EndpointRefused           // UDP: ICMP port unreachable from the endpoint
	EndpointError             // UDP: any other error on the endpoint socket
	SourceDenied              // the client is outside the allowed source ranges (TCP: reset; UDP: datagram dropped)
	HoldTimeout               // TCP: held for want of an endpoint until the hold timeout; the client was reset
	DrainTimeout              // the endpoint left the rotation and its drain deadline passed (TCP: FIN both ways, then reset)

	// NumEndReasons sizes arrays indexed by EndReason.
	NumEndReasons
)

// One spelling scheme, for the access log and debug output: lower case, words joined by '-'.
var endReasonNames = [NumEndReasons]string{"unknown", "client-closed", "endpoint-closed", "client-reset",
	"endpoint-reset", "idle-timeout", "dial-failed", "no-endpoints", "endpoint-removed", "shutdown",
	"evicted", "endpoint-refused", "endpoint-error", "source-denied", "hold-timeout", "drain-timeout"}

func (r EndReason) String() string {
	if r < NumEndReasons {
		return endReasonNames[r]
	}
	return fmt.Sprintf("EndReason(%d)", r)
}

// Info describes one flow, live (a proxy's Live) or ended (its OnEnd hook).
type Info struct {
	Client   netip.AddrPort
	Endpoint netip.AddrPort // TCP: the last endpoint tried; invalid if none was picked
	Start    time.Time
	// LastActive is when the flow last moved a byte or a datagram either way.
	LastActive time.Time
	// Duration is the age of a live flow or the lifetime of an ended one.
	Duration time.Duration
	// To the endpoint (client to pod) and to the client (pod to client).
	BytesToEndpoint, BytesToClient uint64
	// PacketsToEndpoint and PacketsToClient count UDP datagrams (0 for TCP).
	PacketsToEndpoint, PacketsToClient uint64
	DialAttempts                       int // TCP dials (0 for UDP)
	// Transparent: the endpoint leg left from the client's own address and port (the
	// transparent source mode), so the endpoint saw Client; else it saw this node's address.
	Transparent bool
	End         EndReason // Unknown while live
	Err         error     // TCP: the error that ended it, naming the direction; nil for a clean end
}

// SourcePolicy says, per dial or UDP session, whether the endpoint leg takes the client's address
// and port (true: the transparent source mode) or the proxy's own (false). The data path asks it
// on the dialing goroutine, ring thread or UDP loop, once per dial attempt or session, so it must
// be quick and must not block (portal/transparent.Policy).
type SourcePolicy interface {
	Transparent(client, endpoint netip.Addr) bool
}

// Stats are the counters of one proxy socket since it was built. Fields that one protocol never
// counts stay 0 for it.
type Stats struct {
	Active int64  // live connections or sessions
	Total  uint64 // accepted connections or created sessions (UDP: including re-picks after a refusal)
	// Ended counts ended flows by reason.
	Ended [NumEndReasons]uint64

	BytesToEndpoint, BytesToClient     uint64
	PacketsToEndpoint, PacketsToClient uint64 // UDP datagrams actually sent

	// NoEndpoint counts connections reset (TCP) or datagrams dropped (UDP) because the picker had no
	// endpoint for the client.
	NoEndpoint uint64
	// SourceDenied counts connections reset (TCP) or datagrams dropped (UDP) because the client
	// was outside the allowed source ranges (Config.Allow), before any endpoint was picked.
	SourceDenied uint64

	// TCP only.
	DialAttempts, DialFailures, DialRetries uint64

	// The transparent source mode: endpoint connections or sessions dialed from the client's
	// address, and those the policy wanted so that went from the proxy's own (the client's
	// address could not be taken).
	TransparentDials, TransparentFallbacks uint64

	// TCP only, a service port that holds connections while it has no endpoint: Held is how many
	// wait now; Holds counts the holds by outcome.
	Held  int64
	Holds [NumHoldOutcomes]uint64

	// UDP only: datagrams dropped.
	DropsSessionSetup uint64 // an endpoint socket could not be opened (EMFILE, ...)
	DropsToEndpoint   uint64 // sending to the endpoint failed
	DropsToClient     uint64 // sending a reply failed
	DropsTruncated    uint64 // never expected: datagrams are read into 64 KiB buffers
}

// Add adds b's counters to s (to sum the sockets of one service port).
func (s *Stats) Add(b Stats) {
	s.Active += b.Active
	s.Total += b.Total
	for i := range s.Ended {
		s.Ended[i] += b.Ended[i]
	}
	s.BytesToEndpoint += b.BytesToEndpoint
	s.BytesToClient += b.BytesToClient
	s.PacketsToEndpoint += b.PacketsToEndpoint
	s.PacketsToClient += b.PacketsToClient
	s.NoEndpoint += b.NoEndpoint
	s.SourceDenied += b.SourceDenied
	s.DialAttempts += b.DialAttempts
	s.DialFailures += b.DialFailures
	s.DialRetries += b.DialRetries
	s.TransparentDials += b.TransparentDials
	s.TransparentFallbacks += b.TransparentFallbacks
	s.Held += b.Held
	for i := range s.Holds {
		s.Holds[i] += b.Holds[i]
	}
	s.DropsSessionSetup += b.DropsSessionSetup
	s.DropsToEndpoint += b.DropsToEndpoint
	s.DropsToClient += b.DropsToClient
	s.DropsTruncated += b.DropsTruncated
}

// HoldOutcome is how a connection held for want of an endpoint left the hold.
type HoldOutcome uint8

// The outcomes of a hold.
const (
	HoldServed     HoldOutcome = iota // an endpoint appeared and the connection was dialed
	HoldExpired                       // the hold timeout passed first; the client was reset (HoldTimeout)
	HoldFull                          // not held: the port already held its limit; the client was reset (NoEndpoints)
	HoldAborted                       // the proxy socket closed or shut down first
	HoldClientGone                    // the client reset, or closed without sending a byte, while held
	NumHoldOutcomes
)

var holdOutcomeNames = [NumHoldOutcomes]string{"served", "timeout", "full", "aborted", "client-gone"}

func (o HoldOutcome) String() string {
	if o < NumHoldOutcomes {
		return holdOutcomeNames[o]
	}
	return fmt.Sprintf("HoldOutcome(%d)", o)
}
