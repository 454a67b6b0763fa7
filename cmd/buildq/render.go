package main

import (
	"encoding/json"
	"strings"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker"
)

func newRenderCmd() *cobra.Command {
	var (
		rf     requestFlags
		c      serveConfig
		output string
		reqID  string
	)
	cmd := &cobra.Command{
		Use:   "render DIR",
		Short: "Print the kaniko Job the worker would create for a request",
		Long: `Print the kaniko Job manifest a worker would create for DIR and the given
request flags. The context digest is computed locally; nothing is uploaded
and no cluster is contacted. The output can be piped to kubectl apply
--dry-run=server to have an API server validate it.

The Job-shaping flags are the worker's (--executor-image, --fetch-image,
--s3-endpoint, --registry, --tenant-registry-secret, --job-template, …) and
read the same BUILDQ_* variables, and render runs the checks a worker runs
on them at start and on the request's destination: what a worker would
refuse, render refuses too (exit 2), with the same message.`,
		Example: `  buildq render ./examples/static-site --tenant demo --registry registry.example.com \
      --executor-image ghcr.io/example/kaniko@sha256:<digest> \
      --fetch-image ghcr.io/buildq/buildq@sha256:<digest> --s3-endpoint http://minio:9000 \
      --tenant-registry-secret 'buildq-registry-{tenant}'`,
		Args: exactArgs(1, "DIR"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bindEnv(cmd, nil); err != nil {
				return err
			}
			if output != "yaml" && output != "json" {
				return usageErr("-o must be yaml or json, got %q", output)
			}
			// The checks a worker runs at start on the same flags.
			if err := c.Validate(); err != nil {
				return err
			}
			kc, np := c.job, c.naming
			req, err := rf.request(args[0])
			if err != nil {
				return err
			}
			if _, err := rf.digest(cmd.Context(), args[0], req); err != nil {
				return err
			}
			req.RequestID = reqID
			if err := validate(req); err != nil {
				return err
			}
			repo, err := np.Repository(req)
			if err != nil {
				return usageErr("%v (pass --image, or --registry for the naming policy)", err)
			}
			// The worker refuses a destination outside the tenant's part
			// of the registry before it creates anything.
			if err := np.CheckDestination(req.Tenant, repo); err != nil {
				return usageErr("%v (a worker with these flags refuses this request: pass --registry and --tenant as the worker and the producer have them, or --allowed-destination)", err)
			}
			// As a worker with these flags makes it.
			key := v1.BuildKey(req, worker.KeyIdentity("kaniko@"+kc.ExecutorImage, req,
				strings.Contains(kc.CacheRepo, "{tenant}")))
			spec := kaniko.Spec{Request: req, Key: key, Destinations: naming.Destinations(repo, key, req.Tags)}
			if kc.FetchImage != "" && req.Source.S3 != nil {
				// The worker signs a fresh URL when it creates the Job.
				spec.ContextURL = "<presigned GET URL of s3://" + req.Source.S3.Bucket + "/" + req.Source.S3.Key + ", made by the worker>"
				if len(req.PlatformsOrDefault()) <= 1 {
					// Its Pod checks that the first tag holds no image
					// yet (an index's platforms' tags are buildq's own).
					spec.Absent = spec.Destinations[0]
				}
			}
			job, err := kaniko.Job(spec, kc)
			if err != nil {
				return failed(err)
			}
			var b []byte
			if output == "json" {
				b, err = json.MarshalIndent(job, "", "  ")
				b = append(b, '\n')
			} else {
				b, err = yaml.Marshal(job)
			}
			if err != nil {
				return failed(err)
			}
			_, err = cmd.OutOrStdout().Write(b)
			return err
		},
	}
	rf.register(cmd.Flags())
	c.registerRender(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "yaml", "output format: yaml or json")
	cmd.Flags().StringVar(&reqID, "request-id", "render", "request id recorded in the Job's annotations")
	return cmd
}

// exactArgs is cobra.ExactArgs with a usage error that names the argument.
func exactArgs(n int, names ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usageErr("%s needs %d argument(s): %s\nRun '%s --help' for usage.", cmd.Name(), n, strings.Join(names, " "), cmd.CommandPath())
		}
		return nil
	}
}
