package aether

import "slices"

// Ecosystem is a named rule: the hosts an ecosystem's tools reach to
// download what tasks install, the ports, and the HTTP methods they need.
// CONNECT is the method of an HTTPS tunnel: through one the proxy sees
// only the host, so the methods below it bind plain-HTTP requests only.
type Ecosystem struct {
	// Hosts are patterns as in a host rule: "example.org" or
	// "*.example.org" (any name below example.org, not example.org itself).
	Hosts   []string
	Ports   []int
	Methods []string
}

// readOnly is what a package manager needs to download: plain GETs, and
// HTTPS tunnels.
var readOnly = []string{"GET", "HEAD", "CONNECT"}

// Ecosystems is the one table of named rules. A name here is what the
// spec's network rules, the CLI's --net-allow/--net-deny and the SDK's
// network_rules take. Keep it to download hosts: publishing endpoints
// (upload.pypi.org, npm's PUTs) are deliberately absent.
var Ecosystems = map[string]Ecosystem{
	"pypi": {
		Hosts:   []string{"pypi.org", "files.pythonhosted.org"},
		Ports:   []int{443, 80},
		Methods: readOnly,
	},
	"npm": {
		Hosts:   []string{"registry.npmjs.org", "registry.yarnpkg.com"},
		Ports:   []int{443, 80},
		Methods: readOnly,
	},
	"crates": {
		Hosts:   []string{"crates.io", "index.crates.io", "static.crates.io"},
		Ports:   []int{443},
		Methods: readOnly,
	},
	"goproxy": {
		Hosts:   []string{"proxy.golang.org", "sum.golang.org", "index.golang.org"},
		Ports:   []int{443},
		Methods: readOnly,
	},
	"debian": {
		Hosts:   []string{"deb.debian.org", "security.debian.org", "ftp.debian.org"},
		Ports:   []int{80, 443},
		Methods: readOnly,
	},
	"ubuntu": {
		Hosts:   []string{"archive.ubuntu.com", "*.archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com"},
		Ports:   []int{80, 443},
		Methods: readOnly,
	},
	"github": {
		// git's smart HTTP protocol POSTs to git-upload-pack to fetch.
		Hosts: []string{"github.com", "api.github.com", "codeload.github.com",
			"raw.githubusercontent.com", "objects.githubusercontent.com"},
		Ports:   []int{443},
		Methods: []string{"GET", "HEAD", "POST", "CONNECT"},
	},
	"huggingface": {
		Hosts:   []string{"huggingface.co", "*.huggingface.co", "*.hf.co"},
		Ports:   []int{443},
		Methods: readOnly,
	},
}

// EcosystemNames returns the table's names, sorted.
func EcosystemNames() []string {
	names := make([]string, 0, len(Ecosystems))
	for n := range Ecosystems {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}
