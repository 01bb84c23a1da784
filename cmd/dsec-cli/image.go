package main

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

func newImageCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "image", Short: "Manage images"}
	cmd.AddCommand(newImageImportCmd(g), newImageLsCmd(g), newImageRmCmd(g), newImagePullCmd(g))
	return cmd
}

func newImageImportCmd(g *globals) *cobra.Command {
	var serverPath, public, quiet, disk bool
	cmd := &cobra.Command{
		Use:   "import NAME:TAG PATH",
		Short: "Import a directory, rootfs tarball, OCI layout dir or docker-save archive",
		Long: `Import PATH as image NAME:TAG.

PATH is a root filesystem directory, a rootfs tarball (plain, gzip or zstd),
an OCI layout directory or a docker-save archive. It is uploaded as a stream
(a directory is tarred on the fly). With --server-path, PATH names a path on
the server's file system and nothing is uploaded.

With --disk, PATH is one bootable disk file (qcow2 or raw) for sandboxes of
backend fullvm, stored as it is (scripts/vm-disk-image.sh builds a Debian
one). A qcow2 with a backing file or an external data file is refused.`,
		Args: cli.ExactArgs(2, "NAME:TAG PATH"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, path := args[0], args[1]
			c, err := g.client()
			if err != nil {
				return err
			}
			var opts []dsec.ImportOption
			if public {
				opts = append(opts, dsec.Public())
			}
			if disk {
				// A disk is one file: a directory would be tarred, which
				// no disk image is.
				if info, err := os.Stat(path); err == nil && !info.Mode().IsRegular() && !serverPath {
					return cli.Usagef("--disk: %s is not a regular file (want a qcow2 or raw disk image)", path)
				}
				opts = append(opts, dsec.Disk())
			}
			var im *dsec.Image
			if serverPath {
				im, err = c.Images().ImportServerPath(cmd.Context(), ref, path, opts...)
			} else {
				im, err = importUpload(cmd.Context(), c, ref, path, !quiet && term.IsTerminal(int(os.Stderr.Fd())), opts)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s %s\n", im.Ref, im.Digest)
			return nil
		},
	}
	cmd.Flags().BoolVar(&serverPath, "server-path", false, "PATH is on the server; import it there instead of uploading")
	cmd.Flags().BoolVar(&public, "public", false, "make the image visible to every tenant (admin only)")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "no progress bar")
	cmd.Flags().BoolVar(&disk, "disk", false, "PATH is a bootable disk image (qcow2 or raw) for backend fullvm")
	return cmd
}

func newImagePullCmd(g *globals) *cobra.Command {
	var public, quiet bool
	cmd := &cobra.Command{
		Use:   "pull REF [NAME:TAG]",
		Short: "Convert an image from a registry into the store",
		Long: `Have the server pull image REF ([HOST[:PORT]/]REPO[:TAG|@sha256:HEX],
Docker Hub without a host; plain HTTP for loopback and private hosts) from
its registry and convert its layers into the store, as image NAME:TAG
(default: REF's repository and tag). An image already converted from the
manifest the registry serves now is reused: nothing is converted again.`,
		Args: cli.RangeArgs(1, 2, "REF [NAME:TAG]"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			o := dsec.PullOptions{Public: public}
			if len(args) == 2 {
				o.Ref = args[1]
			}
			if !quiet && term.IsTerminal(int(os.Stderr.Fd())) {
				var drawn bool
				o.Progress = func(done, total int64) {
					drawn = true
					fmt.Fprintf(os.Stderr, "\rconverting %s: layer %d of %d", args[0], done, total)
				}
				defer func() {
					if drawn {
						fmt.Fprintln(os.Stderr)
					}
				}()
			}
			p, err := c.Images().Pull(cmd.Context(), args[0], o)
			if err != nil {
				return err
			}
			note := "converted"
			if !p.Converted {
				note = "up to date"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s %s (%s, from %s)\n", p.Image.Ref, p.Image.Digest, note, p.SourceDigest)
			return nil
		},
	}
	cmd.Flags().BoolVar(&public, "public", false, "make the image visible to every tenant (admin only)")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "no progress")
	return cmd
}

