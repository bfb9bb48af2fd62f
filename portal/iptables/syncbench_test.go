package iptables

import (
	"context"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// nullRunner accepts every restore and reads back empty tables, so a benchmark measures this
// package's side of a sync (rules, plan, restore input), not iptables.
type nullRunner struct{}

func (nullRunner) Restore(context.Context, portal.Family, []byte) error { return nil }
func (nullRunner) Save(_ context.Context, _ portal.Family, table string) ([]byte, error) {
	return []byte("*" + table + "\nCOMMIT\n"), nil
}
func (nullRunner) Command(context.Context, portal.Family, ...string) error { return nil }
func (nullRunner) Chains(context.Context, portal.Family) (Chains, error)   { return nil, ErrUnavailable }

// benchSync10000 is the sync of 10,000 proxy-path service ports: the first one (every rule new)
// and one with a changed proxy port among them.
func benchSync10000(b *testing.B, cfg Config) {
	cfg.ProtectProxyPorts = true
	specs := manySpecs(10000, 20000)
	b.Run("first_sync", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			p := New(cfg, nullRunner{})
			if err := p.Sync(b.Context(), specs); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("one_change", func(b *testing.B) {
		p := New(cfg, nullRunner{})
		if err := p.Sync(b.Context(), specs); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			specs[5000].ProxyPort = uint16(60000 + i%2)
			i++
			if err := p.Sync(b.Context(), specs); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkSyncProxyPath10000: proxy-path ports only, on a node without (off) and with (on, as
// the daemon runs iptables mode) the kernel path's top-level chains. Compare "off" with the
// same benchmark before the kernel path existed to see that proxy-path syncs did not get worse.
func BenchmarkSyncProxyPath10000(b *testing.B) {
	b.Run("kernel_path_off", func(b *testing.B) { benchSync10000(b, v4Config()) })
	b.Run("kernel_path_on", func(b *testing.B) {
		cfg := v4Config()
		cfg.KernelPath = true
		benchSync10000(b, cfg)
	})
}
