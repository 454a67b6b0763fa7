package kube

import (
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// podLess orders pods by creation; within the same second (the API's
// precision), an ended pod before one still running (the Job creates a
// replacement only once a pod has failed), the one whose containers
// finished first, then by name.
func podLess(a, b *corev1.Pod) bool {
	if c := a.CreationTimestamp.Time.Compare(b.CreationTimestamp.Time); c != 0 {
		return c < 0
	}
	if c := endKey(a).Compare(endKey(b)); c != 0 {
		return c < 0
	}
	return a.Name < b.Name
}

var notEnded = time.Unix(1<<40, 0)

func endKey(p *corev1.Pod) time.Time {
	if !podEnded(p) {
		return notEnded
	}
	var last time.Time
	for _, st := range allStatuses(p) {
		if t := st.State.Terminated; t != nil && t.FinishedAt.Time.After(last) {
			last = t.FinishedAt.Time
		}
	}
	return last
}

func podEnded(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded
}

func containerNames(p *corev1.Pod) []string {
	var names []string
	for _, c := range p.Spec.InitContainers {
		names = append(names, c.Name)
	}
	for _, c := range p.Spec.Containers {
		names = append(names, c.Name)
	}
	return names
}

func allStatuses(p *corev1.Pod) []corev1.ContainerStatus {
	return append(slices.Clip(p.Status.InitContainerStatuses), p.Status.ContainerStatuses...)
}

func containerStatus(p *corev1.Pod, name string) *corev1.ContainerStatus {
	for _, list := range [][]corev1.ContainerStatus{p.Status.InitContainerStatuses, p.Status.ContainerStatuses} {
		for i := range list {
			if list[i].Name == name {
				return &list[i]
			}
		}
	}
	return nil
}

// started reports whether a container has run (its log may hold lines).
func started(st *corev1.ContainerStatus) bool {
	return st != nil && (st.State.Running != nil || st.State.Terminated != nil || st.LastTerminationState.Terminated != nil)
}

// endReason says, best effort, why pod name (p as the cache has it, nil if
// gone) ended.
func endReason(name string, p *corev1.Pod, gone bool) string {
	if gone || p == nil {
		return fmt.Sprintf("pod %s is gone", name)
	}
	var details []string
	for _, st := range allStatuses(p) {
		if t := st.State.Terminated; t != nil && t.ExitCode != 0 {
			d := fmt.Sprintf("%s exited %d", st.Name, t.ExitCode)
			if t.Reason != "" && t.Reason != "Error" {
				d += " (" + t.Reason + ")"
			}
			details = append(details, d)
			break
		}
	}
	if len(details) == 0 && p.Status.Reason != "" {
		details = append(details, p.Status.Reason)
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.DisruptionTarget && c.Status == corev1.ConditionTrue {
			d := "disrupted"
			if c.Reason != "" {
				d += " (" + c.Reason + ")"
			}
			details = append(details, d)
		}
	}
	var s string
	switch {
	case p.Status.Phase == corev1.PodFailed:
		s = "pod " + name + " failed"
	case p.Status.Phase == corev1.PodSucceeded:
		s = "pod " + name + " succeeded"
	case p.DeletionTimestamp != nil:
		s = "pod " + name + " was deleted"
	default:
		s = "pod " + name + " ended"
	}
	if len(details) > 0 {
		s += ": " + strings.Join(details, "; ")
	}
	return s
}
