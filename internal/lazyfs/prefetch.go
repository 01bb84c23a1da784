package lazyfs

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/layer"
)

// prefetchMagic starts a prefetch list: the chunk numbers a first run of
// the layer read, in order, as little-endian uint32s. Not JSON, like the
// chunk index, so gc does not scan it for digests.
const prefetchMagic = "DSECPFL1"

func storePrefetch(ctx context.Context, repo blobstore.Repository, digest string, order []uint32) error {
	var b bytes.Buffer
	b.WriteString(prefetchMagic)
	for _, c := range order {
		b.Write(binary.LittleEndian.AppendUint32(nil, c))
	}
	desc, err := repo.Put(ctx, &b)
	if err != nil {
		return err
	}
	return repo.Refs().Set(ctx, layer.PrefetchRef(digest), desc.Digest)
}

// loadPrefetch reads the layer's prefetch list; blobstore.ErrNotFound when
// none was recorded yet.
func loadPrefetch(ctx context.Context, repo blobstore.Repository, digest string, chunks int) ([]uint32, error) {
	d, err := repo.Refs().Get(ctx, layer.PrefetchRef(digest))
	if err != nil {
		return nil, err
	}
	b, err := blobstore.ReadAll(ctx, repo, d)
	if err != nil {
		return nil, err
	}
	if !bytes.HasPrefix(b, []byte(prefetchMagic)) || (len(b)-len(prefetchMagic))%4 != 0 {
		return nil, fmt.Errorf("prefetch list of %s: malformed", digest)
	}
	b = b[len(prefetchMagic):]
	out := make([]uint32, 0, len(b)/4)
	for i := 0; i < len(b); i += 4 {
		c := binary.LittleEndian.Uint32(b[i:])
		if int(c) >= chunks {
			return nil, fmt.Errorf("prefetch list of %s: chunk %d out of range", digest, c)
		}
		out = append(out, c)
	}
	return out, nil
}
