package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/term"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// CaptureWriter writes a capture file from the stream's items (package observe/pcap): the flows
// name the addresses, the payloads carry the bytes.
type CaptureWriter interface {
	WriteItem(*observe.Item) error
	Close() error
}

// Env is what the command uses besides its flags. Only Stdout and Stderr are required.
type Env struct {
	Stdout, Stderr io.Writer
	// NewCapture starts a capture on w (--pcap); nil: this build cannot write captures.
	NewCapture func(w io.Writer) (CaptureWriter, error)
	// NewClientset builds the API client for --node and --all-nodes; nil: kubernetes.NewForConfig.
	NewClientset func(*rest.Config) (kubernetes.Interface, error)
	// Clock times the --all-nodes --follow reorder window; nil: the real clock.
	Clock clock.Clock
	// Location prints the TIME column; nil: the local time zone.
	Location *time.Location
	// ReorderWindow is how long a followed item may wait for the other nodes' streams; 0: 250ms.
	ReorderWindow time.Duration
}

func (e *Env) clock() clock.Clock {
	if e.Clock != nil {
		return e.Clock
	}
	return clock.RealClock{}
}

func (e *Env) reorderWindow() time.Duration {
	if e.ReorderWindow != 0 {
		return e.ReorderWindow
	}
	return 250 * time.Millisecond
}

func (e *Env) newClientset(cfg *rest.Config) (kubernetes.Interface, error) {
	if e.NewClientset != nil {
		return e.NewClientset(cfg)
	}
	return defaultClientset(cfg)
}

const prefix = "kube-portal-proxy observe: "

// Main runs `kube-portal-proxy observe args...` until its streams end or ctx is done (SIGINT).
// It returns the exit code: 0 done, 1 failed (every stream failed), 2 bad command line.
func Main(ctx context.Context, args []string, env Env) int {
	o, err := Parse(args, env.Stdout)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(env.Stderr, "%s%v\n", prefix, err)
		return 2
	}
	if o.PCAP != "" && env.NewCapture == nil {
		fmt.Fprintf(env.Stderr, "%s--pcap: this build cannot write captures\n", prefix)
		return 2
	}
	if err := run(ctx, o, &env); err != nil {
		fmt.Fprintf(env.Stderr, "%s%v\n", prefix, err)
		return 1
	}
	return 0
}

// output is where items go: stdout (a table or NDJSON), stderr (lost events) and the capture.
type output struct {
	stdout, stderr io.Writer
	json           bool
	table          *printer
	follow         bool // print rows as they come, else measure the whole table first
	capture        CaptureWriter
	flows          int
}

func (w *output) item(it *item) error {
	if w.capture != nil && (it.Flow != nil || it.Payload != nil) {
		if err := w.capture.WriteItem(&it.Item); err != nil {
			return fmt.Errorf("--pcap: %w", err)
		}
	}
	if it.Lost != nil {
		fmt.Fprintln(w.stderr, lostText(it.Lost, it.node))
	}
	if w.json {
		if _, err := w.stdout.Write(append(it.raw, '\n')); err != nil {
			return fmt.Errorf("stdout: %w", err)
		}
		return nil
	}
	if it.Flow == nil {
		return nil
	}
	w.flows++
	w.table.add(it.Flow)
	if w.follow {
		return w.flush()
	}
	return nil
}

func (w *output) flush() error {
	if err := w.table.flush(); err != nil {
		return fmt.Errorf("stdout: %w", err)
	}
	return nil
}

