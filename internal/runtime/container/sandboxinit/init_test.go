package sandboxinit

import (
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/agent"
)

func validInit() *agent.Init {
	return &agent.Init{
		Hostname:  "h",
		Layers:    []agent.Source{{Path: "/layers/top"}, {Path: "/layers/base"}},
		Writable:  &agent.Writable{Source: &agent.Source{Path: "/slot"}, Upper: "upper", Work: "work"},
		Container: &agent.ContainerInit{Rootfs: "/slot/rootfs", Caps: 5, UserTasks: "/t"},
	}
}

func TestConfigFrom(t *testing.T) {
	cfg, err := configFrom(validInit())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(cfg.lower, ":") != "/layers/top:/layers/base" || cfg.upper != "/slot/upper" || cfg.work != "/slot/work" ||
		cfg.hostname != "h" || cfg.Rootfs != "/slot/rootfs" || cfg.Caps != 5 || cfg.UserTasks != "/t" {
		t.Errorf("config %+v", cfg)
	}
	for _, tc := range []struct {
		edit func(*agent.Init)
		want string
	}{
		{func(in *agent.Init) { in.Layers = nil }, "layers: none"},
		{func(in *agent.Init) {
			in.Layers[1] = agent.Source{Block: &agent.BlockDevice{Serial: "s"}, FSType: "erofs"}
		}, "layers[1]: not a directory"},
		{func(in *agent.Init) { in.Writable = nil }, "writable: none"},
		{func(in *agent.Init) {
			in.Writable.Source = &agent.Source{Pmem: &agent.PmemDevice{}, FSType: "ext4"}
		}, "writable.source: not a directory"},
		{func(in *agent.Init) { in.Writable.Upper = "../x" }, "writable.upper"},
		{func(in *agent.Init) { in.Container = nil }, "container: none"},
		{func(in *agent.Init) { in.Container.Rootfs = "" }, "container.rootfs: empty"},
	} {
		in := validInit()
		tc.edit(in)
		if _, err := configFrom(in); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error with %q, got %v", tc.want, err)
		}
	}
}
