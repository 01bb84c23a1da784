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
# The s3 blob store's tests need SeaweedFS's weed (scripts/seaweedfs.sh,
# built once into /var/cache/dsec/bin): deps builds it for test only.
test: export DSEC_SEAWEEDFS ?= 1
test: deps build vet
	$(GO) test -p 1 -count=1 -timeout 15m $(PKGS)

# One-node DSec in the foreground: system packages, binaries, and a starter
# image busybox:latest (imported only if missing), then `dsec up` (which
# runs bin/dsecd). Meanwhile fncall's language image (python, bash, c, cpp,
# go, nodejs for `dsec fn run` and POST /run_code) is built and imported in
# the background (scripts/up-langimage.sh; ~2 min the first time, a check
# afterwards); LANG_IMAGE=0 skips it.
DATA_DIR ?= /var/lib/dsec
LANG_ROOTFS ?= /var/cache/dsec/lang-rootfs
LANG_IMAGE ?= 1
up: deps build
	./scripts/busybox-rootfs.sh $(BIN)/busybox-rootfs
	@set -e; bg=; \
	if [ "$(LANG_IMAGE)" = 1 ]; then \
	  ./scripts/up-langimage.sh $(BIN)/dsec $(DATA_DIR) $(LANG_ROOTFS) & bg=$$!; \
	  trap 'kill $$bg 2>/dev/null || true' EXIT INT TERM; \
	fi; \
	$(BIN)/dsec up --data-dir $(DATA_DIR) --import busybox:latest=$(BIN)/busybox-rootfs

proto:
	./scripts/proto.sh

# fncall's language image (Debian bookworm + the packages the language
# table lists) as a rootfs directory, outside the checkout (a Debian tree
# under the module would be part of `go vet ./...`); cached: ~2 minutes the
# first time, a no-op while the package list is unchanged. `make up` builds
# and imports it by itself; by hand:
# `dsec image import --public --server-path dsec/lang:bookworm /var/cache/dsec/lang-rootfs`.
.PHONY: lang-image
lang-image:
	./scripts/langimage.sh $(LANG_ROOTFS)

clean:
	rm -rf $(BIN)
