# buildq — make targets. `make test` is what CI runs (.ci/run).
SHELL := /bin/bash
GO ?= go
BIN ?= bin
PKGS := ./...
# Integration tests need the real components built by integration/tools (cached
# outside the clone, see integration/README.md).
INTEGRATION_TIMEOUT ?= 40m

.PHONY: all build syft install test test-unit sim-race test-integration lint fmt vet bench bench-e2e bench-report bench-scale dev e2e tools node-packages clean sim soak mutants image

all: build

build: ## Build the buildq binary into bin/
	$(GO) build -o $(BIN)/buildq ./cmd/buildq

syft: ## Build syft, the SBOM scanner (--sbom-scanner), at the version integration/tools/syft pins, into bin/
	cd integration/tools/syft && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-X main.version=$$(awk '$$1 == "github.com/anchore/syft" {print $$2}' go.mod)" -o $(abspath $(BIN))/syft github.com/anchore/syft/cmd/syft

# On a fresh machine the integration stage's prerequisites (its tools, its
# node packages, the builds it compiles itself) are made beside the unit
# tests, the compiling at idle CPU priority, and finished before the
# simulation starts (integration/tools/beside.sh): the simulation and the
# mutants judge timing rules, and a build beside them let two mutants
# survive in one of two cold runs. With the tools built, nothing runs beside.
test: ## Unit tests (with -race), the fault simulation (8 seeds with -race, then 200 seeds and the frozen scenarios), the mutation tests, then the integration suite
	@bash integration/tools/beside.sh $(MAKE) --no-print-directory test-unit sim-race
	@$(MAKE) --no-print-directory sim mutants test-integration

test-unit: ## Unit tests, race detector on (the fault simulation runs in `make sim-race` and `make sim`)
	$(GO) test -race -count=1 -timeout 10m -skip '^(TestFrozenScenarios|TestFaultSimulation)$$' $(PKGS)

# The fault simulation with the race detector, on its own (beside the rest
# of the unit suite on two cores it would be starved): it checks for data
# races and every rule of what happens and in which order; the rules that
# bound how soon (fair order in calm stretches, a Job removed within a
# second of its run's end) are judged by make sim, without the detector.
sim-race: ## The fault simulation's first 8 seeds with the race detector
	$(GO) test -race -count=1 -timeout 10m -run '^TestFaultSimulation$$' ./worker/

# The worker's seeded fault simulation (worker/sim_*_test.go): SEEDS schedules
# from seed FIRST, SIM_PARALLEL at a time. Replay one seed with
# BUILDQ_SIM_SEED=N go test ./worker/ -run '^TestFaultSimulation$$' -count=1 -v
sim: SEEDS ?= 200
soak: SEEDS ?= 2000
sim soak: FIRST ?= 1
sim soak: SIM_PARALLEL ?= 24
sim: SIM_TIMEOUT ?= 30m
soak: SIM_TIMEOUT ?= 4h
sim soak: ## Fault simulation of the worker: `make sim` (SEEDS=200 and the frozen scenarios, < 4 min), `make soak` (SEEDS=2000, then every mutant with MUTANT_SEEDS=400)
	set -o pipefail; BUILDQ_SIM_SEEDS=$(SEEDS) BUILDQ_SIM_FIRST=$(FIRST) BUILDQ_SIM_PARALLEL=$(SIM_PARALLEL) \
	  $(GO) test -count=1 -timeout $(SIM_TIMEOUT) -parallel $(SIM_PARALLEL) -run '^(TestFaultSimulation|TestFrozenScenarios)$$' -v ./worker/ \
	  | grep -Ev '^(=== (RUN|PAUSE|CONT|NAME)|    --- PASS)'
	@if [ "$@" = soak ]; then $(MAKE) --no-print-directory mutants MUTANT_SEEDS=$(MUTANT_SEEDS); fi

