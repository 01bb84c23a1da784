package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// gcJSON is the --json form of a collection.
type gcJSON struct {
	DryRun       bool     `json:"dry_run"`
	ScannedBlobs int64    `json:"scanned_blobs"`
	ScannedBytes int64    `json:"scanned_bytes"`
	FreedBlobs   int64    `json:"freed_blobs"`
	FreedBytes   int64    `json:"freed_bytes"`
	KeptBlobs    int64    `json:"kept_blobs"`
	KeptBytes    int64    `json:"kept_bytes"`
	Referenced   int64    `json:"referenced_blobs"`
	Held         int64    `json:"held_blobs"`
	Young        int64    `json:"young_blobs"`
	Freed        []string `json:"freed"`
	BrokenRefs   []string `json:"broken_refs,omitempty"`
}

func newGCCmd(g *globals) *cobra.Command {
	var (
		dryRun, asJSON bool
		grace          time.Duration
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Free the blobs nothing needs any more (admin)",
		Long: `Delete the layers, manifests and data blobs of the blob store that no
image tag, shipped trajectory or other ref reaches, that no node's sandboxes
hold, and that were stored more than --grace ago (default 15m: operations in
flight store blobs before the refs naming them, so collection is safe while
they run). Only the admin may run it.

--dry-run reports what would be freed without deleting anything; --json
prints the report with the list of freed digests.`,
		Args: cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &dsecv1.GarbageCollectRequest{DryRun: dryRun}
			if cmd.Flags().Changed("grace") {
				if grace < 0 {
					return cli.Usagef("--grace: %v is negative", grace)
				}
				req.Grace = durationpb.New(grace)
			}
			client, err := g.imageServiceClient()
			if err != nil {
				return err
			}
			resp, err := client.GarbageCollect(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			r := resp.Msg
			out := cmd.OutOrStdout()
			if asJSON {
				freed := r.GetFreed()
				if freed == nil {
					freed = []string{}
				}
				if err := writeJSON(out, gcJSON{
					DryRun: r.GetDryRun(), ScannedBlobs: r.GetScannedBlobs(), ScannedBytes: r.GetScannedBytes(),
					FreedBlobs: r.GetFreedBlobs(), FreedBytes: r.GetFreedBytes(), KeptBlobs: r.GetKeptBlobs(), KeptBytes: r.GetKeptBytes(),
					Referenced: r.GetReferencedBlobs(), Held: r.GetHeldBlobs(), Young: r.GetYoungBlobs(),
					Freed: freed, BrokenRefs: r.GetBrokenRefs(),
				}); err != nil {
					return err
				}
			} else {
				fmt.Fprintln(out, gcSummary(r))
			}
			if broken := r.GetBrokenRefs(); len(broken) > 0 {
				return &cli.ExitCodeError{Code: cli.ExitError, Msg: fmt.Sprintf(
					"%d ref(s) set during the collection name a blob it freed; store them again: %s",
					len(broken), strings.Join(broken, ", "))}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "report what would be freed; delete nothing")
	cmd.Flags().DurationVar(&grace, "grace", 15*time.Minute, "keep blobs stored less than this long ago")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON, with the freed digests")
	return cmd
}

// gcSummary is the one-line report, e.g. "freed 3 blobs (12.4MiB) of 17
// scanned; kept 14 (12 referenced, 2 held by nodes)".
func gcSummary(r *dsecv1.GarbageCollectResponse) string {
	verb := "freed"
	if r.GetDryRun() {
		verb = "would free"
	}
	var why []string
	for _, c := range []struct {
		n    int64
		what string
	}{
		{r.GetReferencedBlobs(), "referenced"},
		{r.GetHeldBlobs(), "held by nodes"},
		{r.GetYoungBlobs(), "recent"},
	} {
		if c.n > 0 {
			why = append(why, fmt.Sprintf("%d %s", c.n, c.what))
		}
	}
	s := fmt.Sprintf("%s %s (%s) of %d scanned; kept %d", verb, plural(int(r.GetFreedBlobs()), "blob"),
		humanBytes(r.GetFreedBytes()), r.GetScannedBlobs(), r.GetKeptBlobs())
	if len(why) > 0 {
		s += " (" + strings.Join(why, ", ") + ")"
	}
	return s
}

// imageServiceClient is a raw ImageService client, for the calls the SDK
// does not wrap; it authenticates as g.client does.
func (g *globals) imageServiceClient() (dsecv1connect.ImageServiceClient, error) {
	token := g.token
	if token == "" && g.tokenFile != "" {
		b, err := os.ReadFile(g.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	token = dsec.ResolveToken(token)
	auth := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if token != "" {
				req.Header().Set("Authorization", "Bearer "+token)
			}
			return next(ctx, req)
		}
	})
	return dsecv1connect.NewImageServiceClient(http.DefaultClient, dsec.ResolveEndpoint(g.endpoint), connect.WithInterceptors(auth)), nil
}
