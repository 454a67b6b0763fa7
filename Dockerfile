# The buildq binary in a minimal image (worker, dev, and the client commands),
# for a Docker host that can pull golang and distroless. Nothing in this
# repository needs it: make image (hack/image) and make docker-images
# (hack/docker/images) build the same image without a Dockerfile and without
# pulling, and docker-compose.yml and make e2e use theirs. Its base images
# are tags, not digests: their digests can only be had from their
# registries, which the project's machines do not reach.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/buildq ./cmd/buildq

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/buildq /usr/local/bin/buildq
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/buildq"]
CMD ["worker"]
