package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/worker"
)

// restConfig loads the cluster's client configuration: --kubeconfig, or
// in-cluster, then $KUBECONFIG and ~/.kube/config. The error is wrapped
// for the command line.
func restConfig(kubeconfig string) (*rest.Config, error) {
	rc, err := loadRestConfig(kubeconfig)
	if err != nil {
		return nil, failed(fmt.Errorf("kubernetes config: %w", err))
	}
	return rc, nil
}

func loadRestConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		return clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if rc, err := rest.InClusterConfig(); err == nil {
		return rc, nil
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if clientcmd.IsEmptyConfig(err) {
		return nil, errors.New("no cluster configured: pass --kubeconfig, set KUBECONFIG, or run the worker in a cluster")
	}
	return rc, err
}

// kubeBackend connects to the cluster, starts the label-filtered informers
// and waits for their caches. It returns the function that stops them.
func kubeBackend(ctx context.Context, rc *rest.Config, qps float32, burst int, kc kaniko.Config, log *zap.Logger) (*worker.KubeBackend, func(), error) {
	rc = rest.CopyConfig(rc)
	rc.UserAgent = "buildq-worker"
	rc.QPS, rc.Burst = qps, burst
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, nil, failed(fmt.Errorf("kubernetes client: %w", err))
	}
	factory := kube.NewInformerFactory(client, kc.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		return nil, nil, failed(err)
	}
	backend, err := worker.NewKubeBackend(client, watcher, kc)
	if err != nil {
		return nil, nil, usageErr("%v", err)
	}
	backend.WithLogger(log)
	stop := make(chan struct{})
	factory.Start(stop)
	log.Info("waiting for the Job and Pod caches", zap.String("namespace", kc.Namespace))
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if !watcher.WaitForSync(sctx) {
		close(stop)
		factory.Shutdown()
		return nil, nil, failed(fmt.Errorf("the Job and Pod informers of namespace %s did not sync: check the cluster and the worker's RBAC (list/watch jobs and pods)", kc.Namespace))
	}
	return backend, func() { close(stop); factory.Shutdown() }, nil
}
