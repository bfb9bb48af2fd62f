package main

import (
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"runtime"

	"github.com/kube-portal-proxy/kube-portal-proxy/bench/iouring"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/rlimit"
)

var (
	iouThreads = flag.Int("iouring-threads", 0, "io_uring loops (role iouring); 0 = GOMAXPROCS")
	iouSpareP  = flag.Bool("iouring-spare-p", false, "role iouring: GOMAXPROCS = loops+1, so a P is idle while every loop waits in io_uring_enter")
)

// runIouring runs the io_uring forwarder experiment (bench/iouring) for the echo and sink
// endpoints, one ring and one SO_REUSEPORT listener per route on each of its threads.
func runIouring() error {
	rlimit.RaiseNoFile(1 << 20)
	threads := *iouThreads
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	if *iouSpareP {
		// With every P in a system call and none idle, sysmon hands a waiting loop's P to another
		// thread after 20 µs (retake, handoffp, a futex wake-up), in every wait.
		runtime.GOMAXPROCS(threads + 1)
	}
	routes := []iouring.Route{
		{Listen: netip.MustParseAddrPort(*listenEcho), Endpoint: netip.MustParseAddrPort(*echoEP)},
		{Listen: netip.MustParseAddrPort(*listenSink), Endpoint: netip.MustParseAddrPort(*sinkEP)},
	}
	f, bound, err := iouring.New(routes, threads)
	if err != nil {
		return err
	}
	fmt.Printf("echo %s\nsink %s\n", bound[0], bound[1])
	go func() {
		io.Copy(io.Discard, os.Stdin) // exit when the parent goes
		os.Exit(0)
	}()
	return f.Run()
}
