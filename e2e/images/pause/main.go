// Command pause is the sandbox ("infra") container of the dev cluster's real node: it holds a pod's
// namespaces open and does nothing else. It exits 0 on SIGTERM or SIGINT and reaps orphaned children
// (it is PID 1 when a pod shares its process namespace). Built static by e2e/controlplane/build.sh
// and packed into an image by e2e/images/build.py; there is no registry to pull registry.k8s.io/pause from.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
