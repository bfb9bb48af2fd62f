package daemon

import (
	"context"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/kube-portal-proxy/kube-portal-proxy/healthcheck"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

// nodeTarget is what learns about this node's own Node object.
type nodeTarget struct {
	health  *healthcheck.ProxyHealth
	proxier interface{ SetNodeTopology(proxier.NodeTopology) }
	ips     *nodeIPs     // nil: the node IPs do not follow the Node (tests)
	source  *sourceSetup // the transparent source mode's pod CIDRs; nil: no transparent mode
}

// apply tells the health check whether the node is going away (deleted, or tainted by the cluster
// autoscaler for deletion: load balancers should drain it), the proxier its zone (topology
// hints) and the portals its addresses (nodeIPs). A nil node (not found) changes nothing.
func (t nodeTarget) apply(name string, n *v1.Node) {
	if n == nil {
		return
	}
	var taints []string
	for _, taint := range n.Spec.Taints {
		taints = append(taints, taint.Key)
	}
	t.health.SyncNode(n.DeletionTimestamp != nil, taints...)
	t.proxier.SetNodeTopology(proxier.NodeTopology{Name: name, Zone: n.Labels[v1.LabelTopologyZone]})
	if t.ips != nil {
		t.ips.update(n)
	}
	t.source.setNode(n)
}

// watchNode follows this node's Node object (one object: a field selector on its name) until ctx
// is done.
func watchNode(client kubernetes.Interface, name string, resync time.Duration, t nodeTarget, log logrus.FieldLogger) func(context.Context) {
	return func(ctx context.Context) {
		factory := informers.NewSharedInformerFactoryWithOptions(client, resync,
			informers.WithTweakListOptions(func(o *metav1.ListOptions) {
				o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
			}))
		inf := factory.Core().V1().Nodes().Informer()
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(o any) { n, _ := o.(*v1.Node); t.apply(name, n) },
			UpdateFunc: func(_, o any) { n, _ := o.(*v1.Node); t.apply(name, n) },
		}); err != nil {
			log.WithError(err).Error("Cannot watch the Node object; node health and zone stay as at start")
			return
		}
		factory.Start(ctx.Done())
		<-ctx.Done()
		factory.Shutdown()
	}
}
