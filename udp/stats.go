package udp

import (
	"sync/atomic"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// counters is the live, lock-free form of flow.Stats. Packets and bytes count datagrams actually
// sent.
type counters struct {
	active                                                atomic.Int64
	created                                               atomic.Uint64
	ended                                                 [flow.NumEndReasons]atomic.Uint64
	pktsTo, bytesTo, pktsFrom, bytesFrom                  atomic.Uint64
	noEndpoint, sessionSetup, toEndpoint, toClient, trunc atomic.Uint64
	sourceDenied                                          atomic.Uint64
	transparentDials, transparentFallbacks                atomic.Uint64 // Config.Source
}

func (c *counters) snapshot() flow.Stats {
	s := flow.Stats{
		Active:            c.active.Load(),
		Total:             c.created.Load(),
		PacketsToEndpoint: c.pktsTo.Load(),
		BytesToEndpoint:   c.bytesTo.Load(),
		PacketsToClient:   c.pktsFrom.Load(),
		BytesToClient:     c.bytesFrom.Load(),
		NoEndpoint:        c.noEndpoint.Load(),
		SourceDenied:      c.sourceDenied.Load(),
		DropsSessionSetup: c.sessionSetup.Load(),
		DropsToEndpoint:   c.toEndpoint.Load(),
		DropsToClient:     c.toClient.Load(),
		DropsTruncated:    c.trunc.Load(),

		TransparentDials:     c.transparentDials.Load(),
		TransparentFallbacks: c.transparentFallbacks.Load(),
	}
	for i := range c.ended {
		s.Ended[i] = c.ended[i].Load()
	}
	return s
}

func (c *counters) end(r flow.EndReason) {
	c.active.Add(-1)
	c.ended[r].Add(1)
}
