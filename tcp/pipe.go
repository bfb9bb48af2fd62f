package tcp

import (
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// pipeSize is asked with F_SETPIPE_SZ: one splice moves up to this much, so a bulk burst needs fewer
// syscalls than with the 64 KiB default (Go's own splice uses 1 MiB). Pipe pages exist only while
// data is in flight; 256 KiB was not tuned further (see the benchmarks in the report).
const pipeSize = 256 << 10

// pipe is a kernel pipe used as the splice buffer between two sockets.
type pipe struct {
	r, w int
	size int
}

// pipePool keeps a few empty pipes for reuse. Only directions that are moving data hold one, so the
// pool stays small; pipes beyond the cap are closed rather than kept (sync.Pool would drop them
// without closing the descriptors).
type pipePool struct {
	mu   sync.Mutex
	free []*pipe
	max  int
}

// pipes is shared by every proxy in the process: pipes carry no per-service state.
var pipes = &pipePool{max: 4 * runtime.GOMAXPROCS(0)}

func (pp *pipePool) get() (*pipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	return newPipe()
}

// put returns p; a pipe that still holds data (clean=false) is closed, never reused.
func (pp *pipePool) put(p *pipe, clean bool) {
	if clean {
		pp.mu.Lock()
		if len(pp.free) < pp.max {
			pp.free = append(pp.free, p)
			pp.mu.Unlock()
			return
		}
		pp.mu.Unlock()
	}
	unix.Close(p.r)
	unix.Close(p.w)
}

func newPipe() (*pipe, error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return nil, fmt.Errorf("create splice pipe: %w", err)
	}
	p := &pipe{r: fds[0], w: fds[1], size: 64 << 10}
	if n, err := unix.FcntlInt(uintptr(p.w), unix.F_SETPIPE_SZ, pipeSize); err == nil {
		p.size = n
	}
	return p, nil
}
