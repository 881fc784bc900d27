// Command kube-apiserver is the upstream kube-apiserver, built from Go modules so the
// dev stack needs no downloaded release binaries.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
