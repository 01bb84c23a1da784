package main

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

func newNodeCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "node", Short: "Inspect the cluster's nodes (admin token)"}
	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List nodes: capacity, what they are charged and use, pressure, sandboxes",
		Long: `List every node the server knows, alive or not, one line each, as of the
node's last heartbeat:

  SANDBOXES  sandboxes charged (live and pooled) of the node's slots
  CPU        busy cores (measured, all of the node) of the cores offered
  MEMORY     memory in use that the node cannot reclaim, of its RAM
  SWAP       swap in use of the swap there is ("-": none)
  PSI        memory pressure, PSI avg10 "some/full" in percent
  CHARGED    CPU and memory placement charges the node: measured use plus
             its request share of what its sandboxes request
  REQUESTED  CPU and memory its sandboxes request (their limits are not
             reserved)
  FILES      the edge's descriptors of its open-file limit
  THREADS    the system's threads of the most the kernel allows
  STATES     sandboxes by state, BACKENDS by backend
  FULL       why the node refuses creates ("-": it takes them)

A dead node shows "-" for what it measured. --json prints everything,
per backend.`,
		Args: cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			nodes, err := c.Nodes(cmd.Context())
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				js := make([]nodeJSON, 0, len(nodes))
				for _, n := range nodes {
					js = append(js, toNodeJSON(n))
				}
				return writeJSON(out, js)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NODE\tALIVE\tSEEN\tSANDBOXES\tCPU\tMEMORY\tSWAP\tPSI\tCHARGED\tREQUESTED\tFILES\tTHREADS\tSTATES\tBACKENDS\tFULL")
			for _, n := range nodes {
				fmt.Fprintln(tw, strings.Join(nodeRow(n), "\t"))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.AddCommand(ls)
	return cmd
}

// nodeRow is n's line of node ls.
func nodeRow(n *dsec.Node) []string {
	var slots, charged, cpuCap, chCPU, chMem, reqCPU, reqMem int64
	for _, b := range n.Backends {
		slots += b.Sandboxes
		charged += b.ChargedSandboxes
		// Each backend is offered the machine's cores by default: the
		// node's are the most any backend is offered, not their sum.
		cpuCap = max(cpuCap, b.MilliCPU)
		chCPU += b.ChargedMilliCPU
		chMem += b.ChargedMemoryBytes
		reqCPU += b.RequestedMilliCPU
		reqMem += b.RequestedMemoryBytes
	}
	alive, m := "yes", n.Measured
	cpu, mem, swap, psi := "-", "-", "-", "-"
	chargedCol, files, threads, full := "-", "-", "-", "-"
	if !n.Alive {
		alive = "no"
	} else {
		cpu = cores(m.MilliCPU) + "/" + cores(cpuCap)
		if m.MemoryTotalBytes > 0 {
			mem = humanBytes(m.MemoryUsedBytes) + "/" + humanBytes(m.MemoryTotalBytes)
		}
		if m.SwapTotalBytes > 0 {
			swap = humanBytes(m.SwapUsedBytes) + "/" + humanBytes(m.SwapTotalBytes)
		}
		if m.PSIMemorySome >= 0 {
			psi = strconv.FormatFloat(m.PSIMemorySome, 'f', 2, 64) + "/" + strconv.FormatFloat(m.PSIMemoryFull, 'f', 2, 64)
		}
		chargedCol = cores(chCPU) + "," + humanBytes(chMem)
		if m.MaxOpenFiles > 0 {
			files = fmt.Sprintf("%d/%d", m.OpenFiles, m.MaxOpenFiles)
		}
		if m.MaxThreads > 0 {
			threads = fmt.Sprintf("%d/%d", m.Threads, m.MaxThreads)
		}
		if n.Full != "" {
			full = n.Full
		}
	}
	return []string{
		n.ID, alive, ago(n.LastHeartbeat), fmt.Sprintf("%d/%d", charged, slots), cpu, mem, swap, psi,
		chargedCol, cores(reqCPU) + "," + humanBytes(reqMem), files, threads,
		counts(n.ByState()), counts(n.ByBackend()), full,
	}
}

// cores formats thousandths of a core as cores ("0", "0.25", "2").
func cores(m int64) string {
	return strconv.FormatFloat(float64(m)/1000, 'f', -1, 64)
}

