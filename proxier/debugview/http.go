package debugview

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
)

//go:embed status.html
var statusPage []byte

// Source is what the views show: the proxier implements it.
type Source interface {
	// Services describes every service port, open or not, sorted by name.
	Services() []ServiceView
	// Connections lists live TCP connections and UDP sessions, only those of service ports
	// whose name contains svc and whose client address contains client ("" matches all).
	Connections(svc, client string) []ConnView
}

// Register adds the debug endpoints and the status page of src to mux:
//
//	/                    the status page (HTML, refreshes itself)
//	/debug/services      every service port: portals, proxy port, endpoints, affinity, counters
//	/debug/connections   live TCP connections and UDP sessions (?service=…&client=… filter)
//
// Each /debug endpoint answers JSON for tools (?format=json or Accept: application/json) and
// aligned text for curl. They show client addresses: serve them on a loopback address.
func Register(mux *http.ServeMux, src Source) {
	mux.HandleFunc("/{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write(statusPage)
	})
	mux.HandleFunc("/debug/services", func(w http.ResponseWriter, r *http.Request) {
		serveView(w, r, src.Services(), "SERVICE PORT\tPROTO\tPORTALS\tLISTEN\tENDPOINTS\tAFFINITY\tACTIVE\tTOTAL\tBYTES IN/OUT", func(tw io.Writer, v ServiceView) {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d/%d\n", v.Name, v.Protocol, portals(v),
				strings.Join(v.Listen, ","), endpointsText(v.Endpoints), v.Affinity, v.Active, v.Total, v.BytesToEndpoint, v.BytesToClient)
			for _, t := range []struct {
				class string
				view  *TrafficView
			}{{"cluster traffic", v.Internal}, {"external traffic", v.External}} {
				if t.view != nil {
					fmt.Fprintf(tw, "\t\t%s\n", trafficText(t.class, t.view))
				}
			}
			if line := dataPathText(v); line != "" {
				fmt.Fprintf(tw, "\t\t%s\n", line)
			}
			fmt.Fprintf(tw, "\t\t%s\n", balancingText(v))
			if line := connectionPolicyText(v); line != "" {
				fmt.Fprintf(tw, "\t\t%s\n", line)
			}
			if line := drainText(v); line != "" {
				fmt.Fprintf(tw, "\t\t%s\n", line)
			}
			for _, a := range v.AffinityEntries {
				fmt.Fprintf(tw, "\t\tsticky %s -> %s (idle %s)\t\t\t\t\t\t\n", a.Client, a.Endpoint, a.IdleFor)
			}
		})
	})
	mux.HandleFunc("/debug/connections", func(w http.ResponseWriter, r *http.Request) {
		views := src.Connections(r.URL.Query().Get("service"), r.URL.Query().Get("client"))
		serveView(w, r, views, "SERVICE PORT\tPROTO\tCLIENT\tENDPOINT\tAGE\tBYTES IN\tBYTES OUT", func(tw io.Writer, c ConnView) {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\n", c.Service, c.Protocol, c.Client, c.Endpoint, c.Age, c.BytesToEndpoint, c.BytesToClient)
		})
	})
}

// serveView answers views as JSON when the client asks for it, otherwise as an aligned text table:
// the header line, then what row writes for each view.
func serveView[V any](w http.ResponseWriter, r *http.Request, views []V, header string, row func(io.Writer, V)) {
	if wantsJSON(r) {
		writeJSON(w, views)
		return
	}
	tw := textWriter(w)
	fmt.Fprintln(tw, header)
	for _, v := range views {
		row(tw, v)
	}
	_ = tw.Flush()
}

func portals(v ServiceView) string {
	var parts []string
	for _, group := range [][]string{v.ClusterIPs, v.ExternalIPs, v.LoadBalancerIPs} {
		for _, ip := range group {
			if strings.Contains(ip, ":") {
				ip = "[" + ip + "]"
			}
			parts = append(parts, fmt.Sprintf("%s:%d", ip, v.Port))
		}
	}
	if v.NodePort != 0 {
		parts = append(parts, fmt.Sprintf("nodePort %d", v.NodePort))
	}
	return strings.Join(parts, ",")
}

