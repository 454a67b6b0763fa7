//go:build integration

package integration

import (
	"context"
	"encoding/binary"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
)

// What the suite's one-node cluster lacks and a real cluster has, played
// by the test for deploy/'s overlays on the real node: cluster DNS with
// its Service and Pod names (the node's Pods have no resolver and there is
// no Service proxy), and a storage provisioner for the StatefulSet's
// volume claims.

const clusterDomain = "cluster.local"

// clusterDNS answers A queries on the bridge's gateway (port 53) as
// CoreDNS's kubernetes plugin does, from the API: a Service's name with the
// addresses of the Pods it selects (Ready ones; every running one when it
// publishes not-ready addresses, as a headless Service for a StatefulSet
// does), a StatefulSet Pod's hostname.subdomain with its address. There is
// no Service proxy on the node, so a Service's name resolves to its Pods,
// as a headless Service's does.
type clusterDNS struct {
	conn *net.UDPConn
	wg   sync.WaitGroup
}

func startClusterDNS(t *testing.T) *clusterDNS {
	t.Helper()
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.ParseIP(nodeGateway), Port: 53})
	if err != nil {
		t.Fatalf("cluster DNS on %s:53: %v", nodeGateway, err)
	}
	d := &clusterDNS{conn: conn}
	d.wg.Add(1)
	go d.serve()
	t.Cleanup(func() { conn.Close(); d.wg.Wait() })
	return d
}

func (d *clusterDNS) serve() {
	defer d.wg.Done()
	buf := make([]byte, 1500)
	for {
		n, from, err := d.conn.ReadFromUDP(buf)
		if err != nil {
			return
		}
		if resp := d.answer(buf[:n]); resp != nil {
			_, _ = d.conn.WriteToUDP(resp, from)
		}
	}
}

// answer builds the response to one query: header, the question, and an
// A record per address (the name as a pointer to the question's).
func (d *clusterDNS) answer(q []byte) []byte {
	if len(q) < 12 || binary.BigEndian.Uint16(q[4:6]) != 1 {
		return nil
	}
	var labelsOf []string
	i := 12
	for i < len(q) && q[i] != 0 {
		l := int(q[i])
		if l > 63 || i+1+l > len(q) {
			return nil
		}
		labelsOf = append(labelsOf, strings.ToLower(string(q[i+1:i+1+l])))
		i += 1 + l
	}
	if i+5 > len(q) {
		return nil
	}
	qtype := binary.BigEndian.Uint16(q[i+1 : i+3])
	question := q[12 : i+5]
	ips, known := d.lookup(strings.Join(labelsOf, "."))
	resp := make([]byte, 12, 512)
	copy(resp, q[:2])
	flags := uint16(0x8400) | binary.BigEndian.Uint16(q[2:4])&0x0100 // QR, AA, RD as asked
	if !known {
		flags |= 3 // NXDOMAIN
	}
	binary.BigEndian.PutUint16(resp[2:4], flags)
	binary.BigEndian.PutUint16(resp[4:6], 1)
	resp = append(resp, question...)
	if qtype != 1 { // only A: a known name has no other records
		return resp
	}
	var an uint16
	for _, ip := range ips {
		ip4 := net.ParseIP(ip).To4()
		if ip4 == nil {
			continue
		}
		resp = append(resp, 0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4)
		resp = append(resp, ip4...)
		an++
	}
	binary.BigEndian.PutUint16(resp[6:8], an)
	return resp
}

// lookup resolves <svc>.<ns>.svc.cluster.local and
// <hostname>.<subdomain>.<ns>.svc.cluster.local.
func (d *clusterDNS) lookup(name string) ([]string, bool) {
	parts := strings.Split(strings.TrimSuffix(name, "."+clusterDomain), ".")
	if !strings.HasSuffix(name, ".svc."+clusterDomain) || len(parts) < 3 || len(parts) > 4 {
		return nil, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ns := parts[len(parts)-2]
	pods, err := shared.kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, false
	}
	if len(parts) == 4 { // a Pod by hostname.subdomain
		for _, p := range pods.Items {
			if p.Spec.Hostname == parts[0] && p.Spec.Subdomain == parts[1] && p.Status.PodIP != "" {
				return []string{p.Status.PodIP}, true
			}
		}
		return nil, false
	}
	svc, err := shared.kube.CoreV1().Services(ns).Get(ctx, parts[0], metav1.GetOptions{})
	if err != nil {
		return nil, false
	}
	sel := labels.SelectorFromSet(svc.Spec.Selector)
	var ips []string
	for _, p := range pods.Items {
		if p.Status.PodIP == "" || p.DeletionTimestamp != nil || !sel.Matches(labels.Set(p.Labels)) {
			continue
		}
		if svc.Spec.PublishNotReadyAddresses || podReady(&p) {
			ips = append(ips, p.Status.PodIP)
		}
	}
	return ips, true
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// useClusterDNS points a pod template at the test's cluster DNS, with the
// search path a kubelet writes for a Pod of namespace ns.
func useClusterDNS(podSpec map[string]any, ns string) {
	podSpec["dnsPolicy"] = "None"
	podSpec["dnsConfig"] = map[string]any{
		"nameservers": []any{nodeGateway},
		"searches":    []any{ns + ".svc." + clusterDomain, "svc." + clusterDomain, clusterDomain},
		"options":     []any{map[string]any{"name": "ndots", "value": "5"}},
	}
}

// withoutClaims does what a storage provisioner would for sts: each of
// its volume claim templates becomes an emptyDir volume of the same name
// (the suite's cluster has no provisioner, and a claim would stay
// Pending). The StatefulSet controller then runs its Pods.
func withoutClaims(t *testing.T, sts *unstructured.Unstructured) {
	t.Helper()
	spec := sts.Object["spec"].(map[string]any)
	claims, _ := spec["volumeClaimTemplates"].([]any)
	if len(claims) == 0 {
		return
	}
	podSpec := podSpecOf(sts)
	vols, _ := podSpec["volumes"].([]any)
	for _, c := range claims {
		name, _, _ := unstructured.NestedString(c.(map[string]any), "metadata", "name")
		vols = append(vols, map[string]any{"name": name, "emptyDir": map[string]any{}})
	}
	podSpec["volumes"] = vols
	delete(spec, "volumeClaimTemplates")
}

// podSpecOf is the pod template's spec of a Deployment or StatefulSet,
// to edit in place.
func podSpecOf(o *unstructured.Unstructured) map[string]any {
	return o.Object["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
}
