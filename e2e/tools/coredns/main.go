// The local cluster's DNS: upstream CoreDNS with only the plugins e2e/scripts/dns.sh's Corefile uses, so the
// build pulls in no cloud SDKs. Their order is CoreDNS's own (its plugin.cfg), which decides how a query
// passes through them.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

var directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes", "forward"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
