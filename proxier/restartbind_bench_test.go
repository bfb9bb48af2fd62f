package proxier

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// BenchmarkBindSyncListenState measures a bind-mode sync of one change among 10,000 service
// ports (fake sockets and portals): without --bind-state-file; with it as the sync goroutine pays
// for it (listing where the ports listen; the daemon writes the file on another goroutine); and
// with the encoding and the write done in the sync too, which is that other goroutine's work.
func BenchmarkBindSyncListenState(b *testing.B) {
	plan := func(p *service.Port) []netip.AddrPort {
		out := make([]netip.AddrPort, 0, len(p.ClusterIPs))
		for _, ip := range p.ClusterIPs {
			out = append(out, netip.AddrPortFrom(ip, p.Port))
		}
		return out
	}
	for _, mode := range []string{"without_state_file", "with_state_file", "with_state_file_written_in_the_sync"} {
		b.Run(mode, func(b *testing.B) {
			f := &bind.StateFile{Path: filepath.Join(b.TempDir(), "bind-state.json")}
			var kept []Seed
			e := newFakeEnv(b, func(c *Config) {
				c.ListenPlan = plan
				switch mode {
				case "with_state_file":
					c.ListenState = func(seeds []Seed) { kept = seeds }
				case "with_state_file_written_in_the_sync":
					c.ListenState = func(seeds []Seed) {
						st := make([]bind.ListenState, 0, len(seeds))
						for _, s := range seeds {
							st = append(st, bind.ListenState{Name: s.Name, Protocol: s.Protocol, Port: s.ProxyPort, Listen: s.Listen, External: s.External})
						}
						if _, err := f.Save(st); err != nil {
							b.Fatal(err)
						}
					}
				}
			})
			e.synced()
			addServices(e, 10000, sliceEP{addr: "10.244.0.1"})
			e.sync()
			benchOneChange(b, e)
			_ = kept
		})
	}
}
