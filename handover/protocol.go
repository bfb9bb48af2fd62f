package handover

// protocol.go: the messages. The Unix socket is SOCK_SEQPACKET, so every message arrives whole
// and alone, with the descriptors sent with it.
//
//	new -> old  hello    {"version":1,"affinity":true}
//	old -> new  header   {"version":1,"sockets":N,"chunks":K,"affinity":A}   (or {"version":1,"error":"..."})
//	old -> new  K chunks [entry, ...] + SCM_RIGHTS, at most maxChunk descriptors each
//	old -> new  A chunks {"affinity":[...]}   ClientIP affinity entries (affinity.go), no descriptors;
//	                                          only to a successor whose hello asked, so A is 0
//	                                          (absent) between this build and an older one
//	new -> old  adopted  {"adopted":N}     the new process holds every socket now
//	new -> old  ready    {"ready":true}    the new process has synced and serves; the old one
//	                                       stops accepting and finishes what it has
//
// Until ready, both processes serve the same sockets. If the new process goes away before ready
// (crash, failed start), the old one notices the closed connection and simply goes on serving.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// Version is the protocol version this build speaks. A process of another version is refused
// with a clear error; the new process then starts as if no process ran.
const Version = 1

// maxChunk is the most descriptors sent in one message (the kernel allows 253, SCM_MAX_FD).
const maxChunk = 200

// maxSockets bounds the sockets a header may announce: a proxy at 10,000 service ports in two
// families with node ports and health checks holds a few tens of thousands.
const maxSockets = 1 << 20

// maxMessage bounds one message: a chunk's manifest is ~100 bytes per entry.
const maxMessage = 64 << 10

type hello struct {
	Version int `json:"version"`
	// Affinity: the successor takes the affinity table (affinity.go). Older builds neither send
	// nor read it.
	Affinity bool `json:"affinity,omitempty"`
}

type header struct {
	Version int    `json:"version"`
	Sockets int    `json:"sockets"`
	Chunks  int    `json:"chunks"`
	Error   string `json:"error,omitempty"`
	// Affinity is the number of affinity messages after the socket chunks; only sent to a
	// successor that asked.
	Affinity int `json:"affinity,omitempty"`
}

type reply struct {
	Adopted *int `json:"adopted,omitempty"`
	Ready   bool `json:"ready,omitempty"`
}

// ErrVersion is returned when the other process speaks another protocol version.
var ErrVersion = errors.New("handover: protocol version mismatch")

func send(c *net.UnixConn, msg any, fds []int) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	return err
}

// receive reads one message into msg and returns the descriptors that came with it (owned by the
// caller, close-on-exec).
func receive(c *net.UnixConn, msg any) ([]int, error) {
	b, fds, err := receiveRaw(c)
	if err == nil {
		err = json.Unmarshal(b, msg)
	}
	if err != nil {
		closeAll(fds)
		return nil, err
	}
	return fds, nil
}

// receiveRaw reads one message whole and the descriptors that came with it (owned by the caller,
// close-on-exec).
func receiveRaw(c *net.UnixConn) ([]byte, []int, error) {
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(maxChunk*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, nil, err
	}
	fds, perr := parseRights(oob[:oobn])
	switch {
	case perr != nil:
		err = perr
	case flags&unix.MSG_CTRUNC != 0:
		err = errors.New("descriptors truncated (MSG_CTRUNC)")
	case flags&unix.MSG_TRUNC != 0:
		err = errors.New("message truncated")
	case n == 0:
		err = errors.New("connection closed") // SOCK_SEQPACKET: a zero-length read is EOF
	}
	if err != nil {
		closeAll(fds)
		return nil, nil, err
	}
	return buf[:n], fds, nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("control message: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			closeAll(fds)
			return nil, fmt.Errorf("control message: %w", err)
		}
		for _, fd := range got {
			unix.CloseOnExec(fd)
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// chunks cuts n items into pieces of at most maxChunk: [start, end) pairs.
func chunks(n int) [][2]int {
	var out [][2]int
	for i := 0; i < n; i += maxChunk {
		out = append(out, [2]int{i, min(i+maxChunk, n)})
	}
	return out
}

// deadline sets c's deadline timeout from now (no deadline for 0).
func deadline(c *net.UnixConn, now time.Time, timeout time.Duration) {
	if timeout <= 0 {
		_ = c.SetDeadline(time.Time{})
		return
	}
	_ = c.SetDeadline(now.Add(timeout))
}
