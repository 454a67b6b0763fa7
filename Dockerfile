# The buildq binary in a minimal image (worker, dev, and the client commands).
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
