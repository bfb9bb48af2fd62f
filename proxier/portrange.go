package proxier

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
)

// PortRange is the --proxy-port-range: the local ports proxy sockets may use. The zero value means
// "let the kernel choose" (the default).
type PortRange struct {
	Base int
	Size int
}

// IsKernelChosen reports whether ports come from the kernel's ephemeral range.
func (r PortRange) IsKernelChosen() bool { return r.Size == 0 }

func (r PortRange) String() string {
	if r.Size == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", r.Base, r.Base+r.Size-1)
}

// ParsePortRange accepts kube-proxy's forms: "" (or "0", "0-0") for kernel-chosen ports,
// "begin-end", "begin+offset" (begin to begin+offset inclusive) and a single port.
func ParsePortRange(s string) (PortRange, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "0" || s == "0-0" {
		return PortRange{}, nil
	}
	var lo, hi int
	var err error
	switch {
	case strings.Contains(s, "-"):
		a, b, _ := strings.Cut(s, "-")
		if lo, err = strconv.Atoi(a); err == nil {
			hi, err = strconv.Atoi(b)
		}
	case strings.Contains(s, "+"):
		a, b, _ := strings.Cut(s, "+")
		var off int
		if lo, err = strconv.Atoi(a); err == nil {
			off, err = strconv.Atoi(b)
			hi = lo + off
			if err == nil && off < 0 {
				err = errors.New("negative offset")
			}
		}
	default:
		lo, err = strconv.Atoi(s)
		hi = lo
	}
	if err != nil {
		return PortRange{}, fmt.Errorf("port range %q: %w", s, err)
	}
	if lo < 1 || hi > 65535 || hi < lo {
		return PortRange{}, fmt.Errorf("port range %q: want 1 <= begin <= end <= 65535", s)
	}
	return PortRange{Base: lo, Size: hi - lo + 1}, nil
}

// ErrPortsExhausted is returned when every port of the range is in use.
var ErrPortsExhausted = errors.New("no free port left in the proxy port range")

// KernelPorts is the node's ephemeral port range (net.ipv4.ip_local_port_range) and the ports
// reserved in it (net.ipv4.ip_local_reserved_ports). Without --proxy-port-range the proxier
// hands out these ports itself, as the kernel would, instead of binding to port 0: the kernel's
// search for a free port walks the bound ports, so at 10,000 proxy sockets bind(0) alone took
// more than 3 s of a cold start, while a bind to a given port is one hash lookup.
type KernelPorts struct {
	Range    PortRange
	Reserved []PortRange
}

// portAllocator hands out ports of a PortRange, or of the kernel's ephemeral range when the
// range is kernel-chosen and that is known. Unlike the legacy allocator (a background filler
// goroutine and a one-second wait on an empty channel) it answers at once: a scan from a moving
// cursor over a bitmap.
type portAllocator struct {
	r PortRange
	// kernel: r is the kernel's ephemeral range, used for want of --proxy-port-range. Running
	// out of it is no error then: the kernel chooses (allocate returns 0).
	kernel bool
	mu     sync.Mutex
	used   []bool
	inUse  int
	cursor int
}

func newPortAllocator(r PortRange, kp KernelPorts) *portAllocator {
	kernel := false
	if r.IsKernelChosen() && kp.Range.Size > 0 {
		r, kernel = kp.Range, true
	}
	a := &portAllocator{r: r, kernel: kernel, used: make([]bool, r.Size)}
	if kernel {
		for _, res := range kp.Reserved {
			for p := res.Base; p < res.Base+res.Size; p++ {
				if idx := p - r.Base; idx >= 0 && idx < r.Size && !a.used[idx] {
					a.used[idx] = true
					a.inUse++
				}
			}
		}
	}
	if r.Size > 0 {
		a.cursor = rand.IntN(r.Size) // nodes that restart together do not all start at Base
	}
	return a
}

// allocate returns a free port, or 0 when the kernel should choose.
func (a *portAllocator) allocate() (uint16, error) {
	if a.r.IsKernelChosen() {
		return 0, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inUse == a.r.Size {
		if a.kernel {
			return 0, nil
		}
		return 0, fmt.Errorf("%w (%s, %d ports)", ErrPortsExhausted, a.r, a.r.Size)
	}
	for i := 0; i < a.r.Size; i++ {
		idx := (a.cursor + i) % a.r.Size
		if !a.used[idx] {
			a.used[idx] = true
			a.inUse++
			a.cursor = (idx + 1) % a.r.Size
			return uint16(a.r.Base + idx), nil
		}
	}
	if a.kernel {
		return 0, nil
	}
	return 0, fmt.Errorf("%w (%s)", ErrPortsExhausted, a.r)
}

// retries reports whether a port another process holds is worth trying the next one for.
func (a *portAllocator) retries() bool { return !a.r.IsKernelChosen() }

// release returns a port to the range; ports outside it (kernel-chosen) are ignored.
func (a *portAllocator) release(port uint16) {
	idx := int(port) - a.r.Base
	if a.r.IsKernelChosen() || idx < 0 || idx >= a.r.Size {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used[idx] {
		a.used[idx] = false
		a.inUse--
	}
}

// take claims a given port, one a restarted proxy finds the portal rules in force pointing at. It
// reports false when the port is outside --proxy-port-range or already in use here. Without a
// range any port may be taken (the kernel refuses the bind if another socket holds it).
func (a *portAllocator) take(port uint16) bool {
	if port == 0 {
		return false
	}
	idx := int(port) - a.r.Base
	if a.r.IsKernelChosen() || ((idx < 0 || idx >= a.r.Size) && a.kernel) {
		return true
	}
	if idx < 0 || idx >= a.r.Size {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used[idx] {
		return false
	}
	a.used[idx] = true
	a.inUse++
	return true
}
