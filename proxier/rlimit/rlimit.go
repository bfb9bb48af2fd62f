// Package rlimit raises the process's open-file limit (RLIMIT_NOFILE) as far as the system allows.
// Every proxied TCP connection costs two descriptors, so the soft default (often 1024) caps the proxy
// at a few hundred connections. Failing to raise it is reported, never fatal.
package rlimit

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Result reports what RaiseNoFile did.
type Result struct {
	// Before and After are the soft/hard limits before and after the call.
	Before, After unix.Rlimit
	// Want is the limit that was asked for.
	Want uint64
}

// Short reports whether the soft limit ended below the wanted value; the caller should warn.
func (r Result) Short() bool { return r.After.Cur < r.Want }

func (r Result) String() string {
	return fmt.Sprintf("RLIMIT_NOFILE soft %d hard %d (was soft %d hard %d, wanted %d)",
		r.After.Cur, r.After.Max, r.Before.Cur, r.Before.Max, r.Want)
}

// RaiseNoFile raises RLIMIT_NOFILE to want (both soft and hard). Raising the hard limit needs
// CAP_SYS_RESOURCE; without it, or when want exceeds fs.nr_open, the soft limit is raised to the hard
// limit instead and Result.Short reports the shortfall. An error means the limit could not be read or
// even the soft limit could not be raised; the process can still run with what it has.
func RaiseNoFile(want uint64) (Result, error) {
	var res Result
	res.Want = want
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &res.Before); err != nil {
		return res, fmt.Errorf("rlimit: get RLIMIT_NOFILE: %w", err)
	}
	res.After = res.Before
	if res.Before.Cur >= want {
		return res, nil
	}
	if res.Before.Max < want {
		raised := unix.Rlimit{Cur: want, Max: want}
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &raised); err == nil {
			res.After = raised
			return res, nil
		}
		// Not privileged, or want > fs.nr_open: fall back to the hard limit we have.
	}
	soft := unix.Rlimit{Cur: min(want, res.Before.Max), Max: res.Before.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &soft); err != nil {
		return res, fmt.Errorf("rlimit: set RLIMIT_NOFILE soft limit to %d: %w", soft.Cur, err)
	}
	res.After = soft
	return res, nil
}