func endpointsText(eps []EndpointView) string {
	if len(eps) == 0 {
		return "<none>"
	}
	parts := make([]string, len(eps))
	for i, e := range eps {
		state := "not-ready"
		switch {
		case e.Ready:
			state = "ready"
		case e.Serving && e.Terminating:
			state = "terminating"
		}
		if !e.InUse {
			state += ",unused"
		}
		parts[i] = e.Address + "(" + state + ")"
	}
	return strings.Join(parts, " ")
}

// balancingText is the line of a port's balancing policy and its endpoints' live flow counts.
func balancingText(v ServiceView) string {
	var counts []string
	for _, e := range v.Endpoints {
		if e.InUse {
			c := fmt.Sprintf("%s=%d", e.Address, e.Active)
			if e.EjectedFor != "" {
				c += "(ejected " + e.EjectedFor + ")"
			}
			if e.WarmingPercent > 0 {
				c += fmt.Sprintf("(warming %d%%)", e.WarmingPercent)
			}
			counts = append(counts, c)
		}
	}
	line := "balancing: " + v.Balancing.Algorithm
	if b := v.Balancing; b.OutlierConsecutiveFailures > 0 {
		line += fmt.Sprintf(" outlier[%d failures, %s, max %d%%]", b.OutlierConsecutiveFailures, b.OutlierEjectionTime, b.OutlierMaxEjectionPercent)
	}
	if b := v.Balancing; b.SlowStart != "" {
		line += " slow-start[" + b.SlowStart + "]"
	}
	return line + " active[" + strings.Join(counts, " ") + "]"
}

// trafficText is one line of the endpoints a class of traffic uses and why.
func trafficText(class string, t *TrafficView) string {
	eps := strings.Join(t.Endpoints, " ")
	if t.Refused {
		eps = "REFUSED (no endpoint)"
	}
	if t.Held {
		eps = "HELD (no endpoint; new connections wait for one)"
	}
	return class + ": " + eps + " [" + t.Reason + "]"
}

func wantsJSON(r *http.Request) bool {
	return r.URL.Query().Get("format") == "json" || strings.Contains(r.Header.Get("Accept"), "application/json")
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func textWriter(w http.ResponseWriter) *tabwriter.Writer {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
}

// drainText is a port's drain-timeout and its endpoints waiting for their deadline; "" when it
// has neither.
func drainText(v ServiceView) string {
	if v.DrainTimeout == "" && len(v.Draining) == 0 {
		return ""
	}
	line := "drain: node default (--drain-removed-endpoints)"
	if v.DrainTimeout != "" {
		line = "drain: close " + v.DrainTimeout + " after leaving the rotation"
	}
	for _, d := range v.Draining {
		line += "; " + d.Endpoint + " closes in " + d.ClosesIn
	}
	return line
}

// connectionPolicyText is the /debug/services line of a port's connection policies, or "".
func connectionPolicyText(v ServiceView) string {
	var parts []string
	if v.ProxyProtocol != "" {
		parts = append(parts, "proxy-protocol "+v.ProxyProtocol)
	}
	if v.SourceMode != "" {
		parts = append(parts, "source "+v.SourceMode)
	}
	if h := v.Hold; h != nil {
		parts = append(parts, fmt.Sprintf("hold[%s, %d held, max %d]", h.Timeout, h.Held, h.Limit))
	}
	if len(parts) == 0 {
		return ""
	}
	return "connections: " + strings.Join(parts, " ")
}

// dataPathText is the line of a port's data path, with the kernel counters of a kernel port.
func dataPathText(v ServiceView) string {
	if v.DataPath == "" {
		return ""
	}
	line := "path " + v.DataPath
	for i, k := range v.Kernel {
		sep := ", "
		if i == 0 {
			sep = ": "
		}
		line += fmt.Sprintf("%s%s %s %d connections (%d B first packets)", sep, k.Endpoint, k.Chain, k.Packets, k.Bytes)
	}
	return line
}
