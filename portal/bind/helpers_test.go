package bind

import "github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"

var (
	addrs = testenv.Addrs
	spn   = testenv.PortName
)
