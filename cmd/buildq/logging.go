package main

import (
	"sync"

	"github.com/go-logr/zapr"
	"go.uber.org/zap"
	"k8s.io/klog/v2"
)

// newLogger builds the zap logger and routes client-go's klog into it.
func newLogger(level, format string) (*zap.Logger, error) {
	lvl, err := parseLogFlags(level, format)
	if err != nil {
		return nil, err
	}
	zc := zap.NewProductionConfig()
	if format == "console" {
		zc = zap.NewDevelopmentConfig()
		zc.DisableStacktrace = true
	}
	zc.Level = zap.NewAtomicLevelAt(lvl)
	log, err := zc.Build()
	if err != nil {
		return nil, err
	}
	// klog is process-global: route it once, to the first logger built.
	klogOnce.Do(func() { klog.SetLogger(zapr.NewLogger(log.Named("client-go"))) })
	return log, nil
}

var klogOnce sync.Once
