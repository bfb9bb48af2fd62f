package udp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Flows names the UDP conntrack entries of one service port. When the port (or one of its
// addresses) goes away they must be deleted: conntrack keeps steering a client that keeps sending
// (DNS resolvers do) to the old proxy socket for as long as its entry lives. The legacy proxy
// cleared only the cluster IP; external, load-balancer and node-port entries lingered.
type Flows struct {
	// Addrs are the cluster, external and load-balancer IPs: entries whose original destination is
	// one of them at Port are deleted.
	Addrs []netip.Addr
	Port  uint16
	// NodePort, unless 0: entries whose original destination port is NodePort, on any address of
	// the families in Addrs (IPv4 when Addrs is empty).
	NodePort uint16
}

// FlowsOf returns the flows of a service port.
func FlowsOf(p *service.Port) Flows {
	var addrs []netip.Addr
	addrs = append(addrs, p.ClusterIPs...)
	addrs = append(addrs, p.ExternalIPs...)
	addrs = append(addrs, p.LoadBalancerIPs...)
	slices.SortFunc(addrs, netip.Addr.Compare)
	return Flows{Addrs: slices.Compact(addrs), Port: p.Port, NodePort: p.NodePort}
}

// Conntrack deletes conntrack entries.
type Conntrack interface {
	ClearUDP(ctx context.Context, f Flows) error
}

// Runner runs a command and returns its combined output; the error is an *exec.ExitError when it
// ran and failed.
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// ExecRunner runs commands with os/exec.
type ExecRunner struct{}

// Run implements Runner.
func (ExecRunner) Run(ctx context.Context, name string, args ...string) ([]byte, error) {
	return exec.CommandContext(ctx, name, args...).CombinedOutput()
}

// ExecConntrack deletes entries with the conntrack(8) tool, one command per address and per
// node-port family.
type ExecConntrack struct {
	Runner Runner
	// Path of the tool; "" means "conntrack" from PATH.
	Path string
}

// noneDeleted is how conntrack reports, with exit status 1, that nothing matched: not a failure.
var noneDeleted = []byte("0 flow entries have been deleted")

// ClearUDP implements Conntrack. It runs every command even when one fails, and returns all
// failures.
func (c ExecConntrack) ClearUDP(ctx context.Context, f Flows) error {
	var errs []error
	for _, args := range conntrackArgs(f) {
		if err := c.run(ctx, args); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (c ExecConntrack) run(ctx context.Context, args []string) error {
	path := c.Path
	if path == "" {
		path = "conntrack"
	}
	out, err := c.Runner.Run(ctx, path, args...)
	if err == nil {
		return nil
	}
	if _, ok := errors.AsType[*exec.ExitError](err); ok && bytes.Contains(out, noneDeleted) {
		return nil
	}
	return fmt.Errorf("conntrack %v: %w: %s", args, err, bytes.TrimSpace(out))
}

// conntrackArgs are the conntrack command lines that delete f.
func conntrackArgs(f Flows) [][]string {
	var cmds [][]string
	families := map[string]bool{}
	for _, a := range f.Addrs {
		fam := familyName(a)
		families[fam] = true
		cmds = append(cmds, []string{"-D", "-f", fam, "-p", "udp",
			"--orig-dst", a.Unmap().String(), "--orig-port-dst", strconv.Itoa(int(f.Port))})
	}
	if f.NodePort != 0 {
		if len(families) == 0 {
			families["ipv4"] = true
		}
		for _, fam := range []string{"ipv4", "ipv6"} {
			if families[fam] {
				cmds = append(cmds, []string{"-D", "-f", fam, "-p", "udp",
					"--orig-port-dst", strconv.Itoa(int(f.NodePort))})
			}
		}
	}
	return cmds
}

func familyName(a netip.Addr) string {
	if a.Unmap().Is4() {
		return "ipv4"
	}
	return "ipv6"
}
