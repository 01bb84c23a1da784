package main

import (
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// tenantFlags are the quota and default flags of `tenant create` and
// `tenant update`.
type tenantFlags struct {
	maxSandboxes, defPids        int64
	maxCPU, maxMemory, maxImport string
	defCPU, defMemory, defDisk   string
}

func (f *tenantFlags) register(fl *pflag.FlagSet) {
	fl.Int64Var(&f.maxSandboxes, "max-sandboxes", 0, "most live sandboxes and pooled ones at once (0: unlimited)")
	fl.StringVar(&f.maxCPU, "max-cpu", "", "most cores over all live and pooled sandboxes, e.g. 8 or 0.5 (0: unlimited)")
	fl.StringVar(&f.maxMemory, "max-memory", "", "most memory over all live and pooled sandboxes, e.g. 16g (0: unlimited)")
	fl.StringVar(&f.maxImport, "max-import-size", "", "largest image an import may expand to after decompression, e.g. 2g (0: the server's --max-import-size)")
	fl.StringVar(&f.defCPU, "default-cpu", "", "cores a sandbox gets when its spec says none (0: the node's default)")
	fl.StringVar(&f.defMemory, "default-memory", "", "memory limit a sandbox gets when its spec says none, e.g. 512m (0: the node's default)")
	fl.Int64Var(&f.defPids, "default-pids", 0, "process limit a sandbox gets when its spec says none (0: the node's default)")
	fl.StringVar(&f.defDisk, "default-disk", "", "writable-layer size a sandbox gets when its spec says none, e.g. 5g (0: the node's default)")
}

// update parses the flags set on fl into u (all of them for a create,
// where an unset flag is 0).
func (f *tenantFlags) update(fl *pflag.FlagSet) (dsec.TenantUpdate, error) {
	var u dsec.TenantUpdate
	count := func(name string, v int64, dst **int64) error {
		if !fl.Changed(name) {
			return nil
		}
		if v < 0 {
			return cli.Usagef("--%s %d: must not be negative", name, v)
		}
		*dst = &v
		return nil
	}
	parse := func(name, v string, p func(flag, s string) (int64, error), dst **int64) error {
		if !fl.Changed(name) {
			return nil
		}
		n, err := p(name, v)
		if err != nil {
			return cli.UsageError{Err: err}
		}
		*dst = &n
		return nil
	}
	for _, err := range []error{
		count("max-sandboxes", f.maxSandboxes, &u.MaxSandboxes),
		parse("max-cpu", f.maxCPU, cli.ParseCPU, &u.MaxMilliCPU),
		parse("max-memory", f.maxMemory, cli.ParseSize, &u.MaxMemoryBytes),
		parse("max-import-size", f.maxImport, cli.ParseSize, &u.MaxImportBytes),
		parse("default-cpu", f.defCPU, cli.ParseCPU, &u.DefaultMilliCPU),
		parse("default-memory", f.defMemory, cli.ParseSize, &u.DefaultMemoryBytes),
		count("default-pids", f.defPids, &u.DefaultPids),
		parse("default-disk", f.defDisk, cli.ParseSize, &u.DefaultDiskBytes),
	} {
		if err != nil {
			return u, err
		}
	}
	return u, nil
}

func deref(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}

func newTenantCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "tenant", Short: "Manage tenants: quotas and the defaults their sandboxes get (admin token)"}
	var cf tenantFlags
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a tenant and print its token (shown once)",
		Args:  cli.ExactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			u, err := cf.update(cmd.Flags())
			if err != nil {
				return err
			}
			q := dsec.Quota{
				MaxSandboxes: deref(u.MaxSandboxes), MaxMilliCPU: deref(u.MaxMilliCPU),
				MaxMemoryBytes: deref(u.MaxMemoryBytes), MaxImportBytes: deref(u.MaxImportBytes),
			}
			d := dsec.Resources{
				MilliCPU: deref(u.DefaultMilliCPU), MemoryBytes: deref(u.DefaultMemoryBytes),
				Pids: deref(u.DefaultPids), DiskBytes: deref(u.DefaultDiskBytes),
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			token, err := c.Tenants().CreateWithDefaults(cmd.Context(), args[0], q, d)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), token)
			return nil
		},
	}
	cf.register(create.Flags())

	var uf tenantFlags
	var updateJSON bool
	update := &cobra.Command{
		Use:   "update NAME [--max-*|--default-* ...]",
		Short: "Change a tenant's quota and defaults (the flags given; 0 means unlimited or the node's default)",
		Args:  cli.ExactArgs(1, "NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			u, err := uf.update(cmd.Flags())
			if err != nil {
				return err
			}
			if u == (dsec.TenantUpdate{}) {
				return cli.Usagef("nothing to change: give at least one --max-* or --default-* flag")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			t, err := c.Tenants().Update(cmd.Context(), args[0], u)
			if err != nil {
				return err
			}
			return printTenant(cmd, t, updateJSON)
		},
	}
	uf.register(update.Flags())
	update.Flags().BoolVar(&updateJSON, "json", false, "print the tenant as JSON")

	var getJSON bool
	get := &cobra.Command{
		Use:   "get [NAME]",
		Short: "Show a tenant's quota, defaults and usage (a tenant's own token: itself)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			name := ""
			if len(args) == 1 {
				name = args[0]
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			t, err := c.Tenants().Get(cmd.Context(), name)
			if err != nil {
				return err
			}
			return printTenant(cmd, t, getJSON)
		},
	}
	get.Flags().BoolVar(&getJSON, "json", false, "print JSON")

	var lsJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List tenants with their quotas and usage",
		Args:  cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			ts, err := c.Tenants().List(cmd.Context())
			if err != nil {
				return err
			}
			if lsJSON {
				js := make([]tenantJSON, 0, len(ts))
				for _, t := range ts {
					js = append(js, toTenantJSON(t))
				}
				return writeJSON(cmd.OutOrStdout(), js)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSANDBOXES\tCPU\tMEMORY\tDEFAULTS")
			for _, t := range ts {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", t.Name,
					usageOf(fmt.Sprint(t.Usage.Sandboxes), t.Quota.MaxSandboxes, func(n int64) string { return fmt.Sprint(n) }),
					usageOf(cpuOr0(t.Usage.MilliCPU), t.Quota.MaxMilliCPU, cpuOr0),
					usageOf(memOr0(t.Usage.MemoryBytes), t.Quota.MaxMemoryBytes, memOr0),
					defaultsString(t.Defaults))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	cmd.AddCommand(create, update, get, ls)
	return cmd
}

func cpuOr0(m int64) string {
	if m == 0 {
		return "0"
	}
	return cpuString(m)
}

func memOr0(b int64) string {
	if b == 0 {
		return "0"
	}
	return humanBytes(b)
}

// usageOf writes "used/limit", or "used" when unlimited.
func usageOf(used string, limit int64, format func(int64) string) string {
	if limit == 0 {
		return used
	}
	return used + "/" + format(limit)
}

func defaultsString(d dsec.Resources) string {
	s := ""
	add := func(k, v string) {
		if s != "" {
			s += ","
		}
		s += k + "=" + v
	}
	if d.MilliCPU != 0 {
		add("cpu", cpuString(d.MilliCPU))
	}
	if d.MemoryBytes != 0 {
		add("memory", humanBytes(d.MemoryBytes))
	}
	if d.Pids != 0 {
		add("pids", fmt.Sprint(d.Pids))
	}
	if d.DiskBytes != 0 {
		add("disk", humanBytes(d.DiskBytes))
	}
	if s == "" {
		return "node's"
	}
	return s
}

// tenantJSON is the --json form of a tenant.
type tenantJSON struct {
	Name  string `json:"name"`
	Quota struct {
		MaxSandboxes   int64 `json:"max_sandboxes"`
		MaxMilliCPU    int64 `json:"max_milli_cpu"`
		MaxMemoryBytes int64 `json:"max_memory_bytes"`
		MaxImportBytes int64 `json:"max_import_bytes"`
	} `json:"quota"`
	Defaults struct {
		MilliCPU    int64 `json:"milli_cpu"`
		MemoryBytes int64 `json:"memory_bytes"`
		Pids        int64 `json:"pids"`
		DiskBytes   int64 `json:"disk_bytes"`
	} `json:"defaults"`
	Usage struct {
		Sandboxes   int64 `json:"sandboxes"`
		MilliCPU    int64 `json:"milli_cpu"`
		MemoryBytes int64 `json:"memory_bytes"`
	} `json:"usage"`
}

func toTenantJSON(t *dsec.Tenant) tenantJSON {
	var j tenantJSON
	j.Name = t.Name
	j.Quota.MaxSandboxes, j.Quota.MaxMilliCPU, j.Quota.MaxMemoryBytes, j.Quota.MaxImportBytes =
		t.Quota.MaxSandboxes, t.Quota.MaxMilliCPU, t.Quota.MaxMemoryBytes, t.Quota.MaxImportBytes
	j.Defaults.MilliCPU, j.Defaults.MemoryBytes, j.Defaults.Pids, j.Defaults.DiskBytes =
		t.Defaults.MilliCPU, t.Defaults.MemoryBytes, t.Defaults.Pids, t.Defaults.DiskBytes
	j.Usage.Sandboxes, j.Usage.MilliCPU, j.Usage.MemoryBytes = t.Usage.Sandboxes, t.Usage.MilliCPU, t.Usage.MemoryBytes
	return j
}

func printTenant(cmd *cobra.Command, t *dsec.Tenant, asJSON bool) error {
	out := cmd.OutOrStdout()
	if asJSON {
		return writeJSON(out, toTenantJSON(t))
	}
	limit := func(n int64, format func(int64) string) string {
		if n == 0 {
			return "unlimited"
		}
		return format(n)
	}
	orNode := func(n int64, format func(int64) string) string {
		if n == 0 {
			return "node's default"
		}
		return format(n)
	}
	count := func(n int64) string { return fmt.Sprint(n) }
	importLimit := "server's limit"
	if t.Quota.MaxImportBytes != 0 {
		importLimit = humanBytes(t.Quota.MaxImportBytes)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	for _, r := range [][2]string{
		{"name", t.Name},
		{"sandboxes", fmt.Sprintf("%d in use of %s", t.Usage.Sandboxes, limit(t.Quota.MaxSandboxes, count))},
		{"cpu", fmt.Sprintf("%s in use of %s", cpuOr0(t.Usage.MilliCPU), limit(t.Quota.MaxMilliCPU, cpuString))},
		{"memory", fmt.Sprintf("%s in use of %s", memOr0(t.Usage.MemoryBytes), limit(t.Quota.MaxMemoryBytes, humanBytes))},
		{"max import size", importLimit},
		{"default cpu", orNode(t.Defaults.MilliCPU, cpuString)},
		{"default memory", orNode(t.Defaults.MemoryBytes, humanBytes)},
		{"default pids", orNode(t.Defaults.Pids, count)},
		{"default disk", orNode(t.Defaults.DiskBytes, humanBytes)},
		{"created", ago(t.CreatedAt)},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", r[0], r[1])
	}
	return tw.Flush()
}
