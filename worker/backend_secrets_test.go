package worker

// Backend (backend.go): credentials reach a build Pod only by reference;
// the worker never reads a Secret, and no secret value shows in anything
// it sends, stores, logs or publishes.

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// syncBuffer is a bytes.Buffer safe for the logger's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
func TestSecretsNeverLeak(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()

	const (
		accessKey   = "AKIA-SECRET-VALUE-123"
		secretKey   = "wJalrXUtnFEMI-SECRET-KEY-456"
		regPassword = "hunter2-registry"
	)
	regAuth := base64.StdEncoding.EncodeToString([]byte("robot:" + regPassword))
	dockerConfig := fmt.Sprintf(`{"auths":{"registry.test:5000":{"username":"robot","password":%q,"auth":%q}}}`, regPassword, regAuth)
	secretValues := []string{accessKey, secretKey, regPassword, regAuth, dockerConfig}
	for _, s := range slices.Clone(secretValues) {
		secretValues = append(secretValues, base64.StdEncoding.EncodeToString([]byte(s)))
	}

	kc := testKaniko
	kc.S3Secret = "buildq-s3-creds"
	kc.S3AccessKeyField = "access-key"
	kc.S3SecretKeyField = "secret-key"
	kc.RegistrySecret = "buildq-push-creds"
	secrets := []*corev1.Secret{
		{
			ObjectMeta: metav1.ObjectMeta{Name: kc.S3Secret, Namespace: testNamespace},
			Data:       map[string][]byte{kc.S3AccessKeyField: []byte(accessKey), kc.S3SecretKeyField: []byte(secretKey)},
		},
		{
			ObjectMeta: metav1.ObjectMeta{Name: kc.RegistrySecret, Namespace: testNamespace},
			Type:       corev1.SecretTypeDockerConfigJson,
			Data:       map[string][]byte{corev1.DockerConfigJsonKey: []byte(dockerConfig)},
		},
	}
	for _, s := range secrets {
		if _, err := e.kube.CoreV1().Secrets(testNamespace).Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Everything below is scanned; the scan itself is checked against the
	// Secrets, which must of course hold the values.
	type item struct{ what, text string }
	var corpus []item
	add := func(what string, v any) {
		var s string
		switch x := v.(type) {
		case string:
			s = x
		case []byte:
			s = string(x)
		default:
			b, err := yaml.Marshal(v)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			s = string(b)
		}
		corpus = append(corpus, item{what, s})
	}
	leaks := func(text string) []string {
		var found []string
		for _, s := range secretValues {
			if strings.Contains(text, s) {
				found = append(found, s)
			}
		}
		return found
	}
	for _, s := range secrets {
		if leaks(mustJSON(t, s)) == nil {
			t.Fatalf("the scan does not find the values of secret %s", s.Name)
		}
	}
	firstAction := len(e.kube.Actions())

	var logs syncBuffer
	logger := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(&logs), zapcore.DebugLevel))
	_, watcher := e.startWorkerWith("w1", kc, func(c *Config) { c.Logger = logger })
	events := e.events()
	results := e.collect()

	// One build that succeeds and one that fails, through every phase.
	var jobs []*batchv1.Job
	for i, exit := range []int32{0, 1} {
		req := request(fmt.Sprintf("secret-scan-%d", i))
		if _, err := e.pub.Publish(ctx, req); err != nil {
			t.Fatal(err)
		}
		job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
		jobs = append(jobs, job)
		eventually(t, 5*time.Second, "the worker sees its job", func() bool { _, _, ok := watcher.Get(testNamespace, job.Name); return ok })
		msg := digestOf("scan")
		if exit != 0 {
			msg = "error building image: RUN ./build.sh: exit status 2"
		}
		e.kubelet(job, exit, msg)
		results.waitFor(t, i+1, 10*time.Second)
		eventually(t, 5*time.Second, "job cleaned up", e.jobGone(job.Name))
	}
	eventually(t, 5*time.Second, "requests acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})

	t.Run("credentials reach the job only by reference", func(t *testing.T) {
		for _, job := range jobs {
			c := job.Spec.Template.Spec.Containers[0]
			refs := map[string]corev1.SecretKeySelector{}
			for _, ev := range c.Env {
				if ev.Name == "AWS_ACCESS_KEY_ID" || ev.Name == "AWS_SECRET_ACCESS_KEY" {
					if ev.Value != "" || ev.ValueFrom == nil || ev.ValueFrom.SecretKeyRef == nil {
						t.Errorf("%s: env %s is not a secretKeyRef: %+v", job.Name, ev.Name, ev)
						continue
					}
					if _, dup := refs[ev.Name]; dup {
						t.Errorf("%s: env %s is set twice", job.Name, ev.Name)
					}
					refs[ev.Name] = *ev.ValueFrom.SecretKeyRef
				}
				if l := leaks(ev.Value); l != nil {
					t.Errorf("%s: env %s holds a secret value", job.Name, ev.Name)
				}
			}
			want := map[string]string{"AWS_ACCESS_KEY_ID": kc.S3AccessKeyField, "AWS_SECRET_ACCESS_KEY": kc.S3SecretKeyField}
			for name, key := range want {
				if r, ok := refs[name]; !ok || r.Name != kc.S3Secret || r.Key != key {
					t.Errorf("%s: env %s refers to %+v, want secret %s key %s", job.Name, name, r, kc.S3Secret, key)
				}
			}
			// Registry credentials: the Secret mounted read-only as
			// kaniko's docker config, never copied into the spec.
			var vol *corev1.Volume
			for i := range job.Spec.Template.Spec.Volumes {
				if s := job.Spec.Template.Spec.Volumes[i].Secret; s != nil && s.SecretName == kc.RegistrySecret {
					vol = &job.Spec.Template.Spec.Volumes[i]
				}
			}
			if vol == nil {
				t.Fatalf("%s: no volume of secret %s", job.Name, kc.RegistrySecret)
			}
			mounted := slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
				return m.Name == vol.Name && m.ReadOnly && m.MountPath == kaniko.DockerConfigDir
			})
			if !mounted {
				t.Errorf("%s: secret volume not mounted read-only at %s: %+v", job.Name, kaniko.DockerConfigDir, c.VolumeMounts)
			}
			if sa := job.Spec.Template.Spec.AutomountServiceAccountToken; sa == nil || *sa {
				t.Errorf("%s: the build pod mounts a service account token", job.Name)
			}
		}
	})

	t.Run("the worker never reads secrets", func(t *testing.T) {
		for _, a := range e.kube.Actions()[firstAction:] {
			if a.GetResource().Resource == "secrets" {
				t.Errorf("the worker touched secrets: %s %s", a.GetVerb(), a.GetResource())
			}
		}
	})

	t.Run("no secret value anywhere", func(t *testing.T) {
		// Every object sent to or read from the API server since the
		// Secrets were created (Jobs, Pods, status updates, deletes).
		for i, a := range e.kube.Actions()[firstAction:] {
			add(fmt.Sprintf("kube action %d %s %s", i, a.GetVerb(), a.GetResource().Resource), a)
		}
		for _, j := range jobs {
			add("job "+j.Name, j)
		}
		pods, err := e.kube.CoreV1().Pods("").List(ctx, listAll)
		if err != nil {
			t.Fatal(err)
		}
		add("pods", pods)
		evs, err := e.kube.CoreV1().Events("").List(ctx, listAll)
		if err != nil {
			t.Fatal(err)
		}
		add("core events", evs)
		evs2, err := e.kube.EventsV1().Events("").List(ctx, listAll)
		if err != nil {
			t.Fatal(err)
		}
		add("events.k8s.io events", evs2)

		// Everything stored in NATS: results, dead letters, both KV
		// buckets (KV_<bucket> streams), with headers.
		names := e.js.StreamNames(ctx)
		var streams []string
		for n := range names.Name() {
			streams = append(streams, n)
		}
		for _, want := range []string{v1.ResultsStream, "KV_" + v1.BuildsBucket, "KV_" + v1.RequestsBucket} {
			if !slices.Contains(streams, want) {
				t.Errorf("stream %s not found among %v", want, streams)
			}
		}
		stored := 0
		for _, s := range streams {
			for _, m := range e.streamMsgs(s) {
				stored++
				add(fmt.Sprintf("stream %s seq %d (%s)", s, m.Sequence, m.Subject), fmt.Sprintf("%s %v %s", m.Subject, m.Header, m.Data))
			}
		}
		if stored == 0 {
			t.Error("nothing stored in NATS: the scan proves nothing")
		}
		evRaw := events.all()
		if len(evRaw) == 0 {
			t.Error("no progress events seen: the scan proves nothing")
		}
		for i, b := range evRaw {
			add(fmt.Sprintf("progress event %d", i), b)
		}
		for _, r := range results.snapshot() {
			add("result "+r.ID, mustJSON(t, r))
		}
		logText := logs.String()
		if !strings.Contains(logText, `"request done"`) || !strings.Contains(logText, `"level":"debug"`) && !strings.Contains(logText, `"level":"info"`) {
			t.Errorf("the log buffer misses the worker's log: %.300s", logText)
		}
		add("worker log", logText)

		for _, it := range corpus {
			if l := leaks(it.text); l != nil {
				t.Errorf("%s holds secret values %q", it.what, l)
			}
		}
		t.Logf("scanned %d items, %d bytes of log", len(corpus), len(logText))
	})
}