# Mutation tests (worker/mutants_test.go): each deliberate defect of the
# catalogue runs against the fault simulation (MUTANT_SEEDS seeds; it stops
# at the first violation) and its named unit tests, and must be killed.
# One line per mutant; the target fails if any survived. Pick some with
# MUTANTS=name,name.
mutants: MUTANT_SEEDS ?= 120
mutants: SIM_PARALLEL ?= 24
mutants: MUTANT_PARALLEL ?= 3
soak: MUTANT_SEEDS ?= 400
mutants: ## Mutation tests of the worker's protocol: every mutant must be killed by the simulation or its unit tests
	set -o pipefail; BUILDQ_MUTANT_SEEDS=$(MUTANT_SEEDS) BUILDQ_MUTANTS=$(MUTANTS) BUILDQ_MUTANT_PARALLEL=$(MUTANT_PARALLEL) BUILDQ_SIM_PARALLEL=$(SIM_PARALLEL) \
	  $(GO) test -tags mutants -count=1 -timeout 120m -run '^TestMutants$$' -v ./worker/ | grep -Ev '^=== RUN'

tools: ## Build the integration suite's real components (cached outside the clone)
	bash integration/tools/build.sh

node-packages: ## Install the real node's Debian packages (containerd, runc, CNI plugins, busybox-static) when missing
	bash integration/tools/node-packages.sh

test-integration: tools node-packages ## Integration suite against real NATS, MinIO, registry, Kubernetes and a real node (kubelet, containerd, runc, kaniko)
	$(GO) test -tags integration -count=1 -timeout $(INTEGRATION_TIMEOUT) -v ./integration/... 2>&1 | tee /tmp/buildq-integration.log | grep -E '^(=== RUN|--- |PASS|FAIL|ok|panic)|_test.go' ; exit $${PIPESTATUS[0]}

# golangci-lint is pinned by hack/tools/lint (its own module) and built
# into the tools cache the first time (about 2 minutes on 2 cores); it runs
# over the default build and the build-tagged suites (.golangci.yml).
lint: vet ## go vet, gofmt, then golangci-lint (.golangci.yml) built from its pinned module
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	bash hack/tools/lint/run.sh

vet:
	$(GO) vet $(PKGS)
	$(GO) vet -tags benchscale ./worker/
	$(GO) vet -tags 'integration benche2e' ./integration/...
	$(GO) vet -tags e2e ./integration/e2e/...

fmt:
	gofmt -w $$(git ls-files '*.go')

bench: ## Benchmarks; they print figures, they assert nothing
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

# The end-to-end benchmarks (docs/benchmarks.md): each writes its figures
# as JSON into BENCH_OUT; bench-report renders them into the page and its
# plot. CPU profiles of the workers: BUILDQ_BENCH_PPROF=<dir>.
BENCH_OUT ?= docs/benchmarks
bench-e2e: tools node-packages ## P1–P8, P10–P13: buildq against same-run baselines on the integration suite's real components (about 11 min); writes docs/benchmarks.md
	@mkdir -p $(BENCH_OUT)
	set -o pipefail; BUILDQ_BENCH_OUT=$(abspath $(BENCH_OUT)) $(GO) test -tags 'integration benche2e' -count=1 -timeout 20m \
	  -run '^TestBenchE2E' -v ./integration/ 2>&1 | tee /tmp/buildq-bench-e2e.log | grep -E '^(--- |PASS|FAIL|ok|panic)|P[0-9] |bench_.*_test.go'
	$(MAKE) --no-print-directory bench-report

bench-scale: ## P9, toward internet scale, simulated (< 45 min): 100,000 requests over 10,000 keys, 10 worker processes, one NATS then a 3-node cluster, then the bare protocol on a 3-node cluster; sizes: BUILDQ_SCALE_* (worker/benchscale_test.go)
	@mkdir -p $(BENCH_OUT)
	BUILDQ_BENCH_OUT=$(abspath $(BENCH_OUT)) $(GO) test -tags benchscale -count=1 -timeout 50m -run '^TestBenchScale$$' -v ./worker/
	$(MAKE) --no-print-directory bench-report

bench-report: ## Render docs/benchmarks.md and docs/benchmarks.svg from the figures in docs/benchmarks/
	$(GO) run ./hack/benchreport -in $(BENCH_OUT) -md docs/benchmarks.md -svg docs/benchmarks.svg

image: PLATFORMS ?= linux/amd64,linux/arm64
image: ## Build the buildq image without Docker and push it: make image IMAGE=registry.example.com/buildq/buildq [PLATFORMS=linux/amd64,linux/arm64] [TAG=v1] [INSECURE=1] [SYFT=1: with the SBOM scanner]
	@test -n "$(IMAGE)" || { echo "make image IMAGE=<registry>/<repository> (credentials: your docker config)"; exit 2; }
	$(GO) run ./hack/image --repo $(IMAGE) --platform $(PLATFORMS) $(if $(TAG),--tag $(TAG)) $(if $(INSECURE),--insecure) $(if $(SYFT),--with-syft)