func run(ctx context.Context, o *Options, env *Env) (err error) {
	ts, err := o.targets(ctx, env)
	if err != nil {
		return err
	}
	loc := env.Location
	if loc == nil {
		loc = time.Local
	}
	w := &output{stdout: env.Stdout, stderr: env.Stderr, json: o.Output == "json", follow: o.Follow,
		table: newPrinter(env.Stdout, o.Output == "wide", useColor(o.Color, env.Stdout), loc)}
	if o.PCAP != "" {
		f, err := os.Create(o.PCAP)
		if err != nil {
			return fmt.Errorf("--pcap: %w", err)
		}
		defer func() {
			if cerr := f.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("--pcap: %w", cerr)
			}
		}()
		if w.capture, err = env.NewCapture(f); err != nil {
			return fmt.Errorf("--pcap %s: %w", o.PCAP, err)
		}
		defer func() {
			if cerr := w.capture.Close(); cerr != nil && err == nil {
				err = fmt.Errorf("--pcap %s: %w", o.PCAP, cerr)
			}
		}()
	}
	failed, err := pump(ctx, o, env, ts, w)
	if err != nil {
		return err
	}
	if err := w.flush(); err != nil {
		return err
	}
	if failed == len(ts) {
		if len(ts) == 1 {
			return fmt.Errorf("the stream failed")
		}
		return fmt.Errorf("every node's stream failed")
	}
	if !o.Follow && w.flows == 0 && !w.json {
		fmt.Fprintln(env.Stderr, "No flows.")
	}
	return nil
}

// pump reads every target's stream, one goroutine each, and writes their items in order: as
// they come from one stream; sorted by time from several (merged while they are followed, else
// collected first). A stream that fails is reported on stderr; the others go on. It returns how
// many failed, or the error that stopped the output.
func pump(ctx context.Context, o *Options, env *Env, ts []target, w *output) (failed int, err error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	events := readAll(ctx, &wg, ts)
	clk := env.clock()
	m := newMerger(len(ts), env.reorderWindow())
	var collected []item
	wake := alarm{clk: clk}
	defer wake.set(0)
	for open := len(ts); open > 0; {
		select {
		case <-ctx.Done():
			return failed, nil
		case <-wake.c():
		case e := <-events:
			switch {
			case e.done:
				open--
				m.close(e.src)
				if e.err != nil {
					failed++
					fmt.Fprintf(env.Stderr, "%s%v\n", prefix, e.err)
				}
			case len(ts) == 1:
				if err := w.item(&e.item); err != nil {
					return failed, err
				}
				continue
			case !o.Follow:
				collected = append(collected, e.item)
				continue
			default:
				m.add(e.item, clk.Now())
			}
		}
		out, wait := m.ready(clk.Now())
		for i := range out {
			if err := w.item(&out[i]); err != nil {
				return failed, err
			}
		}
		wake.set(wait)
	}
	return failed, writeCollected(o, collected, w)
}

// alarm is a timer that may be unset, its channel nil.
type alarm struct {
	clk clock.Clock
	t   clock.Timer
}

func (a *alarm) c() <-chan time.Time {
	if a.t == nil {
		return nil
	}
	return a.t.C()
}

// set stops the timer and, for d > 0, starts one that fires after d.
func (a *alarm) set(d time.Duration) {
	if a.t != nil {
		a.t.Stop()
		a.t = nil
	}
	if d > 0 {
		a.t = a.clk.NewTimer(d)
	}
}

// readAll starts a reader of each target's stream, in goroutines that wg owns and ctx ends. Each
// sends its stream's items to the channel returned, then an event with done set.
func readAll(ctx context.Context, wg *sync.WaitGroup, ts []target) <-chan event {
	events := make(chan event, 64)
	for i, t := range ts {
		wg.Go(func() {
			err := readStream(ctx, i, t, events)
			select {
			case events <- event{item: item{src: i}, done: true, err: err}:
			case <-ctx.Done():
			}
		})
	}
	return events
}

// writeCollected writes the items of several streams that were not followed, sorted by time.
func writeCollected(o *Options, collected []item, w *output) error {
	sort.SliceStable(collected, func(i, j int) bool { return collected[i].time().Before(collected[j].time()) })
	if o.Last >= 0 && len(collected) > o.Last {
		// Each node sent its last N: the merged stream keeps the last N of all.
		collected = collected[len(collected)-o.Last:]
	}
	for i := range collected {
		if err := w.item(&collected[i]); err != nil {
			return err
		}
	}
	return nil
}

// useColor decides --color: auto colours a terminal only.
func useColor(mode string, out io.Writer) bool {
	switch mode {
	case "always":
		return true
	case "never":
		return false
	}
	f, ok := out.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}
