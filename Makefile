# DSec build and test entry points. See README.md.
GO      ?= go
BIN     := bin
PKGS    := ./...
export PATH := /usr/local/go/bin:$(PATH)

.PHONY: all build deps test vet up proto bench clean

all: build

deps:
	./scripts/deps.sh

# Four binaries: dsec (the CLI's front: serves `dsec run` itself, hands
# `dsec up|server|edge` to the dsecd next to it and every other command to
# the dsec-cli next to it), dsec-cli (the full client), dsecd (the
# daemons) and dsec-agent (runs in every sandbox).
build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $(BIN)/dsec-agent ./cmd/dsec-agent
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/dsecd ./cmd/dsecd
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/dsec-cli ./cmd/dsec-cli
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/dsec ./cmd/dsec

vet:
	$(GO) vet $(PKGS)
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1; }

# The whole suite. Root-only tests (namespaces, mounts, cgroups) skip
# without root; CI runs as root so they run there. One package at a time
# (-p 1): the suites create hundreds of sandboxes and measure CPU quotas;
# on two cores, packages running side by side turn their timing into flakes,
# and the whole suite still takes only ~3 minutes.
test: deps build vet
	$(GO) test -p 1 -count=1 -timeout 15m $(PKGS)

# One-node DSec in the foreground: system packages, binaries, and a starter
# image busybox:latest (imported only if missing), then `dsec up` (which
# runs bin/dsecd).
DATA_DIR ?= /var/lib/dsec
up: deps build
	./scripts/busybox-rootfs.sh $(BIN)/busybox-rootfs
	$(BIN)/dsec up --data-dir $(DATA_DIR) --import busybox:latest=$(BIN)/busybox-rootfs

proto:
	./scripts/proto.sh

# fncall's language image (Debian bookworm + the packages the language
# table lists) as a rootfs directory; cached: ~2 minutes the first time, a
# no-op while the package list is unchanged. Import it with
# `dsec image import dsec/lang:bookworm bin/lang-rootfs`.
.PHONY: lang-image
lang-image:
	./scripts/langimage.sh $(BIN)/lang-rootfs

clean:
	rm -rf $(BIN)
