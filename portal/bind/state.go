package bind

// state.go: what bind mode listens on, kept in a file so that a process started after a SIGKILL
// can reopen those sockets before it has read a single Service. The service addresses outlive the
// process on the portal link, but unlike iptables mode no rule tells the new process which ports
// were served on them; without the file every connection is refused for the whole cold start.

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/atomicfile"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// StateVersion is the version of the state file's format. A file of another version is ignored.
const StateVersion = 1

// ErrStateCorrupt means the state file could not be decoded or has an unknown version.
var ErrStateCorrupt = errors.New("bind state file unreadable")

// ListenState is one service port's sockets as they listened at the last sync.
type ListenState struct {
	Name     service.ServicePortName `json:"name"`
	Protocol service.Protocol        `json:"protocol"`
	// Port is the service port (a socket on a cluster or load-balancer IP listens on it).
	Port uint16 `json:"port"`
	// Listen is where the port's socket listens (its cluster traffic only when External is set).
	Listen []netip.AddrPort `json:"listen"`
	// External, when not empty, is where its separate external-traffic socket listens.
	External []netip.AddrPort `json:"external,omitempty"`
	// LoadBalancerIPs and SourceRanges let a reopened socket on a load-balancer IP check its
	// clients against loadBalancerSourceRanges from the first connection on.
	LoadBalancerIPs []netip.Addr   `json:"loadBalancerIPs,omitempty"`
	SourceRanges    []netip.Prefix `json:"sourceRanges,omitempty"`
}

type stateFile struct {
	Version int           `json:"version"`
	Ports   []ListenState `json:"ports"`
}

// StateFile keeps the listen state in one file, replaced atomically (a temporary file in the same
// directory, then rename), so a reader finds the old state or the new one, never half of one.
// Save writes only when the state changed. It is not safe for concurrent use (the daemon calls it
// from one writer goroutine).
type StateFile struct {
	Path string
	last []byte
}

// Save writes ports (in any order) unless the file already holds exactly them. It reports
// whether it wrote.
func (f *StateFile) Save(ports []ListenState) (bool, error) {
	ports = slices.Clone(ports)
	sortStates(ports)
	data, err := json.Marshal(stateFile{Version: StateVersion, Ports: ports})
	if err != nil {
		return false, fmt.Errorf("bind state %s: encode: %w", f.Path, err)
	}
	if f.last != nil && bytes.Equal(data, f.last) {
		return false, nil
	}
	if err := atomicfile.Write(f.Path, "."+filepath.Base(f.Path)+".", func(w io.Writer) error { _, err := w.Write(data); return err }); err != nil {
		return false, fmt.Errorf("bind state %s: %w", f.Path, err)
	}
	f.last = data
	return true, nil
}

// sortStates sorts ports by name and protocol, the order of the file.
func sortStates(ports []ListenState) {
	slices.SortFunc(ports, func(a, b ListenState) int {
		return cmp.Or(cmp.Compare(a.Name.Namespace, b.Name.Namespace), cmp.Compare(a.Name.Name, b.Name.Name),
			cmp.Compare(a.Name.Port, b.Name.Port), cmp.Compare(a.Protocol, b.Protocol))
	})
}

// ReadState reads the state a previous process saved. A missing file is no state and no error; a
// file that cannot be decoded, or of another version, is an error wrapping ErrStateCorrupt.
func ReadState(path string) ([]ListenState, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bind state %s: %w", path, err)
	}
	ports, err := decodeState(data)
	if err != nil {
		return nil, fmt.Errorf("bind state %s: %w", path, err)
	}
	return ports, nil
}

// decodeState decodes a state file's content. Anything the proxier could not reopen as it is (a
// port without a name or an address, an invalid address, another protocol, a name listed twice)
// rejects the whole file: it was not written by a proxy of this version, and half of it could
// hold sockets no sync would ever close (a second entry of one name replaced the first one's).
func decodeState(data []byte) ([]ListenState, error) {
	var st stateFile
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrStateCorrupt, err)
	}
	if st.Version != StateVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrStateCorrupt, st.Version, StateVersion)
	}
	seen := make(map[service.ServicePortName]bool, len(st.Ports))
	for i, p := range st.Ports {
		if err := p.validate(); err != nil {
			return nil, fmt.Errorf("%w: ports[%d] %s: %w", ErrStateCorrupt, i, p.Name, err)
		}
		if seen[p.Name] {
			return nil, fmt.Errorf("%w: ports[%d] %s: listed twice", ErrStateCorrupt, i, p.Name)
		}
		seen[p.Name] = true
	}
	return st.Ports, nil
}

// validate checks that a port can be reopened as it says.
func (p ListenState) validate() error {
	switch {
	case p.Name.Namespace == "" || p.Name.Name == "":
		return errors.New("no namespace/name")
	case p.Protocol != service.TCP && p.Protocol != service.UDP:
		return fmt.Errorf("protocol %q, want TCP or UDP", p.Protocol)
	case len(p.Listen) == 0:
		return errors.New("no address to listen on")
	}
	for _, a := range append(slices.Clone(p.Listen), p.External...) {
		if !a.IsValid() || a.Port() == 0 || a.Addr().Zone() != "" {
			return fmt.Errorf("listen address %q: want an address without zone and a port", a)
		}
	}
	for _, a := range p.LoadBalancerIPs {
		if !a.IsValid() || a.Zone() != "" {
			return fmt.Errorf("load-balancer IP %q", a)
		}
	}
	for _, r := range p.SourceRanges {
		if !r.IsValid() {
			return fmt.Errorf("source range %q", r)
		}
	}
	return nil
}

// Present keeps the ports whose every address is still local (on the portal link or another
// interface; an unspecified address, a node port's wildcard, always is). A socket on an address
// that is gone would listen (the sockets bind with IP_FREEBIND) but receive nothing; a port with
// only some of its addresses left is not reopened either, since the first sync would reopen it.
func Present(ports []ListenState, local func(netip.Addr) bool) []ListenState {
	keep := func(addrs []netip.AddrPort) []netip.AddrPort {
		return slices.DeleteFunc(slices.Clone(addrs), func(a netip.AddrPort) bool {
			return !a.Addr().IsUnspecified() && !local(a.Addr())
		})
	}
	var out []ListenState
	for _, p := range ports {
		listen, ext := keep(p.Listen), keep(p.External)
		if len(listen) != len(p.Listen) || len(ext) != len(p.External) {
			continue
		}
		out = append(out, p)
	}
	return out
}
