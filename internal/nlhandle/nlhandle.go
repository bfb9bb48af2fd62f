// Package nlhandle keeps one rtnetlink handle open between operations (opening a socket costs
// more than a request), for the packages that talk rtnetlink through
// github.com/vishvananda/netlink: portal/bind and portal/transparent.
package nlhandle

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Timeout bounds each request; the kernel answers at once, it only bounds a broken socket.
const Timeout = 10 * time.Second

// Keeper holds the handle. Operations are serialized; the zero value is ready; Close releases it.
type Keeper struct {
	mu sync.Mutex
	h  *netlink.Handle
}

// Run runs fn with the handle, opening it first if needed, through do when set (for example
// netns.NS.Do: a handle opened there stays in that namespace). A handle whose socket failed (a
// timeout or a closed socket, not the kernel's answer to a request) is dropped, so the next
// operation starts clean.
func (k *Keeper) Run(ctx context.Context, do func(func() error) error, fn func(*netlink.Handle) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	run := func() error {
		if k.h == nil {
			h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
			if err != nil {
				return fmt.Errorf("netlink handle: %w", err)
			}
			if err := h.SetSocketTimeout(Timeout); err != nil {
				h.Close()
				return fmt.Errorf("netlink handle: %w", err)
			}
			k.h = h
		}
		err := fn(k.h)
		if SocketFailed(err) {
			k.h.Close()
			k.h = nil
		}
		return err
	}
	if do != nil {
		return do(run)
	}
	return run()
}

// Close closes the handle, if one is open. The next operation opens a new one.
func (k *Keeper) Close() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.h != nil {
		k.h.Close()
		k.h = nil
	}
	return nil
}

// SocketFailed tells whether err is a failure of the socket itself rather than the kernel's
// answer to a request: a timeout or a closed socket.
func SocketFailed(err error) bool {
	return errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EBADF) || errors.Is(err, unix.ENOTSOCK)
}
