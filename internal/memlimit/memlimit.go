// Package memlimit finds the memory limit of the cgroup the process runs in, so the daemon can
// give the Go runtime a soft memory limit below it (runtime/debug.SetMemoryLimit): the runtime
// does not read the cgroup's limit itself, so without it a container with a memory limit is
// OOM-killed at a heap peak (a cold start at 10,000 services, a scrape of every port's series)
// that a few more collections would have kept under the limit.
package memlimit

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// Limit is a cgroup memory limit and the cgroup file that set it.
type Limit struct {
	Bytes int64
	File  string
}

// FromCgroup returns the tightest memory limit over the process's cgroup and its ancestors (a
// pod's limit may sit on the pod's cgroup, the container's on its own), reading the membership
// from selfCgroup (the contents of /proc/self/cgroup) and the limits below root (/sys/fs/cgroup).
// cgroup v2 (memory.max) and v1 (the memory controller's memory.limit_in_bytes) are read; no
// limit anywhere gives a zero Limit and no error. A limit file that cannot be parsed is an error
// naming it; one that is absent (a cgroup without the memory controller) is skipped.
func FromCgroup(selfCgroup []byte, root string) (Limit, error) {
	rel, file, err := memoryCgroup(selfCgroup)
	if err != nil {
		return Limit{}, err
	}
	if rel == "" {
		return Limit{}, nil
	}
	base := root
	if file == "memory.limit_in_bytes" {
		base = filepath.Join(root, "memory")
	}
	var best Limit
	for dir := path.Clean("/" + rel); ; dir = path.Dir(dir) {
		p := filepath.Join(base, filepath.FromSlash(dir), file)
		n, err := readLimit(p)
		if err != nil {
			return Limit{}, err
		}
		if n > 0 && (best.Bytes == 0 || n < best.Bytes) {
			best = Limit{Bytes: n, File: p}
		}
		if dir == "/" {
			return best, nil
		}
	}
}

// memoryCgroup reads /proc/self/cgroup's contents: the path of the v1 memory controller's cgroup
// (with the v1 limit file's name) when there is one, else the v2 unified hierarchy's.
func memoryCgroup(selfCgroup []byte) (rel, file string, err error) {
	sc := bufio.NewScanner(bytes.NewReader(selfCgroup))
	var unified string
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			return "", "", fmt.Errorf("/proc/self/cgroup: line %q is not id:controllers:path", line)
		}
		if parts[0] == "0" && parts[1] == "" {
			unified = parts[2]
			continue
		}
		for c := range strings.SplitSeq(parts[1], ",") {
			if c == "memory" {
				return parts[2], "memory.limit_in_bytes", nil
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", "", fmt.Errorf("/proc/self/cgroup: %w", err)
	}
	return unified, "memory.max", nil
}

// readLimit reads one limit file: 0 for none ("max", v1's huge "unlimited" value, or no file).
func readLimit(p string) (int64, error) {
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read memory limit %s: %w", p, err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("memory limit %s: %q is neither a byte count nor \"max\"", p, s)
	}
	if n >= 1<<62 { // v1 writes "no limit" as the largest page-aligned int64
		return 0, nil
	}
	return int64(n), nil
}

// Soft is the soft memory limit the daemon gives the runtime under a cgroup limit of hard bytes:
// nine tenths, leaving room for what the runtime does not count (the binary's pages, memory the
// kernel charges for the proxy's sockets and pipes).
func Soft(hard int64) int64 { return hard / 10 * 9 }
