package kaniko

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// Template is the part of the build pod a platform team sets once for all
// builds (`buildq worker --job-template FILE`), in the spirit of Tekton's
// and Shipwright's build templates:
//
//	resources:
//	  requests: {cpu: 500m, memory: 1Gi}
//	  limits: {memory: 4Gi}
//	nodeSelector: {node-role.example.com/builds: "true"}
//	tolerations:
//	  - {key: builds, operator: Exists, effect: NoSchedule}
//	priorityClassName: batch-low
//	serviceAccountName: buildq-builder
//	imagePullSecrets: [ghcr-pull]
type Template struct {
	Resources          corev1.ResourceRequirements `json:"resources,omitzero"`
	NodeSelector       map[string]string           `json:"nodeSelector,omitempty"`
	Tolerations        []corev1.Toleration         `json:"tolerations,omitempty"`
	PriorityClassName  string                      `json:"priorityClassName,omitempty"`
	ServiceAccountName string                      `json:"serviceAccountName,omitempty"`
	ImagePullSecrets   []string                    `json:"imagePullSecrets,omitempty"`
}

// ParseTemplate reads a Template from YAML or JSON; unknown fields are
// errors, so a misspelt setting is not silently ignored.
func ParseTemplate(b []byte) (Template, error) {
	var t Template
	if err := yaml.UnmarshalStrict(b, &t); err != nil {
		return t, fmt.Errorf("job template: %w", err)
	}
	return t, nil
}

// Apply copies the template into the configuration; fields the template
// leaves empty keep their configured values.
func (c Config) Apply(t Template) Config {
	if len(t.Resources.Requests) > 0 || len(t.Resources.Limits) > 0 {
		c.Resources = t.Resources
	}
	if len(t.NodeSelector) > 0 {
		c.NodeSelector = t.NodeSelector
	}
	if len(t.Tolerations) > 0 {
		c.Tolerations = t.Tolerations
	}
	if t.PriorityClassName != "" {
		c.PriorityClassName = t.PriorityClassName
	}
	if t.ServiceAccountName != "" {
		c.ServiceAccountName = t.ServiceAccountName
	}
	if len(t.ImagePullSecrets) > 0 {
		c.ImagePullSecrets = t.ImagePullSecrets
	}
	return c
}