// importUpload streams path to the server: files as they are, directories
// as a tar written on the fly, OCI layouts converted on the fly to a
// docker-save archive (the server recognises that from the stream alone).
func importUpload(ctx context.Context, c *dsec.Client, ref, path string, showProgress bool, opts []dsec.ImportOption) (*dsec.Image, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("import %s: %w", ref, err)
	}
	var (
		r     io.Reader
		total int64 = -1
	)
	switch {
	case info.Mode().IsRegular():
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("import %s: %w", ref, err)
		}
		defer f.Close()
		r, total = f, info.Size()
	case info.IsDir():
		pr, pw := io.Pipe()
		defer pr.Close()
		go func() {
			if _, err := os.Stat(filepath.Join(path, "oci-layout")); err == nil {
				pw.CloseWithError(writeDockerSave(path, ref, pw))
				return
			}
			pw.CloseWithError(writeTar(ctx, path, pw))
		}()
		r = pr
	default:
		return nil, fmt.Errorf("import %s: %s is neither a directory nor a regular file", ref, path)
	}
	if showProgress {
		line := newProgressLine(os.Stderr, "uploading "+filepath.Base(path), total)
		defer line.Close()
		r = io.TeeReader(r, line)
	}
	return c.Images().Import(ctx, ref, r, opts...)
}

// writeTar writes the tree at root as a tar stream, keeping modes,
// ownership, symlinks and hard links so that the image's files look as they
// do on disk.
func writeTar(ctx context.Context, root string, w io.Writer) error {
	tw := tar.NewWriter(w)
	type inode struct{ dev, ino uint64 }
	seen := map[inode]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if info.Mode()&fs.ModeSocket != 0 {
			return nil // sockets cannot be archived and mean nothing in an image
		}
		var link string
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		hdr.Name = filepath.ToSlash(rel)
		if info.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		if id, ok := fileInode(info); ok && info.Mode().IsRegular() {
			key := inode(id)
			if first, dup := seen[key]; dup {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				seen[key] = hdr.Name
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if hdr.Typeflag != tar.TypeReg {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		return fmt.Errorf("tar %s: %w", root, err)
	}
	return tw.Close()
}

// imageJSON is the --json form of an image.
type imageJSON struct {
	Ref       string    `json:"ref"`
	Digest    string    `json:"digest"`
	Layers    []string  `json:"layers"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
	Tenant    string    `json:"tenant,omitempty"`
	Disk      string    `json:"disk_format,omitempty"`
}

func newImageLsCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List images",
		Args:  cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			images, err := c.Images().List(cmd.Context())
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				list := make([]imageJSON, 0, len(images))
				for _, im := range images {
					list = append(list, imageJSON{im.Ref, im.Digest, im.Layers, im.Size, im.CreatedAt, im.Tenant, im.DiskFormat})
				}
				return writeJSON(out, list)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "REF\tDIGEST\tLAYERS\tSIZE\tCREATED\tTENANT")
			for _, im := range images {
				tenant := im.Tenant
				if tenant == "" {
					tenant = "(public)"
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", im.Ref, shortDigest(im.Digest), len(im.Layers),
					humanBytes(im.Size), ago(im.CreatedAt), tenant)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newImageRmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME:TAG...",
		Short: "Remove image refs (layers go at garbage collection)",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cli.Usagef("want at least one NAME:TAG")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			var firstErr error
			for _, ref := range args {
				if err := c.Images().Delete(cmd.Context(), ref); err != nil {
					fmt.Fprintln(cmd.ErrOrStderr(), "dsec:", err)
					if firstErr == nil {
						firstErr = err
					}
				}
			}
			if firstErr != nil {
				return &cli.ExitCodeError{Code: cli.ExitError}
			}
			return nil
		},
	}
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func shortDigest(d string) string {
	const n = len("sha256:") + 12
	if len(d) > n {
		return d[:n]
	}
	return d
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := time.Since(t).Round(time.Second)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d.Hours()))
	}
	return fmt.Sprintf("%dd ago", int(d.Hours()/24))
}