// counts formats a count per name as "a=1,b=2", "-" when empty.
func counts(m map[string]int64) string {
	if len(m) == 0 {
		return "-"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, ",")
}

// nodeJSON is the --json form of a node.
type nodeJSON struct {
	ID            string             `json:"id"`
	Alive         bool               `json:"alive"`
	LastHeartbeat time.Time          `json:"last_heartbeat_at"`
	URL           string             `json:"url"`
	Full          string             `json:"full,omitempty"`
	Load          float64            `json:"load"`
	Queued        int                `json:"queued"`
	Pools         int                `json:"pools"`
	Backends      []nodeBackendJSON  `json:"backends"`
	Measured      nodeMeasuredJSON   `json:"measured"`
	Sandboxes     []sandboxCountJSON `json:"sandboxes"`
}

type nodeBackendJSON struct {
	Backend              string  `json:"backend"`
	MilliCPU             int64   `json:"milli_cpu"`
	MemoryBytes          int64   `json:"memory_bytes"`
	Sandboxes            int64   `json:"sandboxes"`
	ChargedMilliCPU      int64   `json:"charged_milli_cpu"`
	ChargedMemoryBytes   int64   `json:"charged_memory_bytes"`
	ChargedSandboxes     int64   `json:"charged_sandboxes"`
	RequestedMilliCPU    int64   `json:"requested_milli_cpu"`
	RequestedMemoryBytes int64   `json:"requested_memory_bytes"`
	RequestShareCPU      float64 `json:"request_share_cpu"`
	RequestShareMemory   float64 `json:"request_share_memory"`
	UsedMilliCPU         int64   `json:"used_milli_cpu"`
	UsedMemoryBytes      int64   `json:"used_memory_bytes"`
	UsedSwapBytes        int64   `json:"used_swap_bytes"`
}

type nodeMeasuredJSON struct {
	MilliCPU             int64   `json:"milli_cpu"`
	MemoryTotalBytes     int64   `json:"memory_total_bytes"`
	MemoryUsedBytes      int64   `json:"memory_used_bytes"`
	MemoryAvailableBytes int64   `json:"memory_available_bytes"`
	SwapTotalBytes       int64   `json:"swap_total_bytes"`
	SwapUsedBytes        int64   `json:"swap_used_bytes"`
	PSIMemorySome        float64 `json:"psi_memory_some"`
	PSIMemoryFull        float64 `json:"psi_memory_full"`
	PSICPUSome           float64 `json:"psi_cpu_some"`
	OpenFiles            int64   `json:"open_files"`
	MaxOpenFiles         int64   `json:"max_open_files"`
	Threads              int64   `json:"threads"`
	MaxThreads           int64   `json:"max_threads"`
}

type sandboxCountJSON struct {
	Backend string `json:"backend"`
	State   string `json:"state"`
	Count   int64  `json:"count"`
}

func toNodeJSON(n *dsec.Node) nodeJSON {
	m := n.Measured
	j := nodeJSON{
		ID: n.ID, Alive: n.Alive, LastHeartbeat: n.LastHeartbeat, URL: n.URL, Full: n.Full,
		Load: n.Load, Queued: n.Queued, Pools: n.Pools,
		Backends:  []nodeBackendJSON{},
		Sandboxes: []sandboxCountJSON{},
		Measured: nodeMeasuredJSON{
			MilliCPU: m.MilliCPU, MemoryTotalBytes: m.MemoryTotalBytes, MemoryUsedBytes: m.MemoryUsedBytes,
			MemoryAvailableBytes: m.MemoryAvailableBytes, SwapTotalBytes: m.SwapTotalBytes, SwapUsedBytes: m.SwapUsedBytes,
			PSIMemorySome: m.PSIMemorySome, PSIMemoryFull: m.PSIMemoryFull, PSICPUSome: m.PSICPUSome,
			OpenFiles: m.OpenFiles, MaxOpenFiles: m.MaxOpenFiles, Threads: m.Threads, MaxThreads: m.MaxThreads,
		},
	}
	for _, b := range n.Backends {
		j.Backends = append(j.Backends, nodeBackendJSON(b))
	}
	for _, c := range n.Sandboxes {
		j.Sandboxes = append(j.Sandboxes, sandboxCountJSON(c))
	}
	return j
}
