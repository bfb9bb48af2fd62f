package daemon

// restart.go: what a restarted daemon does before anything else so that a restart drops as little
// as possible. After SIGKILL or an OOM kill the portal rules of the old process are still in force
// and point at its proxy ports; the new process reopens those ports (proxier.Reopen) before it has
// read a single Service, so traffic flows again within milliseconds of the start instead of after
// the first full sync.

import (
	"context"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

// steeredSeeds reads where the portal rules in force send each service port.
func steeredSeeds(rules *iptables.Portals) func(ctx context.Context) ([]proxier.Seed, error) {
	return func(ctx context.Context) ([]proxier.Seed, error) {
		st, err := rules.ReadSteered(ctx)
		seeds := make([]proxier.Seed, 0, len(st))
		for _, s := range st {
			seeds = append(seeds, proxier.Seed{Name: s.Name, Protocol: s.Protocol, ProxyPort: s.ProxyPort,
				ExternalProxyPort: s.ExternalProxyPort, Families: s.Families})
		}
		return seeds, err
	}
}

// seedReopen hands the proxier the proxy ports the rules in force point at. A failed read-back
// is logged and costs only the head start: the first sync programs everything anyway.
func seedReopen(ctx context.Context, pm *portalMode, px *proxier.Proxier, log logrus.FieldLogger) {
	if pm.steered == nil {
		return
	}
	seeds, err := pm.steered(ctx)
	if err != nil {
		log.WithError(err).Warn("Cannot read the portal rules in force; proxy sockets open at the first sync")
	}
	if len(seeds) > 0 {
		log.WithField("servicePorts", len(seeds)).Info("Portal rules of a previous process are in force; reopening their proxy ports")
	}
	px.Reopen(seeds)
}
