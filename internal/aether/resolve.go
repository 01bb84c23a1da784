package aether

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
)

// Resolver answers the names sandboxes ask for: from the operator's hosts
// file first (answers marked trusted: they may be loopback or private, for
// test upstreams and node-local mirrors), then from DNS. The sandbox never
// resolves anything itself, so what it connects to is what the edge found.
type Resolver struct {
	hosts map[string][]netip.Addr
	dns   *net.Resolver
}

// NewResolver answers from hosts (name → addresses; may be nil) before DNS.
func NewResolver(hosts map[string][]netip.Addr) *Resolver {
	return &Resolver{hosts: hosts, dns: net.DefaultResolver}
}

// Resolve returns host's addresses and whether they came from the hosts file.
func (r *Resolver) Resolve(ctx context.Context, host string) ([]netip.Addr, bool, error) {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if a, ok := r.hosts[host]; ok {
		return a, true, nil
	}
	addrs, err := r.dns.LookupNetIP(ctx, "ip", host)
	if err != nil {
		var de *net.DNSError
		if errors.As(err, &de) && de.IsNotFound {
			return nil, false, fmt.Errorf("%s: no such host", host)
		}
		return nil, false, err
	}
	for i := range addrs {
		addrs[i] = addrs[i].Unmap()
	}
	return addrs, false, nil
}

// LoadHosts reads a hosts-format file (`ADDRESS NAME [NAME...]`, '#'
// comments) into the map NewResolver takes. `dsec up|edge --hosts FILE`.
func LoadHosts(path string) (map[string][]netip.Addr, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m := map[string][]netip.Addr{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line, _, _ := strings.Cut(sc.Text(), "#")
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		a, err := netip.ParseAddr(fields[0])
		if err != nil || len(fields) < 2 {
			return nil, fmt.Errorf("%s:%d: want ADDRESS NAME [NAME...], got %q", path, n, strings.TrimSpace(line))
		}
		for _, name := range fields[1:] {
			name = strings.TrimSuffix(strings.ToLower(name), ".")
			if err := checkHostname(name); err != nil {
				return nil, fmt.Errorf("%s:%d: %v", path, n, err)
			}
			m[name] = append(m[name], a.Unmap())
		}
	}
	return m, sc.Err()
}
