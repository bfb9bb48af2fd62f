// Package procstat reads what a process tree costs from /proc: CPU time (utime+stime of
// /proc/<pid>/stat, every thread included), resident memory and open descriptors, and a
// process's age. The tree is the process and its descendants, so nginx's master and workers count
// together. The benchmark tools and the daemon's start-up log share it.
package procstat

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of utime and stime in /proc/<pid>/stat (100 on every Linux architecture
// Go supports).
const userHZ = 100

// Tree returns pid and its descendants (none for pid 0, the direct path).
func Tree(pid int) []int {
	if pid == 0 {
		return nil
	}
	pids := []int{pid}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread exited
		}
		for _, c := range strings.Fields(string(b)) {
			if child, err := strconv.Atoi(c); err == nil {
				pids = append(pids, Tree(child)...)
			}
		}
	}
	return pids
}

// statFields returns the fields of /proc/<pid>/stat after the command name (field 3 onwards).
func statFields(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	s := string(b)
	return strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
}

// Age is how long ago pid started (starttime, field 22 of /proc/<pid>/stat, against
// /proc/uptime), to the clock tick (10 ms).
func Age(pid int) (time.Duration, error) {
	f := statFields(pid)
	up, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0, err
	}
	upf := strings.Fields(string(up))
	if len(f) < 20 || len(upf) < 1 {
		return 0, fmt.Errorf("/proc/%d/stat or /proc/uptime: not the expected fields", pid)
	}
	ticks, err := strconv.ParseInt(f[19], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/%d/stat starttime: %w", pid, err)
	}
	uptime, err := strconv.ParseFloat(upf[0], 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/uptime: %w", err)
	}
	return time.Duration(uptime*float64(time.Second)) - time.Duration(ticks)*time.Second/userHZ, nil
}

// CPUTime is utime+stime over the tree of pid.
func CPUTime(pid int) time.Duration {
	var ticks int64
	for _, p := range Tree(pid) {
		if f := statFields(p); len(f) > 12 {
			u, _ := strconv.ParseInt(f[11], 10, 64)
			s, _ := strconv.ParseInt(f[12], 10, 64)
			ticks += u + s
		}
	}
	return time.Duration(ticks) * time.Second / userHZ
}

// RSSKiB is VmRSS summed over the tree of pid.
func RSSKiB(pid int) int64 {
	var total int64
	for _, p := range Tree(pid) {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
				if f := strings.Fields(v); len(f) > 0 {
					n, _ := strconv.ParseInt(f[0], 10, 64)
					total += n
				}
			}
		}
	}
	return total
}

// FDCount is the number of open descriptors over the tree of pid.
func FDCount(pid int) int {
	n := 0
	for _, p := range Tree(pid) {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p))
		n += len(ents)
	}
	return n
}

// OwnCPUTime is utime+stime of pid itself and cutime+cstime of its children that have exited and
// were waited for (the iptables commands a proxy runs, for instance).
func OwnCPUTime(pid int) (self, children time.Duration) {
	f := statFields(pid)
	if len(f) <= 14 {
		return 0, 0
	}
	ticks := func(i, j int) time.Duration {
		a, _ := strconv.ParseInt(f[i], 10, 64)
		b, _ := strconv.ParseInt(f[j], 10, 64)
		return time.Duration(a+b) * time.Second / userHZ
	}
	return ticks(11, 12), ticks(13, 14)
}

// PeakRSSKiB is the VmHWM (the highest RSS so far) of pid.
func PeakRSSKiB(pid int) int64 { return StatusKiB(pid, "VmHWM") }

// StatusKiB is the kB value of one field of /proc/<pid>/status (VmRSS, VmHWM, ...) of pid alone,
// its children not counted; 0 when the process or the field is gone.
func StatusKiB(pid int, field string) int64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				n, _ := strconv.ParseInt(f[0], 10, 64)
				return n
			}
		}
	}
	return 0
}
