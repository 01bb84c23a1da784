package main

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/lazyfs"
)

// lazyBytes parses --lazy-cache and --lazy-min-size; min is -1 for "off"
// (every layer fetched whole).
func (f *edgeFlags) lazyBytes() (cache, min int64, err error) {
	if cache, err = cli.ParseSize("lazy-cache", f.lazyCache); err != nil {
		return 0, 0, err
	}
	if cache <= 0 {
		return 0, 0, cli.Usagef("--lazy-cache %s: must be positive", f.lazyCache)
	}
	if f.lazyMin == "off" {
		return cache, -1, nil
	}
	if min, err = cli.ParseSize("lazy-min-size", f.lazyMin); err != nil {
		return 0, 0, err
	}
	return cache, min, nil
}

// openLazy puts the lazy layer loader in front of a remote store (an s3
// store behind its node cache): the node then mounts layers it does not
// hold from chunks fetched on demand, in DATA-DIR/lazy. Other stores are
// returned as they are: their layers are local files already.
func (f *edgeFlags) openLazy(dataDir string, store blobstore.Repository, log *slog.Logger, reg prometheus.Registerer) (blobstore.Repository, error) {
	cache, ok := store.(*blobstore.Cache)
	if !ok {
		return store, nil
	}
	size, min, err := f.lazyBytes()
	if err != nil {
		return nil, err
	}
	if min < 0 {
		return store, nil
	}
	fs, err := lazyfs.Mount(lazyfs.Options{
		Remote:     cache.Remote(),
		Dir:        filepath.Join(dataDir, "lazy"),
		CacheBytes: size,
		Registry:   reg,
		Logger:     log,
	})
	if err != nil {
		return nil, fmt.Errorf("lazy layers: %w", err)
	}
	f.lazy = fs
	return lazyfs.NewStore(cache, fs, min), nil
}

func (f *edgeFlags) closeLazy(log *slog.Logger) {
	if f.lazy == nil {
		return
	}
	if err := f.lazy.Close(); err != nil {
		log.Warn("unmount lazy layers", "err", err)
	}
	f.lazy = nil
}
