package tcp

import "net/netip"

type SourcePolicy interface {
	Transparent(client, endpoint netip.Addr) bool
}
