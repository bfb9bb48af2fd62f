package daemon

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

// The node's ephemeral port range and reserved ports, read in the daemon's network namespace.
const (
	localPortRangeFile = "/proc/sys/net/ipv4/ip_local_port_range"
	reservedPortsFile  = "/proc/sys/net/ipv4/ip_local_reserved_ports"
)

// readKernelPorts reads where the kernel would choose proxy ports from, so the proxier can choose
// them itself (see proxier.KernelPorts). An unreadable range leaves the choice to the kernel.
func readKernelPorts() (proxier.KernelPorts, error) {
	rng, err := os.ReadFile(localPortRangeFile)
	if err != nil {
		return proxier.KernelPorts{}, err
	}
	reserved, err := os.ReadFile(reservedPortsFile)
	if err != nil && !os.IsNotExist(err) {
		return proxier.KernelPorts{}, err
	}
	return parseKernelPorts(string(rng), string(reserved))
}

// parseKernelPorts reads ip_local_port_range ("32768\t60999") and ip_local_reserved_ports
// ("8080,9000-9010" or empty).
func parseKernelPorts(rng, reserved string) (proxier.KernelPorts, error) {
	f := strings.Fields(rng)
	if len(f) != 2 {
		return proxier.KernelPorts{}, fmt.Errorf("%s: want two ports, got %q", localPortRangeFile, rng)
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || lo < 1 || hi > 65535 || hi < lo {
		return proxier.KernelPorts{}, fmt.Errorf("%s: bad range %q", localPortRangeFile, rng)
	}
	kp := proxier.KernelPorts{Range: proxier.PortRange{Base: lo, Size: hi - lo + 1}}
	for _, part := range strings.Split(strings.TrimSpace(reserved), ",") {
		if part == "" {
			continue
		}
		r, err := proxier.ParsePortRange(part)
		if err != nil {
			return proxier.KernelPorts{}, fmt.Errorf("%s: %w", reservedPortsFile, err)
		}
		kp.Reserved = append(kp.Reserved, r)
	}
	return kp, nil
}