# dev builds bin/buildq, then replaces make's shell with it (exec), so the
# binary's own exit code is the recipe's: Ctrl-C stops the stack and it
# exits 0 (`go run` would turn that into "exit status 1" and make's
# "Error 1"). DEV_ARGS are passed on, e.g. DEV_ARGS="--data .data".
dev: ## Build bin/buildq and run the embedded stack: NATS, S3, registry and a local-executor worker (Ctrl-C stops it)
	@echo "make dev: compiling buildq into $(BIN)/buildq (the first time this takes a few minutes; later runs start at once)..."
	@$(GO) build -o $(BIN)/buildq ./cmd/buildq
	@exec $(BIN)/buildq dev $(DEV_ARGS)

# install puts buildq where `go install` puts binaries — $(go env GOBIN),
# or the first GOPATH's bin — and says whether that directory is on PATH.
install: ## go install ./cmd/buildq, and say where it went and whether that is on PATH
	@$(GO) install ./cmd/buildq
	@dir="$$($(GO) env GOBIN)"; [ -n "$$dir" ] || dir="$$($(GO) env GOPATH | cut -d: -f1)/bin"; \
	echo "installed $$dir/buildq"; \
	case ":$$PATH:" in \
	  *":$$dir:"*) echo "$$dir is on PATH: run buildq";; \
	  *) echo "$$dir is not on PATH; add it, e.g.: export PATH=\"$$dir:\$$PATH\"";; \
	esac

# The Docker-host path (integration/e2e, README "Tests"): Debian's docker.io
# engine, started isolated by hack/docker/start.sh (its own root, socket
# and containerd; no iptables, no bridge; stopped again by hack/docker/stop.sh
# whatever the outcome), the stack's images built by the project and loaded
# pinned by digest (make docker-images), the integration suite's control
# plane and real node for Kubernetes. Needs root and Debian (apt-get).
DOCKER_DIR ?= $(or $(BUILDQ_DOCKER_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/buildq/docker)
DOCKER_IMAGES_ENV ?= $(DOCKER_DIR)/images.env
.PHONY: docker-engine docker-start docker-stop docker-images
docker-engine: ## Install Debian's Docker engine (docker.io) when missing
	bash hack/docker/install.sh

docker-start: docker-engine ## Start the isolated dockerd; prints its DOCKER_HOST
	@bash hack/docker/start.sh

docker-stop: ## Stop the dockerd of make docker-start
	bash hack/docker/stop.sh

docker-images: tools docker-engine ## Build buildq, nats-server, MinIO and registry images, load them into the engine pinned by digest; writes $(DOCKER_IMAGES_ENV) (docker compose --env-file)
	@set -e; host=$$(bash hack/docker/start.sh); export DOCKER_HOST=$$host; \
	  $(GO) run ./hack/docker/images --tools "$$(bash integration/tools/build.sh)" --env $(DOCKER_IMAGES_ENV)

e2e: tools node-packages docker-engine ## Docker-host end-to-end tests: the stack in the Docker engine, kaniko Jobs on the real node
	@set -o pipefail; trap 'bash hack/docker/stop.sh' EXIT; \
	  host=$$(bash hack/docker/start.sh) || { echo "make e2e: the Docker engine did not start; its own error is above (log: $(DOCKER_DIR)/dockerd.log)"; exit 1; }; \
	  export DOCKER_HOST=$$host; \
	  $(GO) run ./hack/docker/images --tools "$$(bash integration/tools/build.sh)" --env $(DOCKER_IMAGES_ENV) >/dev/null || exit 1; \
	  set -a; . $(DOCKER_IMAGES_ENV); set +a; \
	  BUILDQ_E2E_REQUIRE=1 TESTCONTAINERS_RYUK_DISABLED=true $(GO) test -tags e2e -count=1 -timeout 30m -v ./integration/e2e/... 2>&1 | tee /tmp/buildq-e2e.log

clean:
	rm -rf $(BIN)
