package framework

import (
	"fmt"
	"os"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// writeKubeconfig writes a kubeconfig that reaches server as id, trusting the CA in caFile.
func writeKubeconfig(path, server, caFile string, id identity) error {
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return fmt.Errorf("kubeconfig for %s: %w", id.user, err)
	}
	const name = "kpp-e2e"
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[name] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caPEM}
	cfg.AuthInfos[id.user] = &clientcmdapi.AuthInfo{Token: id.token}
	cfg.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: id.user}
	cfg.CurrentContext = name
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("kubeconfig for %s: %w", id.user, err)
	}
	return nil
}

// loadKubeconfig reads a kubeconfig the way the proxy does.
func loadKubeconfig(path string) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", path, err)
	}
	return cfg, nil
}
