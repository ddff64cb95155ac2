// Command coredns is CoreDNS built with only the plugins the dev cluster uses: cluster DNS for
// `<svc>.<ns>.svc.cluster.local` and the `<pod>.<subdomain>.<ns>.svc...` names of headless services
// (how pipeline-parallel ranks find rank 0). Selecting plugins by setting dnsserver.Directives in a
// main package of one's own is CoreDNS's documented way to build a smaller server; the full build
// pulls every cloud SDK. e2e/controlplane/build.sh builds it from a scratch module.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/template"
)

// Order matters: it is the order in which the plugins see a query. `template` answers NXDOMAIN for
// names outside the cluster's zones (the dev cluster is offline: there is nothing to forward to).
var directives = []string{"bind", "errors", "log", "health", "ready", "cache", "kubernetes", "template"}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
