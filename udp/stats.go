package udp

import "sync/atomic"

// Stats are the proxy's counters since New. Packets and bytes count datagrams actually sent.
type Stats struct {
	SessionsActive  int64  // sessions with an open backend socket
	SessionsCreated uint64 // including re-picks after a refusal
	SessionsExpired uint64 // EndIdle
	SessionsEvicted uint64 // EndEvicted
	SessionsRefused uint64 // EndBackendRefused
	SessionsClosed  uint64 // EndEndpointRemoved, EndBackendError and EndClosed

	PacketsToEndpoint, BytesToEndpoint     uint64
	PacketsFromEndpoint, BytesFromEndpoint uint64

	DropsNoEndpoint   uint64 // the picker had no endpoint for the client
	DropsSessionSetup uint64 // a backend socket could not be opened (EMFILE, ...)
	DropsToEndpoint   uint64 // sending to the endpoint failed
	DropsToClient     uint64 // sending a reply failed
	DropsTruncated    uint64 // never expected: datagrams are read into 64 KiB buffers
}

// counters is the live, lock-free form of Stats.
type counters struct {
	active                                                atomic.Int64
	created, expired, evicted, refused, closed            atomic.Uint64
	pktsTo, bytesTo, pktsFrom, bytesFrom                  atomic.Uint64
	noEndpoint, sessionSetup, toEndpoint, toClient, trunc atomic.Uint64
}

func (c *counters) snapshot() Stats {
	return Stats{
		SessionsActive:      c.active.Load(),
		SessionsCreated:     c.created.Load(),
		SessionsExpired:     c.expired.Load(),
		SessionsEvicted:     c.evicted.Load(),
		SessionsRefused:     c.refused.Load(),
		SessionsClosed:      c.closed.Load(),
		PacketsToEndpoint:   c.pktsTo.Load(),
		BytesToEndpoint:     c.bytesTo.Load(),
		PacketsFromEndpoint: c.pktsFrom.Load(),
		BytesFromEndpoint:   c.bytesFrom.Load(),
		DropsNoEndpoint:     c.noEndpoint.Load(),
		DropsSessionSetup:   c.sessionSetup.Load(),
		DropsToEndpoint:     c.toEndpoint.Load(),
		DropsToClient:       c.toClient.Load(),
		DropsTruncated:      c.trunc.Load(),
	}
}

func (c *counters) ended(r EndReason) {
	c.active.Add(-1)
	switch r {
	case EndIdle:
		c.expired.Add(1)
	case EndEvicted:
		c.evicted.Add(1)
	case EndBackendRefused:
		c.refused.Add(1)
	default:
		c.closed.Add(1)
	}
}
