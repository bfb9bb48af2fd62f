package portal

import (
	"errors"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// nlMessage builds one netlink message with header fields and payload, as the kernel sends it.
func nlMessage(typ, flags uint16, seq uint32, payload []byte) []byte {
	b := make([]byte, unix.SizeofNlMsghdr, nlAlign(unix.SizeofNlMsghdr+len(payload)))
	ne.PutUint32(b[0:], uint32(unix.SizeofNlMsghdr+len(payload)))
	ne.PutUint16(b[4:], typ)
	ne.PutUint16(b[6:], flags)
	ne.PutUint32(b[8:], seq)
	b = append(b, payload...)
	return b[:cap(b)]
}

func TestParseNlError(t *testing.T) {
	errnoBytes := func(e int32) []byte {
		b := make([]byte, 4)
		ne.PutUint32(b, uint32(e))
		return b
	}
	echoed := make([]byte, unix.SizeofNlMsghdr) // the request header, capped (no payload)
	ne.PutUint32(echoed, 64)
	withMsg := append(append(errnoBytes(-int32(unix.EOPNOTSUPP)), echoed...), attrString(unix.NLMSGERR_ATTR_MSG, "Unknown device type")...)

	tests := []struct {
		name      string
		msg       []byte
		wantErr   string
		wantErrno error
	}{
		{name: "ack", msg: nlMessage(unix.NLMSG_ERROR, 0, 1, append(errnoBytes(0), echoed...))},
		{name: "plain_error", msg: nlMessage(unix.NLMSG_ERROR, 0, 1, append(errnoBytes(-int32(unix.ENODEV)), echoed...)),
			wantErr: "RTM_GETLINK x: no such device", wantErrno: unix.ENODEV},
		{name: "extended_ack_message", msg: nlMessage(unix.NLMSG_ERROR, unix.NLM_F_CAPPED|unix.NLM_F_ACK_TLVS, 1, withMsg),
			wantErr: "RTM_GETLINK x: operation not supported (Unknown device type)", wantErrno: unix.EOPNOTSUPP},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msgs, err := parseNlMsgs(tt.msg)
			if err != nil || len(msgs) != 1 {
				t.Fatalf("parseNlMsgs = %v, %v; want one message", msgs, err)
			}
			err = parseNlError("RTM_GETLINK x", msgs[0])
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.wantErr {
				t.Errorf("error = %q, want %q", got, tt.wantErr)
			}
			if tt.wantErrno != nil && !errors.Is(err, tt.wantErrno) {
				t.Errorf("errors.Is(%v, %v) = false", err, tt.wantErrno)
			}
		})
	}
}

func TestParseNlMsgsRejectsBadLengths(t *testing.T) {
	good := nlMessage(unix.RTM_NEWADDR, 0, 0, make([]byte, 8))
	for name, b := range map[string][]byte{
		"length_beyond_the_datagram": append([]byte{0xff, 0, 0, 0}, good[4:]...),
		"length_below_the_header":    append([]byte{4, 0, 0, 0}, good[4:]...),
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := parseNlMsgs(b); err == nil {
				t.Errorf("parseNlMsgs accepted a malformed message")
			}
		})
	}
}

func TestParseIfAddrPrefersLocal(t *testing.T) {
	body := make([]byte, unix.SizeofIfAddrmsg)
	body[0], body[1] = unix.AF_INET, 32
	ne.PutUint32(body[4:], 7)
	body = append(body, attr(unix.IFA_ADDRESS, []byte{10, 0, 0, 2})...) // the peer, on a point-to-point link
	body = append(body, attr(unix.IFA_LOCAL, []byte{10, 96, 0, 10})...)
	p, idx, ok := parseIfAddr(body)
	if !ok || idx != 7 || p != netip.MustParsePrefix("10.96.0.10/32") {
		t.Errorf("parseIfAddr = %v, %d, %v; want 10.96.0.10/32 on index 7", p, idx, ok)
	}
}

func TestIsLocalRoute6(t *testing.T) {
	a := netip.MustParseAddr("fd00:96::10")
	route := func(typ uint8, bits uint8, dst netip.Addr) nlMsg {
		b := make([]byte, unix.SizeofRtMsg)
		b[0], b[1], b[7] = unix.AF_INET6, bits, typ
		return nlMsg{hdr: unix.NlMsghdr{Type: unix.RTM_NEWROUTE}, data: append(b, attr(unix.RTA_DST, dst.AsSlice())...)}
	}
	tests := []struct {
		name string
		m    nlMsg
		want bool
	}{
		{"local_route_of_the_address", route(unix.RTN_LOCAL, 128, a), true},
		{"prefix_route_of_the_address", route(unix.RTN_UNICAST, 128, a), false},
		{"local_route_of_another_address", route(unix.RTN_LOCAL, 128, netip.MustParseAddr("fd00:96::11")), false},
		{"local_prefix", route(unix.RTN_LOCAL, 64, a), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := isLocalRoute6(tt.m, a); got != tt.want {
				t.Errorf("isLocalRoute6 = %v, want %v", got, tt.want)
			}
		})
	}
}
