package main

// An OCI layout directory is uploaded as a docker-save archive, which the
// server recognises from the stream alone. The conversion is written out
// here rather than done with go-containerregistry: that library (with
// klauspost/compress and the OCI spec packages) would cost every CLI call
// its package initialisation, for a command few calls use. The archive is
// the layout's own blobs, unchanged (layers stay compressed, as `docker
// save` since Docker 25 writes them), plus the manifest.json that names
// them.

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// ociDescriptor is the part of an OCI content descriptor the conversion
// needs.
type ociDescriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
}

// ociIndex is index.json, and ociManifest an image manifest.
type ociIndex struct {
	Manifests []ociDescriptor `json:"manifests"`
}

type ociManifest struct {
	MediaType string          `json:"mediaType"`
	Config    ociDescriptor   `json:"config"`
	Layers    []ociDescriptor `json:"layers"`
}

// dockerSaveEntry is one image of a docker-save manifest.json.
type dockerSaveEntry struct {
	Config   string
	RepoTags []string
	Layers   []string
}

// validDigest reports whether d looks like ALGORITHM:ENCODED (the OCI
// grammar) before it names a file, which keeps a crafted index from
// reaching outside blobs/.
func validDigest(d string) bool {
	alg, enc, ok := strings.Cut(d, ":")
	if !ok || alg == "" || enc == "" {
		return false
	}
	for _, c := range alg {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || strings.ContainsRune("+._-", c)) {
			return false
		}
	}
	for _, c := range enc {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("=_-", c)) {
			return false
		}
	}
	return alg[0] != '.' && alg[0] != '-'
}

// isIndexType tells an index (a list of manifests, one per platform) from
// an image manifest.
func isIndexType(mt string) bool {
	return mt == "application/vnd.oci.image.index.v1+json" ||
		mt == "application/vnd.docker.distribution.manifest.list.v2+json"
}

// blobPath is where desc's content lives in the layout at dir.
func blobPath(dir string, desc ociDescriptor) (string, error) {
	if !validDigest(desc.Digest) {
		return "", fmt.Errorf("malformed digest %q", desc.Digest)
	}
	alg, hex, _ := strings.Cut(desc.Digest, ":")
	return filepath.Join(dir, "blobs", alg, hex), nil
}

// readJSONBlob decodes a small JSON blob of the layout.
func readJSONBlob(dir string, desc ociDescriptor, v any) error {
	p, err := blobPath(dir, desc)
	if err != nil {
		return err
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", desc.Digest, err)
	}
	return nil
}

// writeDockerSave converts the OCI layout at dir, which must hold exactly
// one image, to a docker-save archive of it tagged dsec.local/REF.
func writeDockerSave(dir, ref string, w io.Writer) error {
	fail := func(err error) error { return fmt.Errorf("OCI layout %s: %w", dir, err) }
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		return fail(err)
	}
	var idx ociIndex
	if err := json.Unmarshal(b, &idx); err != nil {
		return fail(fmt.Errorf("index.json: %w", err))
	}
	if len(idx.Manifests) != 1 {
		return fmt.Errorf("OCI layout %s holds %d manifests; import it with --server-path to pick one by platform", dir, len(idx.Manifests))
	}
	if isIndexType(idx.Manifests[0].MediaType) {
		return fmt.Errorf("OCI layout %s: its manifest is an index of several images; import it with --server-path to pick one by platform", dir)
	}
	var m ociManifest
	if err := readJSONBlob(dir, idx.Manifests[0], &m); err != nil {
		return fail(fmt.Errorf("manifest: %w", err))
	}
	if isIndexType(m.MediaType) {
		return fmt.Errorf("OCI layout %s: its manifest is an index of several images; import it with --server-path to pick one by platform", dir)
	}
	if m.Config.Digest == "" {
		return fail(errors.New("manifest names no config"))
	}
	if len(m.Layers) == 0 {
		return fail(errors.New("image has no layers"))
	}

	// Every blob under the name it has in the layout, each once (an image
	// may repeat a layer, e.g. an empty one).
	var blobs []layoutBlob
	seen := map[string]bool{}
	add := func(desc ociDescriptor) (string, error) {
		p, err := blobPath(dir, desc)
		if err != nil {
			return "", err
		}
		alg, hex, _ := strings.Cut(desc.Digest, ":")
		name := "blobs/" + alg + "/" + hex
		if !seen[name] {
			seen[name] = true
			blobs = append(blobs, layoutBlob{name, p, desc})
		}
		return name, nil
	}
	entry := dockerSaveEntry{RepoTags: []string{"dsec.local/" + ref}}
	if entry.Config, err = add(m.Config); err != nil {
		return fail(fmt.Errorf("config: %w", err))
	}
	for i, l := range m.Layers {
		name, err := add(l)
		if err != nil {
			return fail(fmt.Errorf("layer %d: %w", i, err))
		}
		entry.Layers = append(entry.Layers, name)
	}

	// manifest.json first: the server tells a docker-save archive from a
	// rootfs tarball by it.
	manifest, err := json.Marshal([]dockerSaveEntry{entry})
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	mtime := time.Unix(0, 0)
	if err := tw.WriteHeader(&tar.Header{Name: "manifest.json", Mode: 0o644, Size: int64(len(manifest)), ModTime: mtime, Format: tar.FormatPAX}); err != nil {
		return err
	}
	if _, err := tw.Write(manifest); err != nil {
		return err
	}
	for _, bl := range blobs {
		if err := bl.copyTo(tw, mtime); err != nil {
			return fail(err)
		}
	}
	return tw.Close()
}

// layoutBlob is one blob of the layout: its name in the archive, its file
// and its descriptor.
type layoutBlob struct {
	name, path string
	desc       ociDescriptor
}

// copyTo appends the blob to tw, refusing one whose size differs from its
// descriptor's (a truncated copy of the layout).
func (b layoutBlob) copyTo(tw *tar.Writer, mtime time.Time) error {
	f, err := os.Open(b.path)
	if err != nil {
		return err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return err
	}
	if !info.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", b.path)
	}
	if b.desc.Size > 0 && b.desc.Size != info.Size() {
		return fmt.Errorf("blob %s: %d bytes, the manifest says %d", b.desc.Digest, info.Size(), b.desc.Size)
	}
	if err := tw.WriteHeader(&tar.Header{Name: b.name, Mode: 0o644, Size: info.Size(), ModTime: mtime, Format: tar.FormatPAX}); err != nil {
		return err
	}
	// A file that grew meanwhile is cut at its size (the tar writer
	// refuses more); one that shrank fails here.
	if _, err := io.CopyN(tw, f, info.Size()); err != nil {
		return fmt.Errorf("%s: %w", b.path, err)
	}
	return nil
}
