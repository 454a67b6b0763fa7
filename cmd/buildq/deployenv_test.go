package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"
)

// workerEnvNames are the variables the worker's flags read (bindEnv).
func workerEnvNames(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{"NATS_URL": true, "AWS_ACCESS_KEY_ID": true, "AWS_SECRET_ACCESS_KEY": true}
	newWorkerCmd().Flags().VisitAll(func(f *pflag.Flag) {
		names["BUILDQ_"+strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))] = true
	})
	return names
}

// Every BUILDQ_* variable docker-compose.yml gives the worker is one of its
// flags: a misspelt or removed flag would otherwise be ignored silently.
func TestDockerComposeWorkerEnvIsFlags(t *testing.T) {
	b, err := os.ReadFile("../../docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Command     []string          `json:"command"`
			Environment map[string]string `json:"environment"`
		} `json:"services"`
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		t.Fatal(err)
	}
	w, ok := compose.Services["worker"]
	if !ok || len(w.Command) == 0 || w.Command[0] != "worker" {
		t.Fatalf("docker-compose.yml has no worker service running `buildq worker`: %+v", w)
	}
	known := workerEnvNames(t)
	n := 0
	for name := range w.Environment {
		if strings.HasPrefix(name, "BUILDQ_") || name == "NATS_URL" {
			n++
			if !known[name] {
				t.Errorf("docker-compose.yml sets %s, which is no flag of buildq worker", name)
			}
		}
	}
	if n == 0 {
		t.Fatal("docker-compose.yml gives the worker no BUILDQ_* variable")
	}
}

// The same for the worker Deployment of deploy/ and its overlays' patches.
func TestDeployWorkerEnvIsFlags(t *testing.T) {
	files, err := filepath.Glob("../../deploy/*/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	more, _ := filepath.Glob("../../deploy/*/*/*.yaml")
	known := workerEnvNames(t)
	n := 0
	for _, f := range append(files, more...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range strings.Split(string(b), "\n---") {
			var d struct {
				Kind string `json:"kind"`
				Spec struct {
					Template struct {
						Spec struct {
							Containers []struct {
								Name string `json:"name"`
								Args []string
								Env  []struct {
									Name string `json:"name"`
								} `json:"env"`
							} `json:"containers"`
						} `json:"spec"`
					} `json:"template"`
				} `json:"spec"`
			}
			if err := yaml.Unmarshal([]byte(doc), &d); err != nil || d.Kind != "Deployment" {
				continue
			}
			for _, c := range d.Spec.Template.Spec.Containers {
				for _, e := range c.Env {
					if strings.HasPrefix(e.Name, "BUILDQ_") {
						n++
						if !known[e.Name] {
							t.Errorf("%s: container %s sets %s, which is no flag of buildq worker", f, c.Name, e.Name)
						}
					}
				}
			}
		}
	}
	if n < 5 {
		t.Fatalf("found %d BUILDQ_* variables in deploy/'s Deployments; the worker's are missing", n)
	}
}
