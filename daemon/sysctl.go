package daemon

// sysctl.go applies kube-proxy's start-up tuning of the node and the process: the conntrack
// sysctls (--conntrack-*) and the OOM score (--oom-score-adj). Failures are logged, never fatal:
// an unprivileged container has a read-only /proc/sys and still proxies.

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
)

// sysctlValue is one integer sysctl, named by its path under /proc/sys.
type sysctlValue struct {
	name  string
	value int
}

// conntrackSysctls is what kube-proxy writes for the conntrack options on a node with cpus CPUs.
// A zero option leaves its sysctl as it is.
func conntrackSysctls(o *Options, cpus int) []sysctlValue {
	var out []sysctlValue
	add := func(name string, v int) { out = append(out, sysctlValue{"net/netfilter/" + name, v}) }
	if o.conntrackMaxPerCore > 0 {
		add("nf_conntrack_max", max(int(o.conntrackMaxPerCore)*cpus, int(o.conntrackMin)))
	}
	for _, t := range []struct {
		name string
		d    time.Duration
	}{
		{"nf_conntrack_tcp_timeout_established", o.conntrackTCPEstablished},
		{"nf_conntrack_tcp_timeout_close_wait", o.conntrackTCPCloseWait},
		{"nf_conntrack_udp_timeout", o.conntrackUDPTimeout},
		{"nf_conntrack_udp_timeout_stream", o.conntrackUDPStreamTimeout},
	} {
		if t.d > 0 {
			add(t.name, int(t.d/time.Second))
		}
	}
	if o.conntrackTCPBeLiberal {
		add("nf_conntrack_tcp_be_liberal", 1)
	}
	return out
}

// procSys reads and writes sysctls as files under a directory: /proc/sys on a node.
type procSys string

func (p procSys) get(name string) (int, error) {
	b, err := os.ReadFile(filepath.Join(string(p), name))
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

func (p procSys) set(name string, v int) error {
	// O_TRUNC without O_CREATE: a sysctl that does not exist is an error, not a new file.
	f, err := os.OpenFile(filepath.Join(string(p), name), os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(strconv.Itoa(v)); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// applySysctls writes each value that differs from the current one and returns how many it
// changed. Failures are logged.
func applySysctls(sys procSys, values []sysctlValue, log logrus.FieldLogger) int {
	changed := 0
	for _, v := range values {
		l := log.WithFields(logrus.Fields{"sysctl": v.name, "value": v.value})
		cur, err := sys.get(v.name)
		if err == nil && cur == v.value {
			continue
		}
		if err := sys.set(v.name, v.value); err != nil {
			l.WithError(err).Warn("Cannot set sysctl" + sysctlHint(err))
			continue
		}
		l.WithField("was", cur).Info("Set sysctl")
		changed++
	}
	return changed
}

func sysctlHint(err error) string {
	switch {
	case errors.Is(err, syscall.EROFS):
		return " (/proc/sys is read-only in an unprivileged container: set it on the node, or set the conntrack settings to 0 to leave them)"
	case errors.Is(err, os.ErrNotExist):
		return " (is the nf_conntrack module loaded?)"
	case errors.Is(err, os.ErrPermission):
		return " (needs root in the node's network namespace; nf_conntrack_max is read-only in other namespaces)"
	}
	return ""
}

// applyConntrackSysctls sets the conntrack sysctls as kube-proxy does at start.
func applyConntrackSysctls(o *Options, log logrus.FieldLogger) {
	applySysctls(procSys("/proc/sys"), conntrackSysctls(o, runtime.NumCPU()), log)
}

// applyOOMScoreAdj sets this process's oom_score_adj (--oom-score-adj, kube-proxy's -999 by
// default) so the kernel kills the node's service proxy last.
func applyOOMScoreAdj(o *Options, log logrus.FieldLogger) {
	setOOMScoreAdj("/proc/self/oom_score_adj", o.oomScoreAdj, log)
}

func setOOMScoreAdj(path string, v int32, log logrus.FieldLogger) {
	l := log.WithField("oomScoreAdj", v)
	if b, err := os.ReadFile(path); err == nil && strings.TrimSpace(string(b)) == strconv.Itoa(int(v)) {
		return
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(int(v))), 0); err != nil {
		hint := ""
		if errors.Is(err, os.ErrPermission) {
			hint = " (lowering it needs CAP_SYS_RESOURCE)"
		}
		l.WithError(err).Warn("Cannot set the OOM score adjustment" + hint)
		return
	}
	l.Info("Set the OOM score adjustment")
}
